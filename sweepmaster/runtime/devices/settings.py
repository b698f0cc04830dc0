"""The syntax of the runtime's settings, without importing torch: byte sizes and fusion modes.

A sweep file's ``resources.device_memory`` and ``resources.fusion`` are checked when the file
loads (``validate`` too), which must not pay for importing the runtime's training modules;
:mod:`~sweepmaster.runtime.devices.device` and :mod:`~sweepmaster.runtime.planning.fusion_degree`
use these.

Example:
    >>> parse_size("1.5 KiB")
    1536
    >>> check_fusion_mode("auto")
    'auto'
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeAlias

__all__ = ["FusionMode", "check_fusion_mode", "parse_size"]

#: ``"auto"``, ``"off"`` or a fixed fusion degree K >= 1.
FusionMode: TypeAlias = Literal["auto", "off"] | int

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?")
_UNITS = {None: 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``"512MiB"``, ``"1.5 GiB"``, ``"4096"`` or ``4096``.

    Args:
        text: An int (bytes) or a number with an optional unit ``B``, ``KiB``, ``MiB``, ``GiB``,
            ``TiB`` (case-insensitive; ``KB``, ``MB``, ``GB`` mean the same binary units).

    Returns:
        The size in bytes (> 0).

    Raises:
        ValueError: Not a size, or not positive.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.fullmatch(text.strip().lower())
        if match is None:
            raise ValueError(
                f"size {text!r} is not a number of bytes with an optional unit "
                "(B, KiB, MiB, GiB, TiB), e.g. '512MiB'"
            )
        unit = match.group(2)
        value = int(float(match.group(1)) * _UNITS[unit[0] if unit else None])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def check_fusion_mode(value: Any) -> FusionMode:
    """Check a fusion setting: ``"auto"``, ``"off"`` or an integer K >= 1.

    Returns:
        The setting (an ``int`` for K).

    Raises:
        ValueError: ``"expected auto, off or an integer >= 1"`` for anything else.
    """
    if value in ("auto", "off"):
        return str(value)  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError("expected auto, off or an integer >= 1 (the fusion degree K)")
