"""The syntax of the runtime's settings, without importing torch: sizes, device specs, fusion.

A sweep file's ``resources.devices``, ``resources.device_memory`` and ``resources.fusion`` are
checked when the file loads (``validate`` too), which must not pay for importing the runtime's
training modules; :mod:`~sweepmaster.runtime.devices.device` and
:mod:`~sweepmaster.runtime.planning.fusion_degree` use these. A device spec is parsed here into
:class:`DeviceEntry` s (:func:`parse_device_spec`); the device module turns them into devices.

Example:
    >>> parse_size("1.5 KiB")
    1536
    >>> check_fusion_mode("auto")
    'auto'
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, TypeAlias

__all__ = [
    "DEFAULT_HEADROOM_FRACTION", "HEADROOM_ENV", "MAX_DEVICES", "MAX_FUSION_DEGREE",
    "MAX_SIZE_BYTES", "DeviceEntry", "FusionMode", "check_fusion_mode", "headroom_from_env",
    "parse_device_spec", "parse_size",
]

#: ``"auto"``, ``"off"`` or a fixed fusion degree K >= 1.
FusionMode: TypeAlias = Literal["auto", "off"] | int

_CUDA_NAME = re.compile(r"cuda(?::(\d+))?")
_VIRTUAL = re.compile(r"cpu:(?:(\d+)\s*x\s*)?(.+)")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?")
_UNITS = {None: 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
#: Largest size in bytes: the store keeps byte counts in 64-bit integer columns.
MAX_SIZE_BYTES = 2**63 - 1
#: Most devices a spec may name (virtual devices included): each one is a worker thread with
#: its own memory budget and meters.
MAX_DEVICES = 256
#: Largest fixed fusion degree K: an array of K models trains as one, and past a few dozen
#: members no device holds the array (``auto`` measures at most
#: ``fusion_degree.MAX_AUTO_FUSION_DEGREE``).
MAX_FUSION_DEGREE = 256


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``"512MiB"``, ``"1.5 GiB"``, ``"4096"`` or ``4096``.

    Args:
        text: An int (bytes) or a number with an optional unit ``B``, ``KiB``, ``MiB``, ``GiB``,
            ``TiB`` (case-insensitive; ``KB``, ``MB``, ``GB`` mean the same binary units).

    Returns:
        The size in bytes (> 0, at most :data:`MAX_SIZE_BYTES`).

    Raises:
        ValueError: Not a size (a bool, a float, any other type), not positive, or larger
            than :data:`MAX_SIZE_BYTES` (8 EiB, what a 64-bit integer holds).
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"size {text!r} is not a number of bytes (an int) or a string with a "
                         "unit (B, KiB, MiB, GiB, TiB), e.g. '512MiB'")
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
        value = int(Fraction(match.group(1)) * _UNITS[unit[0] if unit else None])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    if value > MAX_SIZE_BYTES:
        raise ValueError(f"size {text!r} is larger than {MAX_SIZE_BYTES} bytes (8 EiB, what a "
                         "64-bit integer holds)")
    return value


#: Share of a GPU's usable memory kept free for allocator rounding and fragmentation.
DEFAULT_HEADROOM_FRACTION = 0.08
#: Environment variable overriding the headroom (a fraction in ``[0, 1)``, e.g. ``0.1``).
HEADROOM_ENV = "SWEEPMASTER_DEVICE_HEADROOM"


def headroom_from_env(default: float = DEFAULT_HEADROOM_FRACTION,
                      environ: Mapping[str, str] | None = None) -> float:
    """The headroom from :data:`HEADROOM_ENV`, or ``default`` when it is unset.

    Args:
        default: The headroom when the variable is unset or blank.
        environ: The environment; default ``os.environ``.

    Raises:
        ValueError: The variable is not a number in ``[0, 1)``:
            ``"<HEADROOM_ENV>: expected a fraction in [0, 1) such as 0.1, got '<text>'"``.
    """
    text = (os.environ if environ is None else environ).get(HEADROOM_ENV)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{HEADROOM_ENV}: expected a fraction in [0, 1) such as 0.1 (the share "
                         f"of a GPU's memory kept free), got {text!r}")
    return value


def check_fusion_mode(value: Any) -> FusionMode:
    """Check a fusion setting: ``"auto"``, ``"off"`` or an integer 1 <= K <= MAX_FUSION_DEGREE.

    Returns:
        The setting (an ``int`` for K).

    Raises:
        ValueError: ``"expected auto, off or an integer >= 1 (the fusion degree K), at most
            <MAX_FUSION_DEGREE>"`` for anything else.
    """
    if value in ("auto", "off"):
        return str(value)  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_FUSION_DEGREE:
        return value
    raise ValueError("expected auto, off or an integer >= 1 (the fusion degree K), at most "
                     f"{MAX_FUSION_DEGREE}")


@dataclass(frozen=True)
class DeviceEntry:
    """One device a spec names (nothing about the machine is looked at).

    Attributes:
        name: ``"cpu"`` (the host), ``"cpu:N"`` (a virtual device, numbered in spec order) or
            ``"cuda:N"``.
        budget_bytes: A virtual device's budget, or the host's cap (``device_memory``) that
            makes it a virtual device; ``None`` for the host without a cap.
        cap_bytes: A GPU's cap (``device_memory``), or ``None``.
    """

    name: str
    budget_bytes: int | None = None
    cap_bytes: int | None = None

    @property
    def cuda_index(self) -> int | None:
        """N of ``cuda:N``; ``None`` for a CPU device."""
        return int(self.name[5:]) if self.name.startswith("cuda:") else None


def parse_device_spec(
    spec: str, device_memory: str | int | None = None, num_gpus: int = 0
) -> list[DeviceEntry]:
    """Parse a device spec such as ``"auto"``, ``"cuda:0,cuda:1"`` or ``"cpu:2x512MiB"``.

    Args:
        spec: ``"auto"``, or a comma-separated list of ``cpu``, ``cuda`` / ``cuda:N`` and
            ``cpu:KxSIZE`` (K virtual devices of SIZE bytes; ``cpu:SIZE`` is one).
        device_memory: Optional cap (bytes or a size string) on every device's budget.
        num_gpus: The GPUs ``"auto"`` stands for (``cuda:0 .. cuda:num_gpus-1``; none: the
            host ``cpu``). Whether a named GPU exists is the caller's check.

    Returns:
        One entry per device, in the order given.

    Raises:
        ValueError: The spec is empty, has an empty entry, names an unknown device or one twice,
            names more than :data:`MAX_DEVICES` devices, or has a bad size.
    """
    cap = parse_size(device_memory) if device_memory is not None else None
    text = spec.strip().lower()
    if text == "auto":
        text = ",".join(f"cuda:{index}" for index in range(num_gpus)) or "cpu"
    names = [part.strip() for part in text.split(",")]
    if not text or any(not name for name in names):
        raise ValueError(f"device spec {spec!r} is empty or has an empty entry")
    entries: list[DeviceEntry] = []
    for name in names:
        num_virtual = sum(e.name.startswith("cpu:") for e in entries)
        for entry in _parse_entry(name, spec, cap, num_virtual, MAX_DEVICES - len(entries)):
            if any(e.name == entry.name for e in entries):
                raise ValueError(f"device spec {spec!r} names {entry.name} twice")
            entries.append(entry)
    return entries


def _parse_entry(name: str, spec: str, cap: int | None, num_virtual: int,
                 num_left: int) -> list[DeviceEntry]:
    """The devices of one entry of a spec; ``num_left``: how many more the spec may name."""
    if num_left < 1:
        raise ValueError(f"device spec {spec!r} names more than {MAX_DEVICES} devices")
    if name == "cpu":
        return [DeviceEntry("cpu", budget_bytes=cap)]
    virtual = _VIRTUAL.fullmatch(name)
    if virtual is not None:
        count = int(virtual.group(1) or 1)
        try:
            size = parse_size(virtual.group(2))
        except ValueError as err:
            raise ValueError(f"device spec {spec!r}: {name}: {err}") from None
        if count < 1:
            raise ValueError(f"device spec {spec!r}: {name} asks for no device")
        if count > num_left:
            raise ValueError(f"device spec {spec!r}: {name} asks for {count} devices, more "
                             f"than {MAX_DEVICES} in all")
        size = size if cap is None else min(size, cap)
        return [DeviceEntry(f"cpu:{num_virtual + index}", budget_bytes=size)
                for index in range(count)]
    match = _CUDA_NAME.fullmatch(name)
    if match is None:
        raise ValueError(
            f"device spec {spec!r}: unknown device {name!r}; expected auto, cpu, cuda, cuda:N "
            "or cpu:KxSIZE (e.g. cpu:2x512MiB)"
        )
    return [DeviceEntry(f"cuda:{int(match.group(1) or 0)}", cap_bytes=cap)]
