"""Devices the executor trains on: the host CPU, CUDA GPUs and virtual devices.

A device is an accelerator with a memory budget (README, "Devices, and models larger than a
device"):

* :class:`Device` ``"cpu"``: the host CPU as a device; its budget is the RAM available now
  (``MemAvailable``), and it has no meter. ``Device("cuda:N")`` is kept for old callers.
* :class:`CudaDevice` ``"cuda:N"``: a GPU; its budget is what jobs can really use there,
  measured when it is opened, less a headroom, or a lower cap
  (:mod:`~sweepmaster.runtime.devices.budget`).
* :class:`VirtualDevice` ``"cpu:K"``: CPU memory with a byte budget, accounted by a
  :class:`~sweepmaster.runtime.devices.meter.VirtualMeter` that raises ``torch.OutOfMemoryError``
  past the budget. It lets every capability (spilling, planning, OOM) run and be tested without a
  GPU.

Host <-> device transfers are real copies made by the device's
:class:`~sweepmaster.runtime.devices.transfer.TransferEngine` (:attr:`Device.transfer`) and counted
by its :class:`TransferStats` (promote: host -> device; demote: device -> host).

Two devices are equal when they have the same name (the name identifies the hardware).

Device specs (:func:`parse_devices`): ``auto`` (every CUDA GPU, else the host CPU), ``cpu``,
``cuda``, ``cuda:N``, ``cpu:KxSIZE`` (K virtual devices of SIZE each, e.g. ``cpu:2x512MiB``;
``cpu:SIZE`` is one), comma-separated. Sizes are bytes with an optional unit ``B``, ``KiB``,
``MiB``, ``GiB`` or ``TiB`` (``KB``/``MB``/``GB`` are read as the binary units too).

Example:
    >>> parse_devices("cpu")
    [Device(name='cpu')]
    >>> [d.name for d in parse_devices("cpu:2x512MiB")]
    ['cpu:0', 'cpu:1']
    >>> parse_size("1.5 KiB")
    1536
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from sweepmaster.runtime.devices.budget import (
    CudaBudget,
    headroom_from_env,
    measure_cuda,
    plan_cuda_budget,
    use_expandable_segments,
)
from sweepmaster.runtime.devices.meter import CudaMeter, MemoryMeter, VirtualMeter
from sweepmaster.runtime.devices.settings import parse_device_spec, parse_size
from sweepmaster.runtime.devices.transfer import TransferEngine, engine_for

__all__ = [
    "CudaDevice",
    "Device",
    "TransferStats",
    "VirtualDevice",
    "check_device_spec",
    "executor_devices",
    "parse_devices",
    "parse_size",
]

_OPEN_LOCK = threading.Lock()  # measuring a GPU's budget

CopyKind = Literal["promote", "demote", "p2p_in", "p2p_out"]
_COUNTERS: dict[CopyKind, tuple[str, str]] = {  # TransferStats' bytes and count of each kind
    "promote": ("promote_bytes", "num_promotes"),
    "demote": ("demote_bytes", "num_demotes"),
    "p2p_in": ("p2p_in_bytes", "num_p2p_in"),
    "p2p_out": ("p2p_out_bytes", "num_p2p_out"),
}


class TransferStats:
    """Bytes and counts of the copies of one device; thread-safe.

    Host <-> device copies (the swap volume) and device <-> device copies (p2p, Harmony) are
    counted apart.

    Attributes:
        promote_bytes: Bytes copied host -> device.
        demote_bytes: Bytes copied device -> host.
        num_promotes: Host -> device copies.
        num_demotes: Device -> host copies.
        p2p_in_bytes: Bytes copied from another device to this one.
        p2p_out_bytes: Bytes copied from this device to another one.
        num_p2p_in: Copies from another device.
        num_p2p_out: Copies to another device.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.promote_bytes = 0
        self.demote_bytes = 0
        self.num_promotes = 0
        self.num_demotes = 0
        self.p2p_in_bytes = 0
        self.p2p_out_bytes = 0
        self.num_p2p_in = 0
        self.num_p2p_out = 0

    def add(self, kind: CopyKind, num_bytes: int) -> None:
        """Count one copy of ``num_bytes`` bytes; a copy of nothing is not counted.

        Args:
            kind: ``"promote"`` (host -> device), ``"demote"`` (device -> host), ``"p2p_in"``
                (from another device) or ``"p2p_out"`` (to another device).
            num_bytes: Bytes it copies.
        """
        if not num_bytes:
            return
        bytes_name, count_name = _COUNTERS[kind]
        with self._lock:
            setattr(self, bytes_name, getattr(self, bytes_name) + num_bytes)
            setattr(self, count_name, getattr(self, count_name) + 1)

    @property
    def swap_bytes(self) -> int:
        """Bytes moved in both directions (the swap volume)."""
        return self.promote_bytes + self.demote_bytes

    @property
    def p2p_bytes(self) -> int:
        """Bytes moved device <-> device in both directions (not part of the swap volume)."""
        return self.p2p_in_bytes + self.p2p_out_bytes


@dataclass(frozen=True, eq=False)
class Device:
    """One device a job can run on; the host CPU (``"cpu"``) or, for old callers, ``"cuda:N"``.

    Attributes:
        name: The device name, ``"cpu"`` or ``"cuda:N"``.
    """

    name: str
    transfers: TransferStats = field(
        default_factory=TransferStats, init=False, repr=False, compare=False
    )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` that tensors on this device live on."""
        return torch.device(self.name)

    @property
    def budget_bytes(self) -> int:
        """Memory a job may use here (bytes): available RAM for the host, total memory of a GPU.

        ``Device("cuda:N")`` is kept for old callers; :class:`CudaDevice` gives a GPU's real
        budget.
        """
        if self.torch_device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.torch_device).total_memory)
        return available_ram_bytes()

    @property
    def meter(self) -> MemoryMeter | None:
        """The device's memory meter; ``None`` for the (unmetered) host CPU."""
        return None

    @property
    def pin_host_memory(self) -> bool:
        """Whether host copies of state spilled from this device are pinned (CUDA)."""
        return self.torch_device.type == "cuda"

    def empty_like(self, hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Allocate uninitialized device tensors shaped like ``hosts`` (counted by the meter).

        The budget is checked once for the whole batch (``sum(host.nbytes)``): on CUDA each
        check reads the allocator's statistics, which costs more host time than a small
        allocation, so a shard's parameters are reserved together.

        Raises:
            torch.OutOfMemoryError: They do not fit the device budget.
        """
        meter = self.meter
        if meter is not None:
            meter.reserve(sum(host.nbytes for host in hosts))
        with meter.unmetered() if meter is not None else contextlib.nullcontext():
            tensors = [torch.empty(host.shape, dtype=host.dtype, device=self.torch_device)
                       for host in hosts]
        if meter is not None:
            for tensor in tensors:
                meter.track(tensor)
        return tensors

    @property
    def transfer(self) -> TransferEngine:
        """The device's transfer engine: every host <-> device copy goes through it."""
        return engine_for(self)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Promote: a new copy of a host tensor on this device, counted in :attr:`transfers`.

        On CUDA the copy runs on the transfer engine's stream, ordered before the calling
        thread's later work on its current stream.

        Returns:
            The device copy.

        Raises:
            torch.OutOfMemoryError: The copy does not fit the device budget.
        """
        return self.transfer.promote([host])[0]

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Demote: copy a device tensor into ``out`` (or a new host tensor), counted; wait for it.

        Args:
            tensor: The device tensor.
            out: A host tensor of the same shape and dtype to copy into, or ``None``.

        Returns:
            The host copy (``out`` if given, else a new pageable host tensor).
        """
        return self.transfer.to_host(tensor, out)


@dataclass(frozen=True, eq=False)
class CudaDevice(Device):
    """A CUDA GPU, optionally capped below what it has.

    Its budget is what a job can really use (:mod:`~sweepmaster.runtime.devices.budget`): measured
    when the device is first asked for it (:attr:`cuda_budget`), ``min(cap, total - what the
    context, other processes and the allocator's workspaces hold)`` less a headroom. Measuring
    also limits this process's caching allocator on the GPU to its workspace plus the budget
    (``torch.cuda.set_per_process_memory_fraction``): the budget is a hard cap, during compute
    too.

    Attributes:
        name: ``"cuda:N"``.
        memory_cap_bytes: Cap on the memory jobs may use (bytes), or ``None`` for the GPU's.
        headroom_fraction: Share of the usable memory kept out of the budget, in ``[0, 1)``;
            ``None``: the ``SWEEPMASTER_DEVICE_HEADROOM`` environment variable, else
            :data:`~sweepmaster.runtime.devices.budget.DEFAULT_HEADROOM_FRACTION`.
    """

    memory_cap_bytes: int | None = None
    headroom_fraction: float | None = None
    _meter: CudaMeter | None = field(default=None, init=False, repr=False, compare=False)
    _budget: CudaBudget | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def cuda_budget(self) -> CudaBudget:
        """The GPU's budget, measured (and the allocator limited) on first use.

        Raises:
            ValueError: Bad headroom or cap, or no memory left for jobs.
        """
        with _OPEN_LOCK:
            if self._budget is None:
                headroom = self.headroom_fraction
                if headroom is None:
                    headroom = headroom_from_env()
                use_expandable_segments()
                total, free, reserved = measure_cuda(self.torch_device)
                budget = plan_cuda_budget(total, free, reserved, self.memory_cap_bytes, headroom)
                torch.cuda.set_per_process_memory_fraction(
                    budget.memory_fraction, self.torch_device
                )
                object.__setattr__(self, "_budget", budget)
            assert self._budget is not None
            return self._budget

    @property
    def budget_bytes(self) -> int:
        """What plans and the meter budget for (bytes; see :attr:`cuda_budget`)."""
        return self.cuda_budget.budget_bytes

    @property
    def meter(self) -> MemoryMeter:
        """The GPU's :class:`~sweepmaster.runtime.devices.meter.CudaMeter` (reserved memory)."""
        if self._meter is None:
            budget = self.cuda_budget
            meter = CudaMeter(
                self.torch_device, budget.budget_bytes, self.name, budget.workspace_bytes
            )
            object.__setattr__(self, "_meter", meter)
        assert self._meter is not None
        return self._meter


@dataclass(frozen=True, eq=False)
class VirtualDevice(Device):
    """CPU memory with a byte budget: the accelerator of a CPU-only machine.

    Tensors "on" it are CPU tensors counted by its
    :class:`~sweepmaster.runtime.devices.meter.VirtualMeter` (:attr:`meter`); promotion is a real
    ``clone`` of host memory.

    Attributes:
        name: ``"cpu:K"`` (or ``"cpu"`` for the capped host).
        budget_bytes: The budget (bytes).
    """

    budget_bytes: int = 0  # type: ignore[assignment]
    _meter: VirtualMeter = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"virtual device {self.name}: budget must be > 0 bytes")
        object.__setattr__(self, "_meter", VirtualMeter(self.budget_bytes, self.name))

    @property
    def torch_device(self) -> torch.device:
        """``torch.device("cpu")``."""
        return torch.device("cpu")

    @property
    def meter(self) -> VirtualMeter:
        """The device's accountant."""
        return self._meter


def available_ram_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (bytes); total physical memory elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_devices(
    spec: str, device_memory: str | int | None = None, device_headroom: float | None = None
) -> list[Device]:
    """Parse a device spec such as ``"auto"``, ``"cuda:0,cuda:1"`` or ``"cpu:2x512MiB"``.

    Args:
        spec: ``"auto"`` (every CUDA GPU, else the host CPU), or a comma-separated list of
            ``cpu`` (the host), ``cuda`` / ``cuda:N`` (``cuda`` means ``cuda:0``) and
            ``cpu:KxSIZE`` (K virtual devices of SIZE bytes; ``cpu:SIZE`` is one), see the module
            doc for sizes.
        device_memory: Optional cap (bytes or a size string) on every device's budget; the
            host ``cpu`` with a cap becomes a virtual device of that budget.
        device_headroom: Share of a GPU's usable memory kept out of its budget, in ``[0, 1)``
            (:class:`CudaDevice`); ``None``: the environment's or the default.

    Returns:
        The devices, in the order given; virtual devices are named ``cpu:0``, ``cpu:1``, ...

    Raises:
        ValueError: The spec is empty, has an empty entry, names an unknown device or one twice,
            asks for a CUDA device this machine does not have, or has a bad size or headroom.
    """
    if device_headroom is not None and not 0.0 <= device_headroom < 1.0:
        raise ValueError(f"device headroom must be a fraction in [0, 1), got {device_headroom}")
    devices = _parse(spec, device_memory, check_cuda=True)
    if device_headroom is None:
        return devices
    return [
        CudaDevice(d.name, d.memory_cap_bytes, device_headroom)
        if isinstance(d, CudaDevice)
        else d
        for d in devices
    ]


def executor_devices(devices: object, device_memory: object = None) -> list[Device]:
    """The devices a ``ShardExecutor`` is given: a spec string (parsed) or ``Device`` objects.

    Args:
        devices: A spec for :func:`parse_devices` (``"auto"``, ``"cuda:0,cuda:1"``,
            ``"cpu:2x512MiB"``), or a sequence of :class:`Device` objects used as they are.
        device_memory: A cap on every parsed device's budget: an int of bytes or a size with a
            unit (``"8GiB"``); ``None``: none.

    Returns:
        The devices, in the order given.

    Raises:
        TypeError: ``devices`` is neither a spec string nor a sequence of ``Device`` objects.
        ValueError: As :func:`parse_devices`; ``device_memory`` is a string without a unit
            (``"512"``: bytes to the parser, MiB or GiB to whoever wrote it; an int is a number
            of bytes), or is given with ``Device`` objects (it caps only devices it parses).
    """
    if not isinstance(devices, str):
        if not isinstance(devices, Sequence) or not all(isinstance(d, Device) for d in devices):
            raise TypeError("devices must be a device spec string (e.g. 'auto', 'cpu', "
                            "'cuda:0,cuda:1', 'cpu:2x256MiB') or a sequence of Device objects, "
                            f"got {devices!r}")
        if device_memory is not None:
            raise ValueError("device_memory caps the devices of a spec string; with Device "
                             "objects give each its budget instead")
        return list(devices)
    if isinstance(device_memory, str):
        unitless = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*", device_memory)
        if unitless is not None:
            size = unitless.group(1)
            raise ValueError(f"device_memory {device_memory!r} has no unit; write "
                             f"'{size}MiB', '{size}GiB' or '{size}B' (an int is a number of "
                             "bytes)")
    return parse_devices(devices, device_memory)  # type: ignore[arg-type]  # checked there


def check_device_spec(spec: str, device_memory: str | int | None = None) -> None:
    """Check the syntax of a device spec (and cap) without looking at the machine.

    Accepts exactly what :func:`parse_devices` accepts on a machine with every GPU named, so a
    sweep.yaml asking for ``cuda:1`` is valid on a laptop; whether the GPU exists is checked
    when the devices are opened. Torch-free:
    :func:`~sweepmaster.runtime.devices.settings.parse_device_spec`.

    Raises:
        ValueError: As :func:`parse_devices`, except for a missing CUDA device.
    """
    parse_device_spec(spec, device_memory)


def _parse(spec: str, device_memory: str | int | None, check_cuda: bool) -> list[Device]:
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices: list[Device] = []
    for entry in parse_device_spec(spec, device_memory, num_gpus):
        index = entry.cuda_index
        if index is None:
            if entry.budget_bytes is None:  # the host, uncapped
                devices.append(Device("cpu"))
            else:
                devices.append(VirtualDevice(entry.name, budget_bytes=entry.budget_bytes))
            continue
        if check_cuda and index >= num_gpus:
            have = f"only {num_gpus} CUDA device(s)" if num_gpus else "no CUDA device"
            raise ValueError(f"device spec {spec!r}: {entry.name} requested but this machine "
                             f"has {have}")
        devices.append(CudaDevice(entry.name, memory_cap_bytes=entry.cap_bytes))
    return devices
