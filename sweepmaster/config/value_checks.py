"""Values a user writes both in a sweep file and on the command line: devices, sizes, storage.

Each check raises ``ValueError`` in words (the schema turns it into a
:class:`~sweepmaster.errors.ConfigError` naming the key) or, for a command-line option,
:class:`~sweepmaster.errors.ConfigError` naming the option.
"""

from __future__ import annotations

import os
import re

from sweepmaster.errors import ConfigError
from sweepmaster.runtime.devices.settings import MAX_SIZE_BYTES, parse_device_spec, parse_size

__all__ = [
    "DEVICE_SPEC_WORDS",
    "SIZE_WORDS",
    "check_devices",
    "check_host_memory",
    "check_size",
    "check_storage_option",
    "storage_url_problem",
]


DEVICE_SPEC_WORDS = ("a device spec: auto, cpu, cuda, cuda:N or cpu:KxSIZE, comma-separated "
                     "(e.g. cuda:0,cuda:1 or cpu:2x512MiB)")
#: A size without a unit (``512``, ``1.5``): refused where a user writes a size (a file, the
#: command line), which reads it as bytes while ``8`` means 8 GiB to whoever writes it.
_UNITLESS_SIZE = r"\d+(?:\.\d+)?"
#: A virtual device whose size has no unit (``cpu:2x512``).
_UNITLESS_VIRTUAL = re.compile(rf"cpu:(?:\d+\s*x\s*)?({_UNITLESS_SIZE})\s*")
#: What ``resources.device_memory`` accepts, in words (also used by ``--device-memory``).
SIZE_WORDS = "a positive size with a unit B, KiB, MiB, GiB or TiB, e.g. 8GiB"


def check_devices(spec: str) -> None:
    """Check a device spec's syntax (not whether its GPUs exist: that is checked at launch).

    A virtual device's size needs a unit (``cpu:2x512MiB``; ``cpu:2x512`` is refused rather
    than read as 512 bytes).

    The grammar is :func:`~sweepmaster.runtime.devices.settings.parse_device_spec`, the one the
    executor's devices are built from; it imports no torch.

    Raises:
        ValueError: ``"expected <DEVICE_SPEC_WORDS> (<what is wrong>)"``.
    """
    try:
        parse_device_spec(spec)
    except ValueError as err:
        detail = re.sub(r"^device spec '.*?'(: | is | )", "", str(err)).split("; expected")[0]
        detail = re.sub(r": size ('.*?') is not a number.*", r": \1 is not a size", detail)
        detail = detail.replace("empty or has an empty entry", "an entry is empty")
        raise ValueError(f"expected {DEVICE_SPEC_WORDS} ({detail})") from None
    for entry in spec.lower().split(","):
        unitless = _UNITLESS_VIRTUAL.fullmatch(entry.strip())
        if unitless is not None:
            raise ValueError(f"expected {DEVICE_SPEC_WORDS} ({entry.strip()}: "
                             f"{_no_unit(unitless.group(1))})")


def check_size(size: object) -> int:
    """Parse a byte size a user wrote, such as ``"8GiB"`` or ``"4096B"``: a unit is required.

    A number without a unit (``8``, ``"8"``) is refused rather than read as 8 bytes, as a
    virtual device's size is (:func:`check_devices`); ``B`` gives an exact count of bytes. The
    Python API (``Executor(device_memory=...)``,
    :func:`~sweepmaster.runtime.devices.settings.parse_size`) takes an int of bytes.

    Returns:
        The size in bytes.

    Raises:
        ValueError: ``"expected <SIZE_WORDS>"``, and what to write for a missing unit (a
            float such as ``8.5`` too); a bool or any other type is no size.
    """
    if isinstance(size, float):
        size = str(size)  # a number without its unit, as "8.5" is
    try:
        num_bytes = parse_size(size)  # type: ignore[arg-type]  # refuses any other type
    except ValueError as err:
        too_large = " (at most 8 EiB, what a 64-bit integer holds)" \
            if f"larger than {MAX_SIZE_BYTES}" in str(err) else ""
        raise ValueError(f"expected {SIZE_WORDS}{too_large}") from None
    text = str(size).strip()
    if re.fullmatch(_UNITLESS_SIZE, text):
        raise ValueError(f"expected {SIZE_WORDS} ({_no_unit(text)})")
    return num_bytes


def storage_url_problem(url: str) -> str | None:
    """What makes a storage URL unusable before connecting, or ``None``.

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``file::memory:`` or
    ``mode=memory`` with ``uri=true``) lives only as long as one connection: the study,
    sweepmaster's tables and the workers' heartbeats each use their own, so none would see
    the others' tables. A URL SQLAlchemy cannot parse is left to the connection's own message.

    Returns:
        ``"expected a database file (e.g. sqlite:///sweepmaster.db) or a server: ..."``, or
        ``None``.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    uri = parsed.query.get("uri") == "true"
    memory = (database.removeprefix("file:") if uri else database) in ("", ":memory:") \
        or "mode=memory" in database \
        or parsed.query.get("mode") == "memory"
    if not memory:
        return None
    return ("expected a database file (e.g. sqlite:///sweepmaster.db) or a server: an "
            "in-memory SQLite database lives only as long as one connection, and a sweep "
            "opens several")


def check_storage_option(url: str | None) -> None:
    """Check ``--storage`` (or ``$SWEEPMASTER_STORAGE``) as the file's ``storage`` is checked.

    Raises:
        ConfigError: ``"--storage: <storage_url_problem>, got '<url>'"``.
    """
    problem = None if url is None else storage_url_problem(url)
    if problem is not None:
        raise ConfigError("--storage", "", f"{problem}, got {url!r}")


def _physical_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (``sysconf``), or ``None`` where it is unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system, or not reported
        return None


def check_host_memory(devices: str, device_memory: str | int | None,
                      has_gpu: bool = True) -> None:
    """Check that the CPU devices of a spec fit the machine's physical memory together.

    Virtual devices (``cpu:2x512MiB``) and the host capped by ``device_memory`` are budgets
    taken from the host's memory at once; more than it has would be planned as fitting and
    then swap or be killed. ``auto`` is the host where the machine has no GPU (``has_gpu``
    false); GPUs are checked when the devices are opened.

    Raises:
        ValueError: ``"expected CPU devices of at most the machine's <N> GiB ..."``.
    """
    auto = devices.strip().lower() == "auto"
    if auto and has_gpu:
        return
    try:
        entries = parse_device_spec("cpu" if auto else devices, device_memory)
    except ValueError:
        return  # the syntax is the devices' own check
    total = sum(e.budget_bytes for e in entries if e.cuda_index is None and e.budget_bytes)
    physical = _physical_memory_bytes()
    if physical is not None and total > physical:
        shown = "auto: the host, no GPU on this machine" if auto else devices
        raise ValueError(f"expected CPU devices of at most the machine's {physical / 2**30:.1f} "
                         f"GiB of memory in all, got {total / 2**30:.1f} GiB ({shown}"
                         + (f", device_memory {device_memory}" if device_memory else "")
                         + ")")


def _no_unit(size: str) -> str:
    """What is wrong with a size written without a unit, and what to write instead."""
    return f"the size {size} has no unit; write {size}MiB, {size}GiB or {size}B"
