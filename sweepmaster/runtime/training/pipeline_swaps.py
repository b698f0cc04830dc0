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
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import settle_all
from sweepmaster.runtime.planning.pipeline_plan import (
    pipeline_prefetch_fits,
    pipeline_state_stays,
)
from sweepmaster.runtime.training.chain import ShardChain
from sweepmaster.runtime.training.pipeline_lanes import Lane, Pack, PipelineLanes
from sweepmaster.runtime.training.tasks import ShardTask, TensorKey

__all__ = ["KeptInputs", "PackSwaps"]

#: ``(shard, microbatch)`` -> a kept input: on the device, or parked on the host.
KeptInputs = dict[tuple[int, int], torch.Tensor]


class PackSwaps(PipelineLanes):
    """A pipelined job's packs on and off their devices (see the module doc).

    Args:
        job: The job, between steps (what its shard tasks kept or prefetched on a device is
            written back when the packs load).
        devices: D distinct devices, ``2 <= D <= P``: pack p runs on ``devices[p % D]``.
        cuts: Cut points ``(0, c1, ..., S)`` of the P packs over the job's shards.

    Attributes:
        peak_device_bytes: Per device, the highest metered bytes while the run held it.

    Raises:
        ValueError: As :class:`~sweepmaster.runtime.training.pipeline_lanes.PipelineLanes`.
    """

    def __init__(self, job: ShardChain, devices: Sequence[Device], cuts: Sequence[int]) -> None:
        super().__init__(job, devices, cuts)
        self._state_stays = pipeline_state_stays(job.plan, self.cuts, len(self.devices))
        self._prefetch_fits = pipeline_prefetch_fits(job.plan, self.cuts, len(self.devices))
        self.peak_device_bytes = {device.name: 0 for device in devices}
        self._loaded = False
        #: tied parameter -> set once its owner's deferred clipped update is on the host
        self._stale: dict[TensorKey, threading.Event] = {}

    def load(self) -> None:
        """Promote each device's first pack (a tied tensor: a copy per pack)."""
        if self._loaded:
            return
        job = self.job
        job.release()  # a shard kept or prefetched by its shard tasks: the packs replace it
        self._loaded = True  # from here on unload frees what loaded, should a promotion fail
        for lane in self.lanes:
            meter = lane.device.meter
            if meter is not None:
                meter.reset_peak()
            self._swap_in(lane, lane.packs[0], {}, states=not lane.wraps)
        job.device_name = ",".join(d.name for d in self.devices)

    def unload(self) -> None:
        """Write changed parameters and the optimizer state back to the host; free the devices.

        A pack whose clipped update is still deferred comes in for it first.
        """
        if not self._loaded:
            return
        self._loaded = False
        job = self.job
        try:
            for lane in self.lanes:
                self._drop_prefetch(lane)
                if lane.current is not None:
                    self._swap_out(lane, {})
            for lane in self.lanes:
                for pack in lane.packs:
                    if any(job.deferred(s) for s in pack.shards):
                        self._swap_in(lane, pack, {}, states=False)
                        self._swap_out(lane, {})
        finally:
            for lane in self.lanes:
                self._drop_prefetch(lane)
                if lane.current is not None:  # a failed swap: free what it holds
                    self._swap_out(lane, {})
                meter = lane.device.meter
                if meter is not None:
                    name = lane.device.name
                    self.peak_device_bytes[name] = max(self.peak_device_bytes[name],
                                                       meter.peak_bytes)
            job.peak_device_bytes = max(job.peak_device_bytes, *self.peak_device_bytes.values())
            settle_all()

    def _arm_tied(self) -> None:
        """Before a phase: note the tied parameters whose host copies a deferred update changes.

        Their owner's clipped update waits for its pack to come in
        (:meth:`~sweepmaster.runtime.training.compute.ShardCompute.deferred`); a pack holding
        a copy waits for it (:meth:`_await_tied`), and the owner writes the value back to the
        host when it applies the update, instead of when it leaves.
        """
        job = self.job
        self._stale = {key: threading.Event() for pack in self.packs for shard in pack.shards
                       if job.deferred(shard)
                       for key in job.owned_keys(shard) if key in pack.lenders}

    def _await_tied(self, pack: Pack) -> None:
        """Wait until the host holds the updated values of the tied tensors ``pack`` copies.

        On the device's thread, before the pack comes in for a forward; an owner's pack
        comes in before: the activations flow from it.
        """
        for key in pack.lent:
            event = self._stale.get(key)
            if event is not None:
                self._wait(event)

    def _hosts(self, pack: Pack) -> list[torch.Tensor]:
        """The host tensors a pack's promotion copies: its own, then its lent tensors'."""
        job = self.job
        with self._lock:  # a lent tensor's holder may be installing it meanwhile
            return [job.host_tensor(k) for k in [*pack.own, *pack.lent]]

    def _swap_in(self, lane: Lane, pack: Pack, kept: KeptInputs, *, states: bool) -> None:
        """Make ``pack`` the lane's resident pack (see the module doc).

        ``kept``: its inputs parked on the host come back. ``states``: promote its staying
        optimizer states too (it comes in for its backward, or for the whole run).
        """
        job, device = self.job, lane.device
        if lane.current is pack:
            return
        if lane.current is not None:
            self._swap_out(lane, kept)
        prefetched = self._drop_prefetch(lane)
        if prefetched is not None and prefetched[0] is pack:
            copies = prefetched[1]
        else:
            del prefetched
            copies = device.transfer.promote(self._hosts(pack))
        parked = [key for key in kept if key[0] in pack.shards]
        back = device.transfer.promote([kept[key] for key in parked]) if parked else []
        with self._lock:
            job.swap_bytes += sum(c.nbytes for c in copies) + sum(t.nbytes for t in back)
            job.num_promotes += len(pack.shards)
            num_own = len(pack.own)
            job.install(pack.own, copies[:num_own])
            pack.borrowed = {k: c.requires_grad_(job.trainable(k))
                             for k, c in zip(pack.lent, copies[num_own:], strict=True)}
            lane.current = pack
            kept.update(zip(parked, back, strict=True))
            for shard in pack.shards:
                if job.deferred(shard):  # a deferred clipped update
                    job.apply_deferred(shard, device)
                    for key in job.owned_keys(shard):  # a tied value other packs wait for
                        if key in self._stale:
                            job.write_back_tensor(key, device)
                            self._stale[key].set()
                if states and self._state_stays[shard]:
                    job.promote_state(shard, device)

    def _swap_out(self, lane: Lane, kept: KeptInputs) -> None:
        """Send the lane's resident pack home (see the module doc); park its kept inputs."""
        job, device, pack = self.job, lane.device, lane.current
        assert pack is not None
        parking = [key for key in kept if key[0] in pack.shards]
        if parking:
            hosts, _ = device.transfer.demote([kept[key] for key in parking],
                                              [None] * len(parking))
        with self._lock:
            if parking:
                job.swap_bytes += sum(t.nbytes for t in hosts)
                kept.update(zip(parking, hosts, strict=True))
            lane.current = None
            job.uninstall(pack.own, device)
            for shard in pack.shards:
                job.demote_state(shard, device)
            job.num_demotes += len(pack.shards)
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

    def _prefetch(self, lane: Lane, pack: Pack, following: Pack | None) -> None:
        """Start copying ``following``'s parameters in while ``pack`` computes, if they fit."""
        if following is None or not self._prefetch_fits.get((pack.index, following.index)):
            return
        if any(not self._stale[k].is_set() for k in following.lent if k in self._stale):
            return  # a tied value is not on the host yet: it comes in when it is
        hosts = self._hosts(following)
        transfer = lane.device.transfer
        lane.prefetched = (following, transfer.copy_in(transfer.allocate(hosts), hosts))

    def _end_tasks(self, task: ShardTask) -> None:
        """The job's bookkeeping once ``task`` (a step's or evaluation's last) ran.

        When it reads or changes the host copies (a checkpoint; a fused array's member
        leaving, or joining where one may), the packs go home first (written back, deferred
        clipped updates applied) and load again for the next step: a fused array pipelines
        only steps at which its members stay the same.
        """
        if self.job.host_due(task):
            self.unload()
        self.job.end_tasks(task, self.packs[-1].device)

