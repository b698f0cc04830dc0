"""Errors a user can cause.

Every error that bad input, a missing file or a conflicting database can cause derives from
:class:`SweepmasterError`. Its message is one line that names the problem; the CLI prints it and
exits with code 2. Internal invariants use ``assert`` instead.

A message may quote what the user wrote (a key, a path, a driver's message); line breaks in
such text are shown escaped (as a backslash and an ``n``), so ``str(err)`` is always exactly one
line.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataError",
    "DeviceError",
    "SettingError",
    "StorageError",
    "SweepmasterError",
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
