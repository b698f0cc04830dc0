"""Errors a user can cause.

Every error that bad input, a missing file or a conflicting database can cause derives from
:class:`SweepmasterError`. Its message is one line that names the problem; the CLI prints it and
exits with code 2. Internal invariants use ``assert`` instead.

A message may quote what the user wrote (a key, a path, a driver's message); line breaks in
such text are shown escaped (as a backslash and an ``n``), so ``str(err)`` is always exactly one
line.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "ConfigError",
    "DataError",
    "DeviceError",
    "DiskFullError",
    "SettingError",
    "StorageError",
    "SweepmasterError",
    "disk_full_cause",
]


#: Every character ``str.splitlines`` breaks a line at, with how a message shows it.
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


class SweepmasterError(Exception):
    """Base of every error a user can cause; ``str(err)`` is a one-line message."""

    def __str__(self) -> str:
        return super().__str__().translate(_LINE_BREAKS)


class ConfigError(SweepmasterError):
    """A sweep.yaml (or an equivalent mapping) is invalid.

    Args:
        source: The file the configuration came from (or ``"<mapping>"``).
        key: The dotted key path of the offending entry, e.g. ``study.sampler`` or
            ``parameters.train.lr.min``; empty for the whole file.
        expected: What was expected there, in words.
    """

    def __init__(self, source: str, key: str, expected: str) -> None:
        self.source = source
        self.key = key
        self.expected = expected
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {expected}")


class SettingError(SweepmasterError):
    """An environment variable named ``SWEEPMASTER_*`` is not one sweepmaster reads."""


class DataError(SweepmasterError):
    """Training data or tokenizer files are missing or unusable."""


class StorageError(SweepmasterError):
    """The storage URL is unreachable, has a foreign schema, or conflicts with the sweep."""


class DeviceError(SweepmasterError):
    """The devices asked for are not on this machine, or a job cannot fit any of them."""


class DiskFullError(SweepmasterError):
    """A file could not be written: the filesystem holding it is full (or over quota).

    Args:
        path: The file or folder being written.
        what: What it holds, e.g. ``"the weights of trial 3"``.
    """

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = os.fspath(path)
        super().__init__(f"no space left on the device of {self.path}: cannot write {what}; "
                         "free space there and launch again (finished trials keep their "
                         "objectives, the others resume from their checkpoints)")


#: What a full disk reads like in messages that carry no errno (safetensors, SQLite).
_DISK_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "database or disk is full")


def disk_full_cause(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain (itself, causes, contexts) that says a disk is full.

    An ``OSError`` with ``errno`` ``ENOSPC`` or ``EDQUOT``, or an error whose message says so
    (a library that wraps it in its own type: safetensors, SQLite). ``None`` when none does.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return error
        if any(text in str(error).lower() for text in _DISK_FULL_TEXTS):
            return error
        todo += [e for e in (error.__cause__, error.__context__) if e is not None]
    return None
