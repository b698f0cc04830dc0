"""Where a pipelined job's packs live: loaded, swapped in turn on a device, written back.

A pipelined job (:mod:`~sweepmaster.runtime.training.pipelined`, Harmony's PP mode, Li et al.,
VLDB 2022) keeps one pack at a time resident on each device (:class:`PackSwaps`):

* **load**: each device's first pack's shards (parameters, buffers, and on a device of one pack
  the optimizer states that have room,
  :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_state_stays`) are promoted; clipped
  updates the job's shard tasks deferred are applied when their pack comes in; a tied parameter
  another pack holds (GPT-2's ``wte`` in the head's pack) gets a copy of its own in that pack;
* **tied values under a deferred update**: when a tied parameter's owner applies a deferred
  clipped update as its pack comes in, it writes the value back to the host at once (not when
  it leaves: the same bytes), and a pack holding a copy waits for that before it comes in for
  a forward (and is not prefetched before), so it computes with the updated value;
* **swaps** (wrap-around, more packs than devices): a pack leaving the device writes back what
  its update changed and its optimizer state, and between its forward and its backward parks
  its kept inputs on the host; one coming in is promoted (its staying states too for a
  backward, with its parked inputs), already copied in when the next pack fit beside the
  current one (prefetch: on CUDA the copy overlaps the compute). Between steps each device
  holds its first pack, which a device of one pack never leaves;
* **unload** (the run's end, or before the job's bookkeeping reads the host copies): changed
  parameters and the optimizer state are written back to the host (a deferred clipped update
  applied first).

Every copy host <-> device is counted in the job's ``swap_bytes``.

**Parking** (:func:`park`, :func:`unpark`): what a pack sends home to read again later (its
kept inputs, a tied gradient contribution for a pack that leaves, an evaluation block for a
device's later pack) never makes the host wait. The device -> host copy runs on the device's
transfer stream into pinned host memory (on CUDA); the copy back runs on the receiving
device's host -> device stream once the first's event completed, and the receiving compute
waits on an event of its own (:class:`~sweepmaster.runtime.devices.transfer.DeviceTransfer`):
the host only queues work. What the host reads of them waits at the step's end
(:func:`~sweepmaster.runtime.devices.transfer.settle_all`, in :meth:`PackSwaps.unload`).

:class:`PackSwaps` is a part of :class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`:
it holds the job and the layout
(:class:`~sweepmaster.runtime.training.pipeline_lanes.PipelineLanes`), nothing else of the run.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import DeviceTransfer, Transfer, settle_all
from sweepmaster.runtime.planning.pipeline_plan import (
    pipeline_prefetch_fits,
    pipeline_state_stays,
)
from sweepmaster.runtime.training.pipeline_job import PipelinedJob
from sweepmaster.runtime.training.pipeline_lanes import Lane, Pack, PipelineLanes
from sweepmaster.runtime.training.tasks import ShardTask, TensorKey

__all__ = ["KeptInputs", "PackSwaps", "Parked", "PipelineParts", "park", "unpark"]


@dataclass(frozen=True)
class Parked:
    """A device tensor's host copy, maybe still being written (see :func:`park`).

    Attributes:
        host: The host tensor (pinned on CUDA); read it only through :func:`unpark`.
        transfer: The device -> host copy writing it.
    """

    host: torch.Tensor
    transfer: Transfer


#: ``(shard, microbatch)`` -> a kept input: on the device, or parked on the host.
KeptInputs = dict[tuple[int, int], torch.Tensor | Parked]


def park(device: Device, tensors: list[torch.Tensor]) -> list[Parked]:
    """Start copying ``tensors`` of ``device`` to new host tensors; the host does not wait.

    One batch on the device's device -> host stream (one copy per flat buffer), after the
    calling thread's work on them; into pinned memory on CUDA, so no staging step runs on
    the host. Not counted in a job's bytes (the caller counts them).
    """
    outs: list[torch.Tensor | None] = [None] * len(tensors)
    if device.pin_host_memory:
        meter = device.meter
        with meter.unmetered() if meter is not None else contextlib.nullcontext():
            outs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    hosts, transfer = device.transfer.demote(tensors, outs)
    return [Parked(host, transfer) for host in hosts]


def unpark(device: Device, parked: list[Parked]) -> list[torch.Tensor]:
    """``parked`` host copies (of any device) back on ``device``, for the calling thread.

    On CUDA the copies run on the device's host -> device stream once the device -> host
    copies' events completed (the stream waits for them, not the host), and the calling
    thread's current stream waits for an event recorded after them; metered like a promotion
    (counted in the device's transfers, not in a job's bytes). Elsewhere the device -> host
    copies are complete already and this is a promotion.

    Raises:
        torch.OutOfMemoryError: They do not fit the device budget.
    """
    if not parked:
        return []
    engine = device.transfer
    hosts = [p.host for p in parked]
    events = {id(p.transfer): p.transfer.event for p in parked}
    if not engine.cuda or all(event is None for event in events.values()):
        return engine.promote(hosts)
    outs = engine.allocate(hosts)
    stream = engine.stream
    stream.wait_stream(torch.cuda.current_stream(device.torch_device))
    for event in events.values():
        if event is not None:
            stream.wait_event(event)
    with torch.cuda.stream(stream):
        for out, host in zip(outs, hosts, strict=True):
            out.copy_(host, non_blocking=True)
    for host in hosts:
        device.transfers.add("promote", host.nbytes)
    done = torch.cuda.Event()
    done.record(stream)
    return DeviceTransfer(done, outs, device.torch_device).wait_device()


class PackSwaps:
    """A pipelined job's packs on and off their devices (see the module doc).

    Args:
        job: The job, between steps (what its shard tasks kept or prefetched on a device is
            written back when the packs load).
        layout: Its packs over the devices.

    Attributes:
        peak_device_bytes: Per device, the highest metered bytes while the run held it.
    """

    def __init__(self, job: PipelinedJob, layout: PipelineLanes) -> None:
        self.job = job
        self.layout = layout
        self._state_stays = pipeline_state_stays(job.plan, layout.cuts, len(layout.devices))
        self._prefetch_fits = pipeline_prefetch_fits(job.plan, layout.cuts, len(layout.devices))
        self.peak_device_bytes = {device.name: 0 for device in layout.devices}
        self._loaded = False
        #: tied parameter -> set once its owner's deferred clipped update is on the host
        self._stale: dict[TensorKey, threading.Event] = {}

    def send_home(self, device: Device, tensor: torch.Tensor) -> Parked:
        """Park ``tensor`` of ``device`` on the host (:func:`park`), counted in ``swap_bytes``."""
        parked = park(device, [tensor])[0]
        self._count(device, tensor.nbytes)
        return parked

    def bring_back(self, device: Device, parked: Parked) -> torch.Tensor:
        """``parked`` on ``device`` (:func:`unpark`), counted in ``swap_bytes``."""
        tensor = unpark(device, [parked])[0]
        self._count(device, tensor.nbytes)
        return tensor

    def _count(self, device: Device, num_bytes: int) -> None:
        """Count host <-> device bytes (none for the host CPU itself: its copies are in place)."""
        if not device.transfer.in_place:
            with self.layout.lock:
                self.job.boundaries.swap_bytes += num_bytes

    def state_stays(self, shard: int) -> bool:
        """Whether the shard's optimizer state stays on its device between updates."""
        return self._state_stays[shard]

    def load(self) -> None:
        """Promote each device's first pack (a tied tensor: a copy per pack)."""
        if self._loaded:
            return
        job = self.job
        job.store.release()  # a shard kept or prefetched by its shard tasks: the packs replace it
        self._loaded = True  # from here on unload frees what loaded, should a promotion fail
        for lane in self.layout.lanes:
            meter = lane.device.meter
            if meter is not None:
                meter.reset_peak()
            self.swap_in(lane, lane.packs[0], {}, states=not lane.wraps)
        job.store.device_name = ",".join(d.name for d in self.layout.devices)

    def unload(self) -> None:
        """Write changed parameters and the optimizer state back to the host; free the devices.

        A pack whose clipped update is still deferred comes in for it first. The host waits
        here for every copy still writing host memory (the one round trip of a run's end).
        """
        if not self._loaded:
            return
        self._loaded = False
        job = self.job
        lanes = self.layout.lanes
        try:
            for lane in lanes:
                self._drop_prefetch(lane)
                if lane.current is not None:
                    self.swap_out(lane, {})
            for lane in lanes:
                for pack in lane.packs:
                    if any(job.compute.deferred(s) for s in pack.shards):
                        self.swap_in(lane, pack, {}, states=False)
                        self.swap_out(lane, {})
        finally:
            for lane in lanes:
                self._drop_prefetch(lane)
                if lane.current is not None:  # a failed swap: free what it holds
                    self.swap_out(lane, {})
                meter = lane.device.meter
                if meter is not None:
                    name = lane.device.name
                    self.peak_device_bytes[name] = max(self.peak_device_bytes[name],
                                                       meter.peak_bytes)
            bookkeeping = job.bookkeeping
            bookkeeping.peak_device_bytes = max(bookkeeping.peak_device_bytes,
                                                *self.peak_device_bytes.values())
            settle_all()

    def arm_tied(self) -> None:
        """Before a phase: note the tied parameters whose host copies a deferred update changes.

        Their owner's clipped update waits for its pack to come in
        (:meth:`~sweepmaster.runtime.training.compute.ShardCompute.deferred`); a pack holding
        a copy waits for it (:meth:`await_tied`), and the owner writes the value back to the
        host when it applies the update, instead of when it leaves.
        """
        job = self.job
        self._stale = {key: threading.Event() for pack in self.layout.packs
                       for shard in pack.shards if job.compute.deferred(shard)
                       for key in job.members.owned_keys(shard) if key in pack.lenders}

    def await_tied(self, pack: Pack) -> None:
        """Wait until the host holds the updated values of the tied tensors ``pack`` copies.

        On the device's thread, before the pack comes in for a forward; an owner's pack
        comes in before: the activations flow from it.
        """
        for key in pack.lent:
            event = self._stale.get(key)
            if event is not None:
                self.layout.wait(event)

    def _hosts(self, pack: Pack) -> list[torch.Tensor]:
        """The host tensors a pack's promotion copies: its own, then its lent tensors'."""
        job = self.job
        with self.layout.lock:  # a lent tensor's holder may be installing it meanwhile
            return [job.members.host_tensor(k) for k in [*pack.own, *pack.lent]]

    def swap_in(self, lane: Lane, pack: Pack, kept: KeptInputs, *, states: bool) -> None:
        """Make ``pack`` the lane's resident pack (see the module doc).

        ``kept``: its inputs parked on the host come back (:func:`unpark`). ``states``:
        promote its staying optimizer states too (it comes in for its backward, or for the
        whole run).
        """
        job, device = self.job, lane.device
        if lane.current is pack:
            return
        if lane.current is not None:
            self.swap_out(lane, kept)
        prefetched = self._drop_prefetch(lane)
        if prefetched is not None and prefetched[0] is pack:
            copies = prefetched[1]
        else:
            del prefetched
            copies = device.transfer.promote(self._hosts(pack))
        parked = [key for key in kept if key[0] in pack.shards]
        back = unpark(device, [_parked(kept[key]) for key in parked])
        with self.layout.lock:
            moved = sum(c.nbytes for c in copies) + sum(t.nbytes for t in back)
            job.boundaries.swap_bytes += moved
            job.store.num_promotes += len(pack.shards)
            num_own = len(pack.own)
            job.store.install(pack.own, copies[:num_own])
            pack.borrowed = {k: c.requires_grad_(job.members.trainable(k))
                             for k, c in zip(pack.lent, copies[num_own:], strict=True)}
            lane.current = pack
            kept.update(zip(parked, back, strict=True))
            for shard in pack.shards:
                if job.compute.deferred(shard):  # a deferred clipped update
                    job.compute.apply_deferred(shard, device)
                    for key in job.members.owned_keys(shard):  # a tied value other packs wait for
                        if key in self._stale:
                            job.store.write_back_tensor(key, device)
                            self._stale[key].set()
                if states and self._state_stays[shard]:
                    job.store.promote_state(shard, device)

    def swap_out(self, lane: Lane, kept: KeptInputs) -> None:
        """Send the lane's resident pack home (see the module doc); park its kept inputs."""
        job, device, pack = self.job, lane.device, lane.current
        assert pack is not None
        parking = [key for key in kept if key[0] in pack.shards]
        parked = park(device, [_on_device(kept[key]) for key in parking]) if parking else []
        with self.layout.lock:
            if parking:
                job.boundaries.swap_bytes += sum(p.host.nbytes for p in parked)
                kept.update(zip(parking, parked, strict=True))
            lane.current = None
            job.store.uninstall(pack.own, device)
            for shard in pack.shards:
                job.store.demote_state(shard, device)
            job.store.num_demotes += len(pack.shards)
            for copy in pack.borrowed.values():
                copy.grad = None
            pack.borrowed = {}

    @staticmethod
    def _drop_prefetch(lane: Lane) -> tuple[Pack, list[torch.Tensor]] | None:
        """The lane's prefetched pack and its copies, once copied (None: none)."""
        prefetched, lane.prefetched = lane.prefetched, None
        if prefetched is None:
            return None
        return prefetched[0], prefetched[1].wait_device()

    def prefetch(self, lane: Lane, pack: Pack, following: Pack | None) -> None:
        """Start copying ``following``'s parameters in while ``pack`` computes, if they fit."""
        if following is None or not self._prefetch_fits.get((pack.index, following.index)):
            return
        if any(not self._stale[k].is_set() for k in following.lent if k in self._stale):
            return  # a tied value is not on the host yet: it comes in when it is
        hosts = self._hosts(following)
        transfer = lane.device.transfer
        lane.prefetched = (following, transfer.copy_in(transfer.allocate(hosts), hosts))

    def end_tasks(self, task: ShardTask) -> None:
        """The job's bookkeeping once ``task`` (a step's or evaluation's last) ran.

        When it reads or changes the host copies (a checkpoint; a fused array's member
        leaving, or joining where one may), the packs go home first (written back, deferred
        clipped updates applied) and load again for the next step: a fused array pipelines
        only steps at which its members stay the same.
        """
        if self.job.bookkeeping.host_due(task):
            self.unload()
        self.job.bookkeeping.end_tasks(task, self.layout.packs[-1].device)


def _parked(kept: torch.Tensor | Parked) -> Parked:
    assert isinstance(kept, Parked)
    return kept


def _on_device(kept: torch.Tensor | Parked) -> torch.Tensor:
    assert isinstance(kept, torch.Tensor)
    return kept


@dataclass(frozen=True)
class PipelineParts:
    """What a pipelined run's training steps and evaluations run over, built once by the run.

    Attributes:
        job: The job, between steps.
        layout: Its packs over the devices, and the threads that run them.
        swaps: Its packs on and off the devices.
    """

    job: PipelinedJob
    layout: PipelineLanes
    swaps: PackSwaps
