"""The one transfer layer: every host <-> device copy of a device, batched, counted, in order.

Hydra (Nagrecha & Kumar 2022) promotes a shard's state to the device before its task and demotes
it after; mu-TWO (Purandare et al., MLSys 2023) overlaps such swaps with compute. This module is
where those copies happen. A :class:`TransferEngine` per device (:func:`engine_for`):

* **promotes** a batch of host tensors: allocates the device tensors (metered on a virtual
  device, so a promotion past the budget raises ``torch.OutOfMemoryError`` before copying) and
  copies them in;
* **demotes** a batch of device tensors into their host tensors and returns a :class:`Transfer`
  that a reader of the host tensors waits on; the layer remembers which host storages a demote
  is still writing (process-wide: a job may move to another device), so a later promote of
  them on any device (or :func:`settle_all`, before a checkpoint or a result reads host state)
  waits for exactly that;
* copies a batch of device tensors **to another device** (:meth:`TransferEngine.p2p`, Harmony's
  p2p swaps: boundary activations and their gradients between the packs of a pipeline), never
  through the host;
* counts every copy in the device's
  :class:`~sweepmaster.runtime.devices.device.TransferStats`, one per tensor or flat buffer (the
  byte counts of the swap volume do not depend on batching); a p2p copy counts on both devices
  (out of the source, into the destination), apart from the swap volume.

On CUDA the copies run on side streams of the GPU, host -> device on one and device -> host on
another (the GPU's two copy engines), ordered after the compute stream's work on their sources
with ``wait_stream``, finished by a CUDA event that the compute stream (promote) or the host
(demote) waits on, with ``record_stream`` so the caching allocator does not reuse a source a
copy still reads; p2p copies run on a third side stream of the source GPU (Harmony's p2p
streams), finished by an event the destination's compute stream waits on (two devices on one
GPU take the same path: two streams). A promote of host memory waits on the host for the
demotes still writing it (:func:`settle_all` for all of them).

**Flat buffers.** Tensors that tile one contiguous buffer (a flat shard's views:
:mod:`~sweepmaster.runtime.training.flat`) move as one copy of the buffer
(:func:`coalesced_copies`), and their device copies are views of one device buffer laid out
the same (:meth:`TransferEngine.allocate`): one storage, one allocation, one copy, counted as
one. A flat shard's host buffers are pinned once when made on CUDA, so their copies are
asynchronous and direct. Any other pageable host tensor goes through a **pinned staging block**
from a :class:`~sweepmaster.runtime.devices.staging.StagingPool` sized by what is in flight
(one block per batch, the batch's tensors packed in it), so pinned memory is bounded by the
transfers in flight. On virtual devices the same calls copy inline, or, when the
caller asks for ``background`` copies (a prefetch, an activation swap), on the device's one copy
thread, in order, like a GPU's copy engine. That thread holds no tensor once a copy is done: the
device bytes a copy's tensors hold are freed when their caller drops them, whenever the thread
runs next (a descheduled copy thread must not keep a demoted shard on a metered device).

The host CPU as a device (``Device("cpu")``: no meter) computes on host memory itself, so its
engine works **in place** (:attr:`TransferEngine.in_place`): a promote hands back the host
tensors it is given, a demote into the tensors it reads copies nothing, and nothing is counted;
only a demote into other host tensors (a boundary buffer) copies, uncounted, as plain memory.

Example:
    >>> from sweepmaster.runtime.devices.device import VirtualDevice
    >>> device = VirtualDevice("cpu:0", budget_bytes=1 << 20)
    >>> engine = engine_for(device)
    >>> host = [torch.ones(4), torch.zeros(2, dtype=torch.int64)]
    >>> on_device = engine.promote(host)
    >>> engine.demote(on_device, host)[1].wait()
    >>> device.transfers.promote_bytes, device.transfers.num_promotes
    (32, 2)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from sweepmaster.runtime.devices.staging import (
    DEFAULT_STAGING_BYTES,
    StagingPool,
    pack_offsets,
    packed_views,
)

if TYPE_CHECKING:
    from sweepmaster.runtime.devices.device import CopyKind, Device

__all__ = [
    "Transfer",
    "TransferEngine",
    "coalesced_copies",
    "engine_for",
    "flat_buffer",
    "settle_all",
]

class Transfer:
    """A batch of copies, maybe still in flight; :meth:`wait` makes its results readable.

    Args:
        event: The CUDA event recorded after the copies, or ``None`` when they are complete.
        finish: Called once after the event completes (copy staged bytes to their pageable
            destinations, return the staging block).
        pending: The background copy of a virtual device (:meth:`TransferEngine.demote`), or
            ``None``.
    """

    def __init__(self, event: Any = None, finish: Callable[[], None] | None = None,
                 pending: concurrent.futures.Future[None] | None = None) -> None:
        self._event = event
        self._finish = finish
        self._pending = pending
        self._lock = threading.Lock()

    @property
    def event(self) -> Any:
        """The CUDA event of the copies while they may be in flight, else ``None``."""
        return self._event

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has returned (or nothing was in flight)."""
        return self._event is None and self._finish is None and self._pending is None

    def query(self) -> bool:
        """Whether the copies completed (without blocking)."""
        if self._pending is not None:
            return self._pending.done()
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block until the copies completed and their host results are in place.

        Raises:
            Exception: What a background copy raised.
        """
        with self._lock:
            if self._pending is not None:
                self._pending.result()
                self._pending = None
            if self._event is not None:
                self._event.synchronize()
                self._event = None
            if self._finish is not None:
                finish, self._finish = self._finish, None
                finish()


class TransferEngine:
    """Host <-> device copies of one device (see the module doc); thread-safe.

    Args:
        device: The device.
        staging_bytes: Bound on its pinned staging memory (bytes; CUDA only).
    """

    def __init__(self, device: Device, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.device = device
        self.cuda = device.torch_device.type == "cuda"
        #: The host CPU (unmetered): device tensors are host tensors, nothing is copied or
        #: counted (see the module doc).
        self.in_place = not self.cuda and device.meter is None
        self.staging = StagingPool(staging_bytes, pin=self.cuda)
        self._stream: Any = torch.cuda.Stream(device.torch_device) if self.cuda else None
        #: device -> host copies: a stream of their own, beside the promotes' (``_stream``)
        self._d2h_stream: Any = torch.cuda.Stream(device.torch_device) if self.cuda else None
        self._p2p_stream: Any = torch.cuda.Stream(device.torch_device) if self.cuda else None

    @property
    def stream(self) -> Any:
        """The side stream of host -> device copies (CUDA), ``None`` elsewhere."""
        return self._stream

    def _metering_off(self) -> contextlib.AbstractContextManager[None]:
        meter = self.device.meter
        return meter.unmetered() if meter is not None else contextlib.nullcontext()

    # -------------------------------------------------------------- host -> device

    def allocate(self, hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Uninitialized device tensors shaped like ``hosts`` (metered).

        Host tensors that tile one flat buffer (:func:`flat_buffer`: a flat shard's) get views
        of one device buffer laid out like it, so their copies are one copy of the buffer.

        Raises:
            torch.OutOfMemoryError: They do not fit the device budget.
        """
        groups = _storage_groups(hosts)
        flats = [flat_buffer([hosts[i] for i in group]) for group in groups]
        units = [hosts[group[0]] if flat is None else flat
                 for group, flat in zip(groups, flats, strict=True)]
        buffers = self.device.empty_like(units)
        outs: list[torch.Tensor | None] = [None] * len(hosts)
        for group, flat, buffer in zip(groups, flats, buffers, strict=True):
            for i in group:
                host = hosts[i]
                outs[i] = buffer if flat is None else buffer.as_strided(
                    host.shape, host.stride(), host.storage_offset())
        return [out for out in outs if out is not None]

    def promote(self, hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy host tensors to new device tensors, usable by the calling thread's compute.

        Raises:
            torch.OutOfMemoryError: They do not fit the device budget.
        """
        if self.in_place:  # the host tensors are the device's (their pending demotes end)
            _await_writes(hosts)
            return list(hosts)
        outs = self.allocate(hosts)
        self.copy_in(outs, hosts).wait_device()
        return outs

    def copy_in(
        self, outs: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor], *,
        background: bool = False,
    ) -> DeviceTransfer:
        """Start copying ``hosts`` into ``outs``; counted as promotions (one per flat buffer).

        Waits first for demotes still writing any of ``hosts``. On CUDA the copy runs on the side
        stream, ordered after the current stream's work so far; the caller makes its compute
        wait with :meth:`DeviceTransfer.wait_device`. On a virtual device it is complete on
        return, or with ``background`` runs on the device's copy thread until
        :meth:`DeviceTransfer.wait_device`.
        """
        _await_writes(hosts)
        if self.in_place:
            _copy_unaliased(outs, hosts)
            return DeviceTransfer(None, outs, None)
        if not hosts:
            return DeviceTransfer(None, outs, None)
        targets, sources = self._counted_copies("promote", outs, hosts)
        if not self.cuda:
            if background:
                return DeviceTransfer(None, outs, None, self._in_background(targets, sources))
            _copy(targets, sources)
            return DeviceTransfer(None, outs, None)
        current = torch.cuda.current_stream(self.device.torch_device)
        self._stream.wait_stream(current)
        pageable = [source for source in sources if not source.is_pinned()]
        block = None
        if pageable:
            block = self.staging.acquire(pack_offsets([h.nbytes for h in pageable])[1])
            staged = iter(packed_views(block, pageable))
            sources = [source if source.is_pinned() else _copied(next(staged), source)
                       for source in sources]
        with torch.cuda.stream(self._stream):
            for out, source in zip(targets, sources, strict=True):
                out.copy_(source, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self._stream)
        if block is not None:  # back to the pool once the event completes
            staging, held = self.staging, block
            self.staging.track(Transfer(event, lambda: staging.release(held)))
        return DeviceTransfer(event, outs, self.device.torch_device)

    # -------------------------------------------------------------- device -> device

    def p2p(
        self,
        tensors: Sequence[torch.Tensor],
        dst: Device,
        outs: Sequence[torch.Tensor] | None = None,
    ) -> DeviceTransfer:
        """Start copying tensors of this device to ``dst`` (Harmony's p2p swap), not via the host.

        Counted as p2p bytes, one copy per tensor, out of this device and into ``dst``. New
        tensors on ``dst`` are allocated there (metered on ``dst``; neither device's meter
        counts them for the calling thread otherwise, whichever device it computes for). Between
        virtual devices the copy is a real copy, complete on return. On CUDA it runs on this
        GPU's p2p stream, ordered after the current stream's work on the sources, with the
        sources' ``record_stream``; the caller on ``dst`` orders its compute after it with
        :meth:`DeviceTransfer.wait_device`.

        Args:
            tensors: Tensors on this device.
            dst: The device to copy them to (another device; on one GPU, another stream).
            outs: Tensors on ``dst`` to copy into, shaped like ``tensors``; ``None``: new ones.

        Returns:
            The transfer filling the tensors on ``dst``.

        Raises:
            torch.OutOfMemoryError: New tensors do not fit ``dst``'s budget.
        """
        with self._metering_off(), _unmetered(dst):
            targets = list(outs) if outs is not None else dst.empty_like(tensors)
        for tensor in tensors:
            self.device.transfers.add("p2p_out", tensor.nbytes)
            dst.transfers.add("p2p_in", tensor.nbytes)
        if not self.cuda or not tensors:
            if tensors:
                with self._metering_off(), _unmetered(dst):
                    torch._foreach_copy_(targets, list(tensors))
            return DeviceTransfer(None, targets, None)
        current = torch.cuda.current_stream(self.device.torch_device)
        self._p2p_stream.wait_stream(current)
        with torch.cuda.stream(self._p2p_stream):
            for target, tensor in zip(targets, tensors, strict=True):
                target.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._p2p_stream)
        event = torch.cuda.Event()
        event.record(self._p2p_stream)
        return DeviceTransfer(event, targets, dst.torch_device)

    # -------------------------------------------------------------- device -> host

    def demote(
        self, tensors: Sequence[torch.Tensor], outs: Sequence[torch.Tensor | None], *,
        background: bool = False,
    ) -> tuple[list[torch.Tensor], Transfer]:
        """Start copying device tensors into host tensors (new ones where ``outs`` has ``None``).

        Counted as demotions, one per tensor or flat buffer. On CUDA the copies run on the
        device -> host stream after the current stream's work so far, into pinned staging (or
        directly into pinned ``outs``); the host tensors are complete once the returned transfer's
        :meth:`Transfer.wait` returns, which a later :meth:`copy_in` of them and
        :func:`settle_all` call. On a virtual device the copies are complete on return, or
        with ``background`` run on the device's copy thread until the transfer is waited on
        (the device tensors stay allocated while the caller holds them).

        Returns:
            The host tensors and the transfer writing them.
        """
        if self.in_place:  # a tensor is its own host copy where ``outs`` has ``None``
            hosts = [t if out is None else out for t, out in zip(tensors, outs, strict=True)]
            _copy_unaliased(hosts, tensors)
            return hosts, Transfer()
        with self._metering_off():
            hosts = [
                out if out is not None else torch.empty(t.shape, dtype=t.dtype)
                for t, out in zip(tensors, outs, strict=True)
            ]
        if not tensors:
            return hosts, Transfer()
        targets, sources = self._counted_copies("demote", hosts, tensors)
        if not self.cuda:
            if background:
                transfer = Transfer(pending=self._in_background(targets, sources))
                _register_writes(hosts, transfer)
                return hosts, transfer
            with self._metering_off():
                _copy(targets, sources)
            return hosts, Transfer()
        current = torch.cuda.current_stream(self.device.torch_device)
        self._d2h_stream.wait_stream(current)
        pageable = [(h, t) for h, t in zip(targets, sources, strict=True) if not h.is_pinned()]
        block = None
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        if pageable:
            block = self.staging.acquire(pack_offsets([t.nbytes for _, t in pageable])[1])
            views = packed_views(block, [t for _, t in pageable])
            staged = [(view, host) for view, (host, _) in zip(views, pageable, strict=True)]
        views_left = iter(view for view, _ in staged)
        with torch.cuda.stream(self._d2h_stream):
            for host, tensor in zip(targets, sources, strict=True):
                target = host if host.is_pinned() else next(views_left)
                target.copy_(tensor, non_blocking=True)
                if tensor.is_cuda:
                    tensor.record_stream(self._d2h_stream)
        event = torch.cuda.Event()
        event.record(self._d2h_stream)
        staging = self.staging

        def finish() -> None:
            for view, host in staged:
                host.copy_(view)
            if block is not None:
                staging.release(block)

        transfer = Transfer(event, finish)
        if block is not None:
            staging.track(transfer)
        _register_writes(hosts, transfer)
        return hosts, transfer

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Demote one tensor and wait for it (a host value read at once)."""
        hosts, transfer = self.demote([tensor], [out])
        transfer.wait()
        return hosts[0]

    def _counted_copies(
        self, kind: CopyKind, outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The copies filling ``outs`` from ``sources`` (:func:`coalesced_copies`), each counted.

        Args:
            kind: ``"promote"`` or ``"demote"``: which of the device's counters they add to.
            outs: The tensors to fill.
            sources: The tensors to copy, pairwise.

        Returns:
            The outs and sources of the copies, one per flat buffer or other tensor.
        """
        targets, copied = coalesced_copies(outs, sources)
        for source in copied:
            self.device.transfers.add(kind, source.nbytes)
        return targets, copied

    def _in_background(
        self, outs: list[torch.Tensor], sources: list[torch.Tensor]
    ) -> concurrent.futures.Future[None]:
        """Copy ``sources`` into ``outs`` on this device's copy thread (a virtual device's).

        The thread lets go of both lists before the copy's future completes: nothing it holds
        keeps device memory allocated after a waiter drops the tensors, however late the thread
        runs again.
        """
        held = [(outs, sources)]

        def copy() -> None:
            targets, tensors = held.pop()
            try:
                _copy(targets, tensors)
            finally:  # a raised error's traceback keeps this frame
                del targets, tensors

        with _ENGINES_LOCK:
            worker = _COPY_THREADS.get(self.device.name)
            if worker is None:
                worker = _COPY_THREADS[self.device.name] = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"copy-{self.device.name}")
        return worker.submit(copy)


class DeviceTransfer:
    """Device tensors a :meth:`TransferEngine.copy_in` is filling, maybe still in flight."""

    def __init__(
        self, event: Any, outs: Sequence[torch.Tensor], torch_device: torch.device | None,
        pending: concurrent.futures.Future[None] | None = None,
    ) -> None:
        self._event = event
        self.outs = list(outs)
        self._device = torch_device
        self._pending = pending

    def wait_device(self) -> list[torch.Tensor]:
        """Order the calling thread's current stream after the copies; return the tensors.

        On CUDA, also ``record_stream`` the tensors on the current stream, so memory freed
        later is not reused before the compute that reads it. A virtual device's background
        copy is waited for.

        Raises:
            Exception: What a background copy raised.
        """
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._event is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(self._event)
            for out in self.outs:
                out.record_stream(current)
            self._event = None
        return self.outs


def _unmetered(device: Device) -> contextlib.AbstractContextManager[None]:
    meter = device.meter
    return meter.unmetered() if meter is not None else contextlib.nullcontext()


def _copy_unaliased(outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy each source into its out, except where the out is the source's own memory."""
    pairs = [(out, src) for out, src in zip(outs, sources, strict=True)
             if out.data_ptr() != src.data_ptr() or out.stride() != src.stride()]
    if pairs:
        torch._foreach_copy_([out for out, _ in pairs], [src for _, src in pairs])


def _copy(outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy each source into its out: one op (one dispatch through a meter)."""
    if len(outs) == 1:
        outs[0].copy_(sources[0])
    else:
        torch._foreach_copy_(list(outs), list(sources))


def flat_buffer(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer that ``tensors`` tile exactly, if they do (else ``None``).

    They tile it when they are contiguous views of one storage with one dtype, and their
    element ranges follow one another without gap or overlap from the storage's first element
    to its last: the tensors of a flat shard buffer
    (:func:`~sweepmaster.runtime.training.flat.flat_views`), in any order. One tensor alone
    never is (it is copied as itself).
    """
    if len(tensors) < 2:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    spans = []
    for tensor in tensors:
        if (tensor.dtype != first.dtype or tensor.device != first.device
                or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        spans.append((tensor.storage_offset(), tensor.numel()))
    end = 0
    for offset, numel in sorted(spans):
        if offset != end:
            return None
        end += numel
    if end * first.element_size() != storage.nbytes():
        return None
    return first.detach().as_strided((end,), (1,), 0)


def coalesced_copies(
    outs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The copies that fill ``outs`` from ``sources``: one per flat buffer, one per other tensor.

    Pairs whose outs tile one buffer and whose sources tile another one (:func:`flat_buffer`)
    at the same offsets are one copy of the whole buffer (DeepSpeed ZeRO's flattened groups,
    FSDP2's one buffer per parameter group); the others are copied one by one.

    Returns:
        The outs and sources of the copies, in the order of their first pair.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (out, source) in enumerate(zip(outs, sources, strict=True)):
        groups.setdefault((*_storage_key(out, i), *_storage_key(source, i)), []).append(i)
    targets: list[torch.Tensor] = []
    copied: list[torch.Tensor] = []
    for group in groups.values():
        flat_out = flat_buffer([outs[i] for i in group])
        flat_source = flat_buffer([sources[i] for i in group])
        if (flat_out is not None and flat_source is not None
                and flat_source.dtype == flat_out.dtype
                and all(outs[i].storage_offset() == sources[i].storage_offset()
                        and outs[i].shape == sources[i].shape for i in group)):
            targets.append(flat_out)
            copied.append(flat_source)
            continue
        targets.extend(outs[i] for i in group)
        copied.extend(sources[i] for i in group)
    return targets, copied


def _storage_key(tensor: torch.Tensor, index: int) -> tuple[Any, ...]:
    """What groups tensors by storage (an empty one stands alone)."""
    pointer = tensor.untyped_storage().data_ptr()
    return (str(tensor.device), pointer if pointer else -1 - index)


def _storage_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by storage, in order of first use."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(_storage_key(tensor, i), []).append(i)
    return list(groups.values())


def _copied(view: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    view.copy_(host)
    return view


def _key(host: torch.Tensor) -> int:
    return int(host.untyped_storage().data_ptr())


#: Demotes in flight by the host storage they write (its data pointer): host memory is the
#: process's, so a promote on any device waits for a demote made on any other.
_WRITING: dict[int, Transfer] = {}
_WRITING_LOCK = threading.Lock()
_ENGINES_LOCK = threading.Lock()
#: Each virtual device's copy thread, by device name (a GPU's copy engine, one per device).
_COPY_THREADS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _register_writes(hosts: Sequence[torch.Tensor], transfer: Transfer) -> None:
    """Remember that ``transfer`` writes ``hosts`` until it is waited on."""
    with _WRITING_LOCK:
        for host in hosts:
            _WRITING[_key(host)] = transfer


def engine_for(device: Device) -> TransferEngine:
    """The transfer engine of ``device`` (one per device object, kept on it)."""
    with _ENGINES_LOCK:
        engine: TransferEngine | None = getattr(device, "_transfer_engine", None)
        if engine is None:
            engine = TransferEngine(device)
            object.__setattr__(device, "_transfer_engine", engine)  # devices are frozen
        return engine


def _await_writes(hosts: Sequence[torch.Tensor]) -> None:
    """Wait for the demotes still writing any of ``hosts``."""
    if not _WRITING:
        return
    with _WRITING_LOCK:
        pending = [_WRITING.pop(_key(host), None) for host in hosts]
    for transfer in pending:
        if transfer is not None:
            transfer.wait()


def settle_all() -> None:
    """Wait for every demote still writing host tensors, on every device (before reading them)."""
    with _WRITING_LOCK:
        pending = list(_WRITING.values())
        _WRITING.clear()
    for transfer in pending:
        transfer.wait()
