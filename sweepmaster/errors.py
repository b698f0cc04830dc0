"""Errors a user can cause.

Every error that bad input, a missing file or a conflicting database can cause derives from
:class:`SweepmasterError`. Its message is one line that names the problem; the CLI prints it and
exits with code 2. Internal invariants use ``assert`` instead.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DataError", "DeviceError", "StorageError", "SweepmasterError"]


class SweepmasterError(Exception):
    """Base of every error a user can cause; ``str(err)`` is a one-line message."""


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


class DataError(SweepmasterError):
    """Training data or tokenizer files are missing or unusable."""


class StorageError(SweepmasterError):
    """The storage URL is unreachable, has a foreign schema, or conflicts with the sweep."""


class DeviceError(SweepmasterError):
    """The devices asked for are not on this machine, or a job cannot fit any of them."""
