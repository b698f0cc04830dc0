"""Memory meters: live tensor bytes of one device, checked against its budget.

A virtual device (CPU memory with a byte budget; README, "Devices, and models larger than a
device") has no allocator of its own, so :class:`VirtualMeter` is its accountant. It counts
**storage bytes**: every tensor storage that an operation creates while the meter is active (a
``TorchDispatchMode``, so autograd's backward, optimizer steps and factory functions are seen too),
plus storages registered explicitly with :meth:`MemoryMeter.track` (copies made outside the mode,
e.g. by a prefetch thread). A storage is counted once, however many views share it, and uncounted
by a ``weakref.finalize`` on the storage object when its memory is released.

An output storage is "created" by an operation when it is not the storage of one of the operation's
inputs; so views and in-place ops (``copy_`` into a host buffer, ``add_``) never count. When an
operation's outputs take the live bytes past the budget the meter raises
``torch.OutOfMemoryError`` from that operation; the outputs are dropped with the exception, so the
caller sees what a CUDA allocator would do. :meth:`MemoryMeter.reserve` checks an allocation of a
known size *before* it happens (used for host -> device copies). Known blind spots: scratch memory
an aten kernel allocates and frees internally, and ``UntypedStorage.resize_`` (unused by the
runtime).

:class:`CudaMeter` gives the same interface over ``torch.cuda`` memory statistics.

Cross-checked in ``tests/runtime/devices/test_device.py`` against
``torch.distributed._tools.mem_tracker.MemTracker`` on a plain training step.

Example:
    >>> meter = VirtualMeter(budget_bytes=1 << 20, name="cpu:0")
    >>> with meter.metering():
    ...     x = torch.zeros(1024)  # 4 KiB
    >>> meter.live_bytes
    4096
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sweepmaster.runtime.devices.budget import new_reservation_bytes

__all__ = ["CudaMeter", "MemoryMeter", "VirtualMeter", "format_bytes"]


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in MiB, e.g. ``"64.0 MiB"`` (three decimals below 1 MiB: ``"0.191 MiB"``)."""
    mib = num_bytes / 2**20
    return f"{mib:.1f} MiB" if mib >= 1 else f"{mib:.3f} MiB"


class MemoryMeter(ABC):
    """Live and peak tensor bytes of one device, against a budget; thread-safe.

    Attributes:
        name: The device's name, for messages.
        budget_bytes: The device budget (bytes).
        shortfall_bytes: By how much the last allocation this meter refused would have passed
            the budget (bytes; 0 before any). An out-of-memory error of the CUDA allocator
            itself does not set it.
    """

    def __init__(self, budget_bytes: int, name: str) -> None:
        self.name = name
        self.budget_bytes = int(budget_bytes)
        self.shortfall_bytes = 0

    @property
    @abstractmethod
    def live_bytes(self) -> int:
        """Bytes of tensor storage resident now."""

    @property
    @abstractmethod
    def peak_bytes(self) -> int:
        """Highest ``live_bytes`` since construction or the last :meth:`reset_peak`."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Restart peak tracking from the current live bytes."""

    @abstractmethod
    def metering(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the calling thread's new tensors are counted (no-op on CUDA)."""

    @abstractmethod
    def track(self, tensor: torch.Tensor) -> None:
        """Count a tensor allocated outside :meth:`metering` (no-op where the allocator counts).

        Raises:
            torch.OutOfMemoryError: It takes the live bytes past the budget.
        """

    def unmetered(self) -> contextlib.AbstractContextManager[None]:
        """Context in which new tensors of the calling thread are host memory, not counted."""
        return contextlib.nullcontext()

    def reserve(self, num_bytes: int) -> None:
        """Check that ``num_bytes`` more would fit, before allocating them.

        Raises:
            torch.OutOfMemoryError: ``live_bytes + num_bytes`` exceeds the budget.
        """
        if self.live_bytes + num_bytes > self.budget_bytes:
            raise self._oom(num_bytes)

    def _oom(self, num_bytes: int) -> torch.OutOfMemoryError:
        self.shortfall_bytes = self.live_bytes + num_bytes - self.budget_bytes
        return torch.OutOfMemoryError(
            f"device {self.name} out of memory: {format_bytes(num_bytes)} more on "
            f"{format_bytes(self.live_bytes)} live passes its budget of "
            f"{format_bytes(self.budget_bytes)}"
        )


class VirtualMeter(MemoryMeter):
    """Storage-byte accountant of a virtual device (see the module doc).

    Args:
        budget_bytes: Live bytes allowed; more raises ``torch.OutOfMemoryError``.
        name: The device's name, for messages.
    """

    def __init__(self, budget_bytes: int, name: str = "virtual") -> None:
        super().__init__(budget_bytes, name)
        self._lock = threading.RLock()
        self._live_bytes = 0
        self._peak_bytes = 0
        self._tracked: dict[int, int] = {}  # id(storage) -> bytes; removed by the finalizer
        self._local = threading.local()
        self.num_ooms = 0

    @property
    def live_bytes(self) -> int:
        """Bytes of counted storages still alive."""
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        """Highest live bytes admitted (an allocation that raised is not part of it)."""
        return self._peak_bytes

    def reset_peak(self) -> None:
        """Restart peak tracking from the current live bytes."""
        with self._lock:
            self._peak_bytes = self._live_bytes

    @contextlib.contextmanager
    def metering(self) -> Iterator[None]:
        """Count the storages that operations of the calling thread create in this context."""
        with _MeterMode(self):
            yield

    @contextlib.contextmanager
    def unmetered(self) -> Iterator[None]:
        """Inside :meth:`metering`, leave the calling thread's new storages (host copies) out."""
        previous = getattr(self._local, "paused", False)
        self._local.paused = True
        try:
            yield
        finally:
            self._local.paused = previous

    def track(self, tensor: torch.Tensor) -> None:
        """Count the storage of ``tensor`` if it is not counted yet.

        Raises:
            torch.OutOfMemoryError: It takes the live bytes past the budget.
        """
        self._add(tensor.untyped_storage())

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        """Whether the storage of ``tensor`` is counted."""
        return id(tensor.untyped_storage()) in self._tracked

    def account(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Count the output storages an op created (those that are not an input's storage).

        For dispatch modes that combine metering with other work; :meth:`metering` uses it.

        Raises:
            torch.OutOfMemoryError: They take the live bytes past the budget.
        """
        if getattr(self._local, "paused", False):
            return
        tracked = self._tracked
        inputs: set[int] | None = None
        for tensor in (out,) if isinstance(out, torch.Tensor) else _tensors(out):
            storage = tensor.untyped_storage()
            if id(storage) in tracked:  # the common case: an in-place op or a view
                continue
            if inputs is None:  # only for a storage not counted yet
                sources = (args, tuple(kwargs.values())) if kwargs else args
                inputs = {id(t.untyped_storage()) for t in _tensors(sources)}
            self._add(storage, inputs)

    def _add(self, storage: torch.UntypedStorage, inputs: set[int] | None = None) -> None:
        key = id(storage)
        if key in self._tracked or (inputs is not None and key in inputs):
            return
        num_bytes = storage.nbytes()
        if num_bytes == 0:
            return
        with self._lock:
            if key in self._tracked:
                return
            self._tracked[key] = num_bytes
            self._live_bytes += num_bytes
            weakref.finalize(storage, self._release, key)
            if self._live_bytes > self.budget_bytes:
                self.num_ooms += 1
                self.shortfall_bytes = self._live_bytes - self.budget_bytes
                raise torch.OutOfMemoryError(
                    f"device {self.name} out of memory: allocating {format_bytes(num_bytes)} "
                    f"brings the live tensors to {format_bytes(self._live_bytes)}, past its "
                    f"budget of {format_bytes(self.budget_bytes)}"
                )
            self._peak_bytes = max(self._peak_bytes, self._live_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            self._live_bytes -= self._tracked.pop(key)


class _MeterMode(TorchDispatchMode):
    """Counts the output storages an op creates (not an input's storage) on a VirtualMeter."""

    def __init__(self, meter: VirtualMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.meter.account(args, kwargs, out)
        return out


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tensors, and lists / tuples of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                yield from _tensors(item)


class CudaMeter(MemoryMeter):
    """``torch.cuda`` memory statistics of one GPU behind the :class:`MemoryMeter` interface.

    It reads **reserved** memory (what the caching allocator holds from the driver, cached free
    blocks and rounding included: what other jobs cannot have), less ``baseline_bytes`` (the
    allocator's workspaces when the device was opened, see
    :mod:`~sweepmaster.runtime.devices.budget`). The allocator counts every allocation itself, so
    :meth:`metering` and :meth:`track` do nothing and no Python dispatch mode runs on the CUDA
    hot path; the budget is checked by :meth:`reserve` before host -> device copies and, during
    compute, by the allocator's limit (``torch.cuda.set_per_process_memory_fraction``, set by
    ``CudaDevice``).

    Args:
        device: The ``torch.device`` of the GPU.
        budget_bytes: Its budget (bytes).
        name: Its name, for messages.
        baseline_bytes: Reserved bytes that are not the jobs' (bytes).
    """

    def __init__(
        self, device: torch.device, budget_bytes: int, name: str, baseline_bytes: int = 0
    ) -> None:
        super().__init__(budget_bytes, name)
        self.device = device
        self.baseline_bytes = int(baseline_bytes)

    @property
    def live_bytes(self) -> int:
        """``torch.cuda.memory_reserved`` of the GPU less the baseline (bytes)."""
        return max(0, int(torch.cuda.memory_reserved(self.device)) - self.baseline_bytes)

    @property
    def peak_bytes(self) -> int:
        """``torch.cuda.max_memory_reserved`` of the GPU less the baseline (bytes)."""
        return max(0, int(torch.cuda.max_memory_reserved(self.device)) - self.baseline_bytes)

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats`` of the GPU."""
        torch.cuda.reset_peak_memory_stats(self.device)

    def reserve(self, num_bytes: int) -> None:
        """Check that ``num_bytes`` more would fit, counting the allocator's cached free blocks.

        Cached free blocks too fragmented to serve it are first handed back to the driver
        (``torch.cuda.empty_cache``, as the allocator itself does before it reports an OOM).

        Raises:
            torch.OutOfMemoryError: The reserved memory it may add takes the live bytes past
                the budget even then.
        """
        for attempt in range(2):
            # one snapshot of the allocator's statistics: each read builds the whole table
            stats = torch.cuda.memory_stats(self.device)
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            extra = new_reservation_bytes(num_bytes, reserved, allocated)
            if max(0, reserved - self.baseline_bytes) + extra <= self.budget_bytes:
                return
            if attempt == 0 and reserved > allocated:
                with torch.cuda.device(self.device):
                    torch.cuda.empty_cache()
        raise self._oom(num_bytes)

    def metering(self) -> contextlib.AbstractContextManager[None]:
        """No-op: the CUDA allocator counts every allocation."""
        return contextlib.nullcontext()

    def track(self, tensor: torch.Tensor) -> None:
        """No-op: the CUDA allocator counts every allocation."""
