"""A pipelined job's layout over its devices, and the device threads that run it.

Harmony's PP mode (Li et al., VLDB 2022, https://arxiv.org/abs/2202.01306;
:mod:`~sweepmaster.runtime.training.pipelined`) splits a spilled job's shards into contiguous
**packs**; pack p runs on device ``p mod D``, each device's packs in order make its **lane**
(:func:`~sweepmaster.runtime.scheduling.pipeline.lanes`). :class:`PipelineLanes` holds that
layout: the packs (:class:`Pack`: which tensors each installs, which it borrows from an earlier
pack, which packs send it gradient contributions for a tied parameter it owns), the lanes
(:class:`Lane`), and the machinery every pipelined phase runs on: one thread per lane
(:meth:`PipelineLanes.run`), the queues between neighbour packs (:attr:`PipelineLanes.downstream`,
:attr:`~PipelineLanes.upstream`, :attr:`~PipelineLanes.tied`), a barrier, and the counted
device -> device copies (:meth:`PipelineLanes.p2p`). A device that fails stops the others:
those waiting for a neighbour (:meth:`PipelineLanes.get`, :meth:`~PipelineLanes.wait`) or at
the barrier give up, and the first real failure is raised.

It is one part of :class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, beside the
packs' swaps (:class:`~sweepmaster.runtime.training.pipeline_swaps.PackSwaps`) and the phases
that run on these lanes; of the job it reads the plan, each shard's tensors (``shard_keys``,
``trainable``) and counts the p2p bytes under its ``counter_lock``.

Shape legend: K members (a fused array), B batch, b microbatch.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import DeviceTransfer
from sweepmaster.runtime.scheduling.pipeline import lanes
from sweepmaster.runtime.training.pipeline_job import PipelinedJob
from sweepmaster.runtime.training.tasks import TensorKey

__all__ = ["Lane", "Pack", "PipelineLanes"]

#: Seconds between checks of a failed device while it waits for a neighbour.
_POLL_S = 0.05


class _Aborted(Exception):
    """Another device failed; this one stops waiting."""


@dataclass
class Pack:
    """One pack: its shards, the tensors it installs, and what it holds while resident."""

    index: int
    device: Device
    shards: range
    own: list[TensorKey] = field(default_factory=list)  # installed by this pack
    lent: list[TensorKey] = field(default_factory=list)  # an earlier pack installs them
    #: key -> this pack's copy of a lent tensor, while the pack is resident
    borrowed: dict[TensorKey, torch.Tensor] = field(default_factory=dict)
    #: key of a parameter -> packs sending it a gradient contribution (it owns a tied one)
    lenders: dict[TensorKey, list[int]] = field(default_factory=dict)


@dataclass
class Lane:
    """One device and its packs in order (pack p on device ``p mod D``)."""

    index: int
    device: Device
    packs: list[Pack]
    current: Pack | None = None  # the pack resident on the device
    #: a pack whose parameters are being copied in ahead of its turn
    prefetched: tuple[Pack, DeviceTransfer] | None = None

    @property
    def wraps(self) -> bool:
        """Whether the lane holds more than one pack (wrap-around: its packs swap in turn)."""
        return len(self.packs) > 1


class PipelineLanes:
    """A job's packs over its devices, and one thread per device to run them.

    Not thread-safe: one phase (:meth:`run`) at a time; the threads it starts share the job's
    byte counters and host bookkeeping under :attr:`lock` (the job's ``counter_lock``).

    Args:
        job: The job (one member or a fused array); its plan's microbatch sizes give the
            pipeline's microbatch (the smallest).
        devices: D distinct devices, ``2 <= D <= P``: pack p runs on ``devices[p % D]``.
        cuts: Cut points ``(0, c1, ..., S)`` of the P packs over the job's shards.

    Attributes:
        job: The job.
        cuts: The cut points.
        devices: The D devices.
        packs: The P packs, in order.
        lanes: The D lanes (device d's packs ``d, d + D, ...``).
        microbatch_shard: The shard whose microbatches the pipeline's are (the smallest).
        lock: The job's ``counter_lock``: its byte counters and host bookkeeping.
        downstream: While a phase runs, per pack p but the last, its messages to pack p + 1.
        upstream: While a phase runs, per pack p but the last, pack p + 1's to pack p.
        tied: While a phase runs, per pack, the tied gradient contributions sent to it.

    Raises:
        ValueError: Fewer than two packs, fewer than two devices or more than packs, devices
            not distinct, or cut points that are not ``0 < ... < S``.
    """

    def __init__(self, job: PipelinedJob, devices: Sequence[Device], cuts: Sequence[int]) -> None:
        num_shards = len(job.plan.shards)
        cuts = tuple(cuts)
        if len(cuts) < 3 or cuts[0] != 0 or cuts[-1] != num_shards or any(
                a >= b for a, b in zip(cuts, cuts[1:], strict=False)):
            raise ValueError(f"pack cut points {cuts} are not 0 < ... < {num_shards} with at "
                             "least two packs")
        num_packs, num_devices = len(cuts) - 1, len(devices)
        if not 2 <= num_devices <= num_packs or len({d.name for d in devices}) != num_devices:
            raise ValueError(f"a pipeline of {num_packs} packs needs 2 to {num_packs} distinct "
                             f"devices, got {[d.name for d in devices]}")
        self.job = job
        self.cuts = cuts
        self.devices = list(devices)
        self.packs = [Pack(i, devices[i % num_devices], range(a, b))
                      for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
        self.lanes = [Lane(d, devices[d], [self.packs[p] for p in lane])
                      for d, lane in enumerate(lanes(num_packs, num_devices))]
        holder: dict[TensorKey, int] = {}  # tensor -> the pack that installs it
        for pack in self.packs:
            keys = list(dict.fromkeys(k for s in pack.shards for k in job.members.shard_keys(s)))
            pack.own = [k for k in keys if k not in holder]
            pack.lent = [k for k in keys if k in holder]
            for key in pack.lent:
                if job.members.trainable(key):
                    self.packs[holder[key]].lenders.setdefault(key, []).append(pack.index)
            holder.update((k, pack.index) for k in pack.own)
        shard = min(range(num_shards), key=lambda i: job.plan.shards[i].microbatch_size)
        self.microbatch_shard = shard
        self.lock = job.boundaries.counter_lock
        self._failed = threading.Event()
        self.downstream: list[queue.Queue[Any]] = []  # pack p -> p + 1: activations
        self.upstream: list[queue.Queue[Any]] = []  # pack p + 1 -> p: their gradients
        self.tied: list[queue.Queue[Any]] = []
        self._barrier = threading.Barrier(1)

    def stays(self, pack: Pack) -> bool:
        """Whether the pack is on its device at the step's end (its device's first)."""
        return pack.index < len(self.lanes)

    def lane_of(self, pack: Pack) -> Lane:
        """The lane that runs ``pack``."""
        return self.lanes[pack.index % len(self.lanes)]

    def run(self, work: Callable[[Lane], None],
            barrier_action: Callable[[], None] | None = None) -> None:
        """Run ``work`` for every device, one thread each; the first failure is raised.

        ``barrier_action``: run by one thread once every lane reached :meth:`wait_barrier`.
        """
        num_packs = len(self.packs)
        self._failed.clear()
        self._barrier = threading.Barrier(len(self.lanes), action=barrier_action)
        self.downstream = [queue.Queue() for _ in range(num_packs - 1)]
        self.upstream = [queue.Queue() for _ in range(num_packs - 1)]
        self.tied = [queue.Queue() for _ in range(num_packs)]

        def guarded(lane: Lane) -> None:
            try:
                work(lane)
            except BaseException:
                self._failed.set()
                self._barrier.abort()
                raise

        with concurrent.futures.ThreadPoolExecutor(len(self.lanes), "pack") as pool:
            futures = [pool.submit(guarded, lane) for lane in self.lanes]
            concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        first = next((e for e in errors if not isinstance(
            e, (_Aborted, threading.BrokenBarrierError))), errors[0] if errors else None)
        self.downstream, self.upstream, self.tied = [], [], []
        if first is not None:
            raise first

    def get(self, source: queue.Queue[Any]) -> Any:
        """The next message from a neighbour pack (raises :class:`_Aborted` if a device failed)."""
        while True:
            try:
                return source.get(timeout=_POLL_S)
            except queue.Empty:
                if self._failed.is_set():
                    raise _Aborted from None

    def wait(self, event: threading.Event) -> None:
        """Wait for ``event`` of another device (raises :class:`_Aborted` if a device failed)."""
        while not event.wait(_POLL_S):
            if self._failed.is_set():
                raise _Aborted

    def wait_barrier(self) -> None:
        """Wait until every lane is here (raises :class:`_Aborted` if a device failed)."""
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            if self._failed.is_set():
                raise _Aborted from None
            raise

    def p2p(self, src: Device, tensors: Sequence[torch.Tensor], dst: Device,
             outs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Copy ``tensors`` from ``src`` to ``dst`` for the calling thread's compute; counted."""
        copies = src.transfer.p2p(tensors, dst, outs).wait_device()
        with self.lock:
            self.job.bookkeeping.p2p_bytes += sum(t.nbytes for t in tensors)
        return copies
