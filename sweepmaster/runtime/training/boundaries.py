"""The host side of a spilled job's shard boundaries, for one member or a fused array of K.

A spilled job keeps only boundaries between its shard tasks: each shard's input activations
and the gradient of its output, demoted into host buffers of the whole minibatch (pinned on
CUDA) so that shards may use different microbatches (Harmony's input-batch grouping).
:class:`HostBoundaries` is that host side, one part the trainer holds: the microbatches of a
shard, the host buffers, and every copy between the host and a device counted in
``swap_bytes`` (none on the host CPU, whose transfers are in place). Nothing here makes the
host wait for a device inside a step: a boundary leaves without waiting (its reader's promote
waits for it), and a step's losses leave by uncounted non-blocking copies
(:meth:`HostBoundaries.copy_out`) read once, where the step reports them.

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.host_syncs import host_resident, note_host_wait
from sweepmaster.runtime.devices.transfer import Transfer
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.workload.spec import IGNORED_TARGET

__all__ = ["HostBoundaries", "metering"]


def metering(device: Device) -> contextlib.AbstractContextManager[None]:
    """The device meter's counting context (a no-op on a device without a meter)."""
    meter = device.meter
    return meter.metering() if meter is not None else contextlib.nullcontext()


class HostBoundaries:
    """A spilled job's boundaries on the host, and its counted copies to and from devices.

    Any thread may copy (:meth:`to_device`, :meth:`to_host`): the byte counter is guarded by
    :attr:`counter_lock`.

    Args:
        plan: The job plan (its shards' microbatch sizes).
        batch_size: Rows of a training minibatch (B).
        row_dim: Dimension of the rows in token ids and host boundaries: 0 for one member's
            ``(B, ...)``, 1 for a fused array's ``(K, B, ...)``.
        labels: The step's token ids on the host, the whole minibatch (``(B, T)``,
            ``(K, B, T)``): the input of shard 0.
        targets: The step's loss labels on the host, as ``labels``; ``None``: the ids are.
            With a loss mask (:attr:`~sweepmaster.workload.spec.TrainSpec.train_mask`): the
            ids with :data:`~sweepmaster.workload.spec.IGNORED_TARGET` where a token does not
            count.

    Attributes:
        acts: Shard -> its input, the whole minibatch on the host.
        grads: Shard -> the gradient of its output, the same.
        eval_acts: Shard -> its input, every evaluation block.
        swap_bytes: Bytes moved between host and device so far (a job's promotes and demotes
            too).
        counter_lock: Guards the byte counters and host bookkeeping while a pipeline's device
            threads call the job (reentrant: the job's counted copies take it too).
    """

    def __init__(self, plan: JobPlan, batch_size: int, *, row_dim: int,
                 labels: Callable[[], torch.Tensor],
                 targets: Callable[[], torch.Tensor | None]) -> None:
        self.plan = plan
        self.batch_size = batch_size
        self.row_dim = row_dim
        self._labels = labels
        self._targets = targets
        self.acts: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.eval_acts: dict[int, torch.Tensor] = {}
        self.swap_bytes = 0
        self.counter_lock = threading.RLock()
        self._copies_out: list[Any] = []  # CUDA events of copies copy_out started
        self._writes: dict[int, list[Transfer]] = {}  # id(host buffer) -> demotes writing it
        # id(host) -> (host, its demote) of to_host_later's copies maybe in flight
        self._later: dict[int, tuple[torch.Tensor, Transfer]] = {}

    def device_targets(self, shard: int, rows: slice, x: torch.Tensor,
                       device: Device) -> torch.Tensor:
        """The labels of microbatch ``rows`` on ``device`` for the last shard's loss.

        ``x``: the shard's input there (the token ids when ``shard`` is 0: no copy without a
        loss mask).
        """
        targets = self._targets()
        if targets is None:
            if shard == 0:
                return x.detach()
            targets = self._labels()
        return self.to_device(device, targets[self.row_index(rows)])

    def target_shares(self, rows: slice) -> list[float]:
        """Each member's share of the step's counted targets in microbatch ``rows``.

        The weight of a microbatch's mean loss, so that the step's loss is the mean over all
        its counted tokens (plain's); without a loss mask, the share of the minibatch's rows
        (one value for every member).
        """
        targets = self._targets()
        if targets is None:
            return [(rows.stop - rows.start) / self.batch_size]
        counted = (targets[..., 1:] != IGNORED_TARGET).sum(dim=-1)  # (B,) or (K, B)
        part = counted[self.row_index(rows)].sum(dim=-1).double()
        return (part / counted.sum(dim=-1).double()).reshape(-1).tolist()

    def moved(self, device: Device, num_bytes: int) -> None:
        """Count ``num_bytes`` moved between the host and ``device`` in :attr:`swap_bytes`.

        Nothing moves to or from the host CPU itself (its transfers are in place). Any thread.
        """
        if not device.transfer.in_place:
            with self.counter_lock:
                self.swap_bytes += num_bytes

    def to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on ``device``, counted in :attr:`swap_bytes` (any thread)."""
        self.moved(device, host.nbytes)
        return device.to_device(host)

    def to_host(self, device: Device, tensor: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of ``tensor`` (into ``out`` if given), counted in :attr:`swap_bytes`.

        The host waits for it (reported to
        :func:`~sweepmaster.runtime.devices.host_syncs.note_host_wait` off the host CPU).
        """
        self.moved(device, tensor.nbytes)
        if not device.transfer.in_place:
            note_host_wait("to_host")
        return device.to_host(tensor, out)

    def to_host_later(self, device: Device, tensor: torch.Tensor,
                      out: torch.Tensor | None = None, *, uncounted_back: bool = False,
                      ) -> torch.Tensor:
        """Like :meth:`to_host`, without waiting: read the copy by promoting it again.

        A promote of the returned host tensor (:meth:`to_device` or :meth:`back_uncounted`,
        any device) waits for the copy, as does
        :func:`~sweepmaster.runtime.devices.transfer.settle_all`; nothing else may read it
        before (``uncounted_back``: it comes back by :meth:`back_uncounted`). A new host
        tensor is pinned on CUDA.
        """
        self.moved(device, tensor.nbytes)
        if out is None and device.pin_host_memory:
            meter = device.meter
            with meter.unmetered() if meter is not None else contextlib.nullcontext():
                out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        hosts, transfer = device.transfer.demote([tensor], [out])
        if uncounted_back and not transfer.done:
            with self.counter_lock:
                self._later[id(hosts[0])] = (hosts[0], transfer)
        return hosts[0]

    def back_uncounted(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        """``host`` (:meth:`to_host_later`'s) on ``device``, uncounted, without a host wait.

        On CUDA the current stream waits for the demote's event, then copies from the pinned
        host tensor without blocking.
        """
        with self.counter_lock:
            _, transfer = self._later.pop(id(host), (None, None))
        event = transfer.event if transfer is not None else None
        if event is not None:
            torch.cuda.current_stream(device.torch_device).wait_event(event)
            return host.to(device.torch_device, non_blocking=True)
        if transfer is not None:  # a virtual device's copy in the background
            transfer.wait()
        return host.to(device.torch_device)

    def microbatches(self, shard: int, num_rows: int | None = None) -> list[slice]:
        """Row slices of ``shard``'s microbatches over a minibatch (or ``num_rows`` rows)."""
        size = self.plan.shards[shard].microbatch_size
        rows = self.batch_size if num_rows is None else num_rows
        return [slice(lo, min(lo + size, rows)) for lo in range(0, rows, size)]

    def eval_chunks(self, shard: int, num_rows: int) -> list[slice]:
        """Plain's evaluation batches of ``batch_size`` rows, in ``shard``'s microbatches."""
        size = self.plan.shards[shard].microbatch_size
        return [
            slice(lo, min(lo + size, hi))
            for start in range(0, num_rows, self.batch_size)
            for hi in [min(start + self.batch_size, num_rows)]
            for lo in range(start, hi, size)
        ]

    def row_index(self, rows: slice) -> tuple[slice, ...]:
        """The index of ``rows`` in a host boundary of the whole minibatch."""
        return (slice(None),) * self.row_dim + (rows,)

    def rows_of(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """``rows`` of ``tensor`` along :attr:`row_dim` (a view)."""
        return tensor[self.row_index(rows)]

    def input(self, shard: int, rows: slice, device: Device) -> torch.Tensor:
        """The shard's input ``rows`` on ``device``: token ids (shard 0) or its boundary."""
        host = self._labels() if shard == 0 else self.acts[shard]
        return self.to_device(device, host[self.row_index(rows)])

    def host_input(self, shard: int, rows: slice, device: Device) -> torch.Tensor:
        """The shard's input rows on the host (the token ids for shard 0), contiguous.

        A fused array's rows of a microbatch are not contiguous in its ``(K, B, ...)``
        boundary: they are copied (unmetered) so that host and device layouts agree.
        """
        host = self._labels() if shard == 0 else self.acts[shard]
        view = host[self.row_index(rows)]
        if view.is_contiguous():
            return view
        for transfer in self._writes.pop(id(host), []):  # read here, on the host
            transfer.wait()
        meter = device.meter
        with meter.unmetered() if meter is not None else contextlib.nullcontext():
            return view.contiguous()

    def store(self, boundaries: dict[int, torch.Tensor], shard: int, rows: slice,
              num_rows: int, tensor: torch.Tensor, device: Device) -> None:
        """Demote a microbatch's boundary into the host buffer of the whole batch.

        ``boundaries`` is :attr:`acts`, :attr:`grads` or :attr:`eval_acts`. ``tensor`` is
        ``(b, ...)`` (:attr:`row_dim` 0) or a fused array's ``(K, b, ...)`` (1); the buffer,
        made at the first microbatch, holds ``num_rows`` rows. The copy is not waited for: a
        promote of the buffer waits for it (the transfer layer knows the host storages a
        demote writes), a read on the host (:meth:`host_input`) too.
        """
        buffer = boundaries.get(shard)
        row_dim = self.row_dim
        if buffer is None:
            shape = (*tensor.shape[:row_dim], num_rows, *tensor.shape[row_dim + 1:])
            meter = device.meter
            with meter.unmetered() if meter is not None else contextlib.nullcontext():
                buffer = torch.empty(shape, dtype=tensor.dtype,
                                     pin_memory=device.pin_host_memory)
            boundaries[shard] = buffer
            self._writes.pop(id(buffer), None)
        index = (slice(None),) * row_dim + (rows,)
        self.moved(device, tensor.nbytes)
        _, transfer = device.transfer.demote([tensor.detach()], [buffer[index]])
        if not transfer.done:
            self._writes.setdefault(id(buffer), []).append(transfer)

    def copy_out(self, device: Device, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of a small device tensor (a loss), started without waiting; uncounted.

        Not in the swap volume or the meter (the cost model has no such copy). On CUDA the
        copy goes into pinned memory, non-blocking, on the current stream; read the copy
        after :meth:`settle_copies_out`.
        """
        meter = device.meter
        with meter.unmetered() if meter is not None else contextlib.nullcontext():
            host = torch.empty(tensor.shape, dtype=tensor.dtype,
                               pin_memory=device.pin_host_memory and tensor.is_cuda)
            host.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
            with self.counter_lock:
                self._copies_out.append(event)
        return host_resident(host)

    def settle_copies_out(self) -> None:
        """Wait for the copies :meth:`copy_out` started: where a step reports its results.

        That wait is the step's one host sync on a GPU (reported to
        :func:`~sweepmaster.runtime.devices.host_syncs.note_host_wait`, on any device).
        """
        with self.counter_lock:
            events, self._copies_out = self._copies_out, []
        note_host_wait("results")
        for event in events:
            event.synchronize()
        # forget the demotes that completed (a promote's wait for them would return at once)
        self._writes = {key: pending for key, writes in self._writes.items()
                        if (pending := [t for t in writes if not t.query()])}
        with self.counter_lock:
            self._later = {key: (host, transfer) for key, (host, transfer)
                           in self._later.items() if not transfer.query()}
