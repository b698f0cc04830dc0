"""Swap of saved activations between a device and the host: packing hooks and copy engines.

mu-TWO (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) keeps, swaps or recomputes
each activation autograd saves for backward. This module is the swap's machinery; the decisions
come from :mod:`~sweepmaster.runtime.planning.memplan` and
:mod:`~sweepmaster.runtime.training.spill` drives it.

* :class:`LayerPacker` is a pair of ``torch.autograd.graph.saved_tensors_hooks`` callbacks for one
  layer pass. Parameters and buffers (and views of them) are never copied: the handle names the
  module tensor, whose data the shard promotes again before backward. Every other saved tensor
  belongs to a **slot**: one per distinct storage, in first-save order (a tensor saved twice, or
  several views of one storage, share a slot). A slot is kept on the device, or swapped: offloaded
  when first saved (or, for the layer's input, read back from the host copy the shard already
  has) and fetched before the layer's backward. A tensor on another device than the pass (a host
  tensor a device kernel saves, such as the RNG seed and offset of CUDA's fused attention, which
  its backward reads on the host) stays where it is and takes no slot.
* :class:`CopyEngine` moves storages through the device's
  :class:`~sweepmaster.runtime.devices.transfer.TransferEngine` as background copies, device
  buffers allocated (and metered) when a fetch is issued: on a virtual device, real copies on the
  device's one copy thread (FIFO, like a copy engine); on CUDA, its side copy stream, events,
  pinned host buffers and ``record_stream`` so the caching allocator never reuses memory a copy
  still reads.
* :class:`LayerEntry` starts a layer's own autograd graph and captures the gradient of its input,
  so a layer's backward can run alone, in a later task, from its output's gradient edge.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import DeviceTransfer, Transfer

__all__ = ["CopyEngine", "LayerEntry", "LayerPacker", "Slot", "SlotSource"]

SlotSource = Literal["input", "other"]


class LayerEntry(torch.autograd.Function):
    """Identity ``(x, anchor) -> x`` that starts a layer's graph; backward keeps ``grad(x)``.

    ``anchor`` is an empty tensor that requires grad, so the output requires grad although ``x``
    does not; the graph then holds no reference to ``x`` (a leaf would pin its storage). After
    backward, the input's gradient is ``node.grad`` of the output's ``grad_fn``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Return a view of ``x``."""
        ctx.grad = None
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        """Keep the gradient of ``x`` on the node; nothing flows further."""
        ctx.grad = grad
        return None, None


@dataclass(eq=False)
class Slot:
    """One saved storage of one layer pass.

    Attributes:
        index: Position in first-save order within the layer pass.
        num_bytes: Bytes of the storage.
        source: ``"input"`` (the layer's input) or ``"other"``.
        swap: Whether it is swapped (else autograd keeps it on the device, as usual).
        storage: The storage it was made from (a weak reference).
        host: Its host copy (an offload in flight, or the shard's own host copy of the input).
        device: A ``uint8`` view of the storage on the device, while a swapped slot is there.
        fetching: The fetch in flight, if any.
        num_unpacks: Handles not unpacked yet; the slot leaves the device when it reaches 0.
    """

    index: int
    num_bytes: int
    source: SlotSource
    swap: bool
    storage: weakref.ref[Any]
    host: HostCopy | None = None
    device: torch.Tensor | None = None
    fetching: DeviceCopy | None = field(default=None, repr=False)
    num_unpacks: int = 0

    def fetch(self, engine: CopyEngine) -> None:
        """Start copying a swapped slot back to the device (no-op if it is there or coming)."""
        if self.swap and self.device is None and self.fetching is None:
            assert self.host is not None
            self.fetching = engine.fetch(self.host.wait())

    def ready(self) -> None:
        """Wait until a fetched slot is on the device."""
        if self.fetching is not None:
            self.device = self.fetching.wait()
            self.fetching = None

    def release(self) -> None:
        """Drop the device copy (and a fetch in flight) of a swapped slot."""
        if self.fetching is not None:
            self.fetching.wait()
            self.fetching = None
        self.device = None


@dataclass(frozen=True)
class _ModuleRef:
    """A saved parameter or buffer (or a view of one): read from the module tensor at unpack."""

    owner: torch.Tensor
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    whole: bool


@dataclass(frozen=True)
class _Kept:
    tensor: torch.Tensor


@dataclass(frozen=True)
class _SlotRef:
    slot: Slot
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class LayerPacker:
    """``saved_tensors_hooks`` callbacks for one pass of one layer (see the module doc).

    Args:
        resident: The layer's parameters and buffers (device tensors now).
        layer_input: The layer's input on the device, or ``None``.
        swap: Per slot index, whether it is swapped; ``None`` keeps every slot (and records the
            slots, e.g. to profile them). Slots past its end (a pass that saves more than was
            profiled, e.g. another attention kernel) follow its last entry.
        engine: Copies offloads; needed when a slot is swapped.
        host_input: Host tensor holding the layer input's value (its storage layout), used
            instead of an offload when the input slot is swapped.
    """

    def __init__(
        self,
        resident: Sequence[torch.Tensor],
        layer_input: torch.Tensor | None,
        swap: Sequence[bool] | None = None,
        engine: CopyEngine | None = None,
        host_input: torch.Tensor | None = None,
    ) -> None:
        self._resident = {id(t.untyped_storage()): t for t in resident}
        anchor = layer_input if layer_input is not None else next(iter(resident), None)
        self._device = anchor.device if anchor is not None else None
        storage = layer_input.untyped_storage() if layer_input is not None else None
        self._input = weakref.ref(storage) if storage is not None else None
        self._swap = swap
        self._engine = engine
        self._host_input = host_input
        self._by_storage: dict[int, Slot] = {}
        self.slots: list[Slot] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that installs :meth:`pack` and :meth:`unpack`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def close(self) -> None:
        """Forget the layer pass (the graph may keep the packer; it must hold no tensor)."""
        self._resident.clear()
        self._by_storage.clear()
        self._input = None
        self._host_input = None
        self._engine = None

    def pack(self, tensor: torch.Tensor) -> Any:
        """Turn a tensor autograd saves into a handle (see the module doc)."""
        if isinstance(tensor, nn.Parameter):
            return _ModuleRef(tensor, tensor.dtype, tensor.size(), (), 0, True)
        if self._device is not None and tensor.device != self._device:
            # a host tensor a device kernel saves (the RNG seed and offset of CUDA's fused
            # attention): its backward reads it on the host, so it never moves and is no slot
            return _Kept(tensor)
        storage = tensor.untyped_storage()
        dtype, size, stride = tensor.dtype, tensor.size(), tuple(tensor.stride())
        offset = int(tensor.storage_offset())
        owner = self._resident.get(id(storage))
        if owner is not None:
            return _ModuleRef(owner, dtype, size, stride, offset, False)
        slot = self._by_storage.get(id(storage))
        if slot is None or slot.storage() is not storage:
            slot = self._new_slot(storage)
            self._by_storage[id(storage)] = slot
        if not slot.swap:
            # detached: a saved output's own grad_fn would otherwise hold the graph in a cycle
            # through this handle that no collector breaks, and a pass whose backward never
            # runs (it ran out of memory, say) would keep its activations on the device
            return _Kept(tensor.detach())
        slot.num_unpacks += 1
        return _SlotRef(slot, dtype, size, stride, offset)

    def _new_slot(self, storage: torch.UntypedStorage) -> Slot:
        index = len(self.slots)
        source: SlotSource = "other"
        if self._input is not None and storage is self._input():
            source = "input"
        swap = False
        if self._swap:
            swap = self._swap[min(index, len(self._swap) - 1)]
        slot = Slot(index, storage.nbytes(), source, swap, weakref.ref(storage))
        if swap and source == "input" and self._host_input is not None:
            slot.host = HostCopy(self._host_input, None)
        elif swap:
            assert self._engine is not None, "a swapped slot needs a copy engine"
            slot.host = self._engine.offload(_bytes_view(storage))
        self.slots.append(slot)
        return slot

    @staticmethod
    def unpack(handle: Any) -> torch.Tensor:
        """The tensor a handle stands for, on the device (its slot must be there)."""
        if isinstance(handle, _Kept):
            return handle.tensor
        if isinstance(handle, _ModuleRef):
            if handle.whole:
                return handle.owner
            owner = handle.owner.detach()
            if owner.dtype == handle.dtype:
                return owner.as_strided(handle.size, handle.stride, handle.offset)
            storage = owner.untyped_storage()
        else:
            slot = handle.slot
            slot.ready()
            if slot.device is None:
                raise RuntimeError(f"saved activation {slot.index} is not on the device")
            storage = slot.device.untyped_storage()
            slot.num_unpacks -= 1
            if slot.num_unpacks == 0:  # its last use: autograd holds what it still needs
                slot.device = None
        empty = torch.empty(0, dtype=handle.dtype, device=storage.device)
        return empty.set_(storage, handle.offset, handle.size, handle.stride)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8`` tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# ---------------------------------------------------------------------- copies


class HostCopy:
    """A host copy of a storage, maybe still being written (see :meth:`CopyEngine.offload`)."""

    def __init__(
        self,
        host: torch.Tensor,
        done: Transfer | None,
        torch_device: torch.device | None = None,
        source: torch.Tensor | None = None,
    ) -> None:
        self._host = host
        self._done = done  # None when complete
        self._device = torch_device
        self._source = source  # held until release_source: device bytes do not depend on timing

    def wait(self) -> torch.Tensor:
        """Block until the copy is complete; return the host tensor."""
        if self._done is not None:
            self._done.wait()
        self._done = None
        self._source = None
        return self._host

    def release_source(self) -> None:
        """Let the device memory the copy reads go, once the copy no longer needs it.

        On a virtual device, wait for the copy; on CUDA, make the compute stream wait for it (no
        host synchronization; ``record_stream`` keeps the allocator from reusing it earlier).
        """
        if self._done is not None and self._done.event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done.event)
        elif self._done is not None:
            self._done.wait()
        self._source = None

    @property
    def num_bytes(self) -> int:
        """Bytes of the host copy."""
        return self._host.nbytes


class DeviceCopy:
    """A device copy of a host tensor, maybe still in flight (see :meth:`CopyEngine.fetch`)."""

    def __init__(self, device_tensor: torch.Tensor, done: DeviceTransfer) -> None:
        self._tensor = device_tensor
        self._done: DeviceTransfer | None = done

    def wait(self) -> torch.Tensor:
        """Make the copy usable by the calling thread's compute; return the device tensor."""
        if self._done is not None:
            self._done.wait_device()
        self._done = None
        return self._tensor


class CopyEngine:
    """Host <-> device copies of one device, in order, off the compute thread or stream.

    Copies go through the device's transfer engine as background copies (the CUDA side stream,
    a virtual device's copy thread), counted in the device's ``transfers`` (offload: demote,
    fetch: promote) and in :attr:`moved_bytes`.

    Args:
        device: The device.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.moved_bytes = 0  # by this engine's calls, both directions

    def offload(self, source: torch.Tensor) -> HostCopy:
        """Start copying a device tensor to a new host tensor (``source`` is kept alive)."""
        device = self.device
        meter = device.meter
        self.moved_bytes += source.nbytes
        with meter.unmetered() if meter is not None else contextlib.nullcontext():
            host = torch.empty(
                source.shape, dtype=source.dtype, pin_memory=device.pin_host_memory
            )
        _, transfer = device.transfer.demote([source], [host], background=True)
        return HostCopy(host, transfer, device.torch_device, source)

    def fetch(self, host: torch.Tensor) -> DeviceCopy:
        """Allocate a device tensor now and start copying ``host`` into it.

        Raises:
            torch.OutOfMemoryError: The allocation does not fit the device budget.
        """
        (out,) = self.device.transfer.allocate([host])
        self.moved_bytes += host.nbytes
        return DeviceCopy(out, self.device.transfer.copy_in([out], [host], background=True))
