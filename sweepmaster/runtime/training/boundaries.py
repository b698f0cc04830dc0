"""The host side of a spilled job's shard boundaries, for one member or a fused array of K.

A spilled job (:class:`~sweepmaster.runtime.training.chain.ShardChain`) keeps only boundaries
between its shard tasks: each shard's input activations and the gradient of its output, demoted
into host buffers of the whole minibatch (pinned on CUDA) so that shards may use different
microbatches (Harmony's input-batch grouping). :class:`HostBoundaries` is that host side: the
microbatches of a shard, the host buffers, and every copy between the host and a device counted
in ``swap_bytes`` (none on the host CPU, whose transfers are in place).

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.workload.spec import IGNORED_TARGET

__all__ = ["HostBoundaries", "metering"]


def metering(device: Device) -> contextlib.AbstractContextManager[None]:
    """The device meter's counting context (a no-op on a device without a meter)."""
    meter = device.meter
    return meter.metering() if meter is not None else contextlib.nullcontext()


class HostBoundaries(ABC):
    """A spilled job's boundaries on the host, and its counted copies to and from devices.

    Any thread may copy (:meth:`to_device`, :meth:`to_host`): the byte counter is guarded by
    :attr:`counter_lock`. A job provides its token ids (:meth:`_labels`, the input of shard 0).

    Args:
        plan: The job plan (its shards' microbatch sizes); its device's type (``cpu`` or
            ``cuda``) is where the job's tasks run.
        batch_size: Rows of a training minibatch (B).

    Attributes:
        swap_bytes: Bytes moved between host and device so far (a job's promotes and demotes
            too).
        counter_lock: Guards the byte counters and host bookkeeping while a pipeline's device
            threads call the job (reentrant: the job's counted copies take it too).
    """

    #: Dimension of the rows in token ids and host boundaries: 0 for one member's
    #: ``(B, ...)``, 1 for a fused array's ``(K, B, ...)``.
    row_dim = 0
    _acts: dict[int, torch.Tensor]  # shard -> its input, the whole minibatch on the host
    _grads: dict[int, torch.Tensor]  # shard -> gradient of its output, the same
    _eval_acts: dict[int, torch.Tensor]  # shard -> its input, every evaluation block

    def __init__(self, plan: JobPlan, batch_size: int) -> None:
        self.plan = plan
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
        self.swap_bytes = 0
        self._batch_size = batch_size
        self.counter_lock = threading.RLock()

    @abstractmethod
    def _labels(self) -> torch.Tensor:
        """The step's token ids on the host, the whole minibatch (``(B, T)``, ``(K, B, T)``)."""

    def step_targets(self) -> torch.Tensor | None:
        """The step's loss labels on the host, as :meth:`_labels`; ``None``: the ids are.

        With a loss mask (:attr:`~sweepmaster.workload.spec.TrainSpec.train_mask`): the ids
        with :data:`~sweepmaster.workload.spec.IGNORED_TARGET` where a token does not count.
        """
        return None

    def _device_targets(self, shard: int, rows: slice, x: torch.Tensor,
                        device: Device) -> torch.Tensor:
        """The labels of microbatch ``rows`` on ``device`` for the last shard's loss.

        ``x``: the shard's input there (the token ids when ``shard`` is 0: no copy without a
        loss mask).
        """
        targets = self.step_targets()
        if targets is None:
            if shard == 0:
                return x.detach()
            targets = self._labels()
        return self.to_device(device, targets[self._row_index(rows)])

    def _target_shares(self, rows: slice) -> list[float]:
        """Each member's share of the step's counted targets in microbatch ``rows``.

        The weight of a microbatch's mean loss, so that the step's loss is the mean over all
        its counted tokens (plain's); without a loss mask, the share of the minibatch's rows
        (one value for every member).
        """
        targets = self.step_targets()
        if targets is None:
            return [(rows.stop - rows.start) / self._batch_size]
        counted = (targets[..., 1:] != IGNORED_TARGET).sum(dim=-1)  # (B,) or (K, B)
        part = counted[self._row_index(rows)].sum(dim=-1).double()
        return (part / counted.sum(dim=-1).double()).reshape(-1).tolist()

    def _moved(self, device: Device, num_bytes: int) -> None:
        """Count ``num_bytes`` moved between the host and ``device`` in :attr:`swap_bytes`.

        Nothing moves to or from the host CPU itself (its transfers are in place). Any thread.
        """
        if not device.transfer.in_place:
            with self.counter_lock:
                self.swap_bytes += num_bytes

    def to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on ``device``, counted in :attr:`swap_bytes` (any thread)."""
        self._moved(device, host.nbytes)
        return device.to_device(host)

    def to_host(self, device: Device, tensor: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of ``tensor`` (into ``out`` if given), counted in :attr:`swap_bytes`."""
        self._moved(device, tensor.nbytes)
        return device.to_host(tensor, out)

    def microbatches(self, shard: int, num_rows: int | None = None) -> list[slice]:
        """Row slices of ``shard``'s microbatches over a minibatch (or ``num_rows`` rows)."""
        size = self.plan.shards[shard].microbatch_size
        rows = self._batch_size if num_rows is None else num_rows
        return [slice(lo, min(lo + size, rows)) for lo in range(0, rows, size)]

    def eval_chunks(self, shard: int, num_rows: int) -> list[slice]:
        """Plain's evaluation batches of ``batch_size`` rows, in ``shard``'s microbatches."""
        size = self.plan.shards[shard].microbatch_size
        return [
            slice(lo, min(lo + size, hi))
            for start in range(0, num_rows, self._batch_size)
            for hi in [min(start + self._batch_size, num_rows)]
            for lo in range(start, hi, size)
        ]

    def _row_index(self, rows: slice) -> tuple[slice, ...]:
        """The index of ``rows`` in a host boundary of the whole minibatch."""
        return (slice(None),) * self.row_dim + (rows,)

    def rows_of(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """``rows`` of ``tensor`` along :attr:`row_dim` (a view)."""
        return tensor[self._row_index(rows)]

    def _input(self, shard: int, rows: slice, device: Device) -> torch.Tensor:
        """The shard's input ``rows`` on ``device``: token ids (shard 0) or its boundary."""
        host = self._labels() if shard == 0 else self._acts[shard]
        return self.to_device(device, host[self._row_index(rows)])

    def _host_input(self, shard: int, rows: slice, device: Device) -> torch.Tensor:
        """The shard's input rows on the host (the token ids for shard 0), contiguous.

        A fused array's rows of a microbatch are not contiguous in its ``(K, B, ...)``
        boundary: they are copied (unmetered) so that host and device layouts agree.
        """
        host = self._labels() if shard == 0 else self._acts[shard]
        view = host[self._row_index(rows)]
        if view.is_contiguous():
            return view
        meter = device.meter
        with meter.unmetered() if meter is not None else contextlib.nullcontext():
            return view.contiguous()

    def _store(self, boundaries: dict[int, torch.Tensor], shard: int, rows: slice,
               num_rows: int, tensor: torch.Tensor, device: Device, *,
               row_dim: int = 0) -> None:
        """Demote a microbatch's boundary into the host buffer of the whole batch.

        ``tensor`` is ``(b, ...)`` (``row_dim=0``) or a fused array's ``(K, b, ...)``
        (``row_dim=1``); the buffer, made at the first microbatch, holds ``num_rows`` rows.
        """
        buffer = boundaries.get(shard)
        if buffer is None:
            shape = (*tensor.shape[:row_dim], num_rows, *tensor.shape[row_dim + 1:])
            meter = device.meter
            with meter.unmetered() if meter is not None else contextlib.nullcontext():
                buffer = torch.empty(shape, dtype=tensor.dtype,
                                     pin_memory=device.pin_host_memory)
            boundaries[shard] = buffer
        index = (slice(None),) * row_dim + (rows,)
        self.to_host(device, tensor.detach(), buffer[index])
