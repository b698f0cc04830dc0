"""Pipelined training of one spilled job over several devices (Harmony's PP mode).

Harmony (Li et al., VLDB 2022, https://arxiv.org/abs/2202.01306) trains a model larger than a
device on several devices at once: the job's shards are split into contiguous **packs**
(balanced-time packing, :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_packs`), and
the minibatch's M microbatches flow through the packs as a pipeline, GPipe-style (Huang et al.,
NeurIPS 2019): all forwards, then all backwards, flushed at the end of every step (synchronous
SGD, the numbers of ``train_plain``). With P packs on D devices, pack p runs on device
``p mod D``: one pack per device (P = D), each resident for the whole run; or **wrap-around**
(P > D, :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_wrap`), each device swapping
its packs in and out from the host in turn while the activations still flow pack to pack device
to device.

:class:`PipelinedRun` drives any spilled job that way, through the per-shard interface of
:class:`~sweepmaster.runtime.training.chain.ShardChain`: one member
(:class:`~sweepmaster.runtime.training.spill.SpilledJob`) or a fused array of K stacked members
(:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`, ``vmap`` over members, its
boundaries ``(K, B, ...)``, its clip norms and coefficients per member ``(K,)``). It is the same
trainer (its microbatch passes, dropout, optimizers, just-in-time update, step and evaluation
bookkeeping, task chain), only placed differently. One thread per device runs its packs in order
(each over every microbatch: input-batch grouping):

* **load**: each device's first pack's shards (parameters, buffers, and on a device of one pack
  the optimizer states that have room,
  :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_state_stays`) are promoted; clipped
  updates the job's shard tasks deferred are applied when their pack comes in; a tied parameter
  another pack holds (GPT-2's ``wte`` in the head's pack) gets a copy of its own in that pack;
* **swaps** (wrap-around): a device's forwards run its packs first to last, its backwards last
  to first (its last pack stays between the two). A pack leaving the device writes back what its
  update changed and its optimizer state, and between its forward and its backward parks its
  kept inputs on the host; one coming in is promoted (its staying states too for a backward,
  with its parked inputs), already copied in when the next pack fit beside the current one
  (prefetch: on CUDA the copy overlaps the compute). Between steps each device holds its first
  pack, which a device of one pack never leaves;
* **step**: pack p runs microbatch m's forward over its shards without grad, keeping each
  shard's input for the recompute, and sends its output to pack p + 1 device to device
  (:meth:`~sweepmaster.runtime.devices.transfer.TransferEngine.p2p`), never through the host;
  the last pack runs forward, loss and backward of each microbatch at once; backwards flow back
  pack to pack, each shard's pass recomputing its forward from its kept input with the dropout
  RNG replayed. A shard is updated right after its last microbatch's backward while resident
  (Harmony's just-in-time update). A tied parameter's gradient contribution goes to its owner's
  pack before the owner's update (p2p from a device's first pack; through the host from a pack
  that leaves before), and the updated value goes to the borrowing packs on their devices after
  the step (p2p), and to the host for those that come in later. With ``grad_clip`` every pack's
  per-parameter norms cross to the first device and the coefficient comes back once every
  device is done; each device's first pack is updated then, a pack that left already parks its
  gradients on the host and is updated when it comes back (the next step's forward, or the
  run's end);
* **dropout**: pack p draws from its own copy of the job's stream, started from the state the
  stream has after pack p - 1's shards' first microbatch (sent along with it): each shard
  records its RNG tape on microbatch 0 and replays it for the others and for its recompute,
  drawing full-minibatch masks (:class:`~sweepmaster.runtime.training.replay.RandomReplay`), so
  the masks are plain training's whatever the interleaving; after the step the job's stream
  takes the last pack's state. A fused array draws every member's noise of the step at its
  start (on the host, packed masks), and each pass promotes its layers' rows of it;
* **evaluation**: the evaluation batches flow through the packs forward only;
* **unload** (the run's end): changed parameters and the optimizer state are written back to
  the host (a deferred clipped update applied first).

Bytes: with one pack per device, host -> device only the one-time load, the token ids of each
step (to the first and the last pack) and of each evaluation, the optimizer states that do
not stay (back and forth at each update), and a fused array's dropout masks (each pass's
microbatch rows); device -> host the final write-back. Wrap-around adds
each device's swaps (:func:`~sweepmaster.runtime.scheduling.pipeline.pipeline_step` predicts
them per device). Device -> device per step: every pack boundary's activations and gradients
over the minibatch, the tied parameters' contributions and values of devices' first packs, and
under ``grad_clip`` 4 bytes per norm of a device but the first, and per coefficient.

A pipelined step recomputes every activation (Hydra), whatever the job's memory plan (its
shard tasks keep using it). Checkpoints (``checkpoint_every``) are the job's own, written at
the same steps as its shard tasks write them: the packs go home first and load again for the
next step. A fused array pipelines only steps at which its members stay the same: at a step
boundary where a member leaves (ends, is pruned, fails alone), where one may join (a free slot
and a refill hook), or where a member checkpoints, the packs go home first; the array then goes
on with its K rows and loads again for the next step.
Each device's thread computes with torch's intra-op thread count; split the cores between the
devices with ``torch.set_num_threads`` before the run (as the executor does between its workers).

Shape legend: K members (a fused array), B batch, b microbatch, T tokens per block, C hidden.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import DeviceTransfer, settle_all
from sweepmaster.runtime.execution.events import TrainCallbacks
from sweepmaster.runtime.planning.pipeline_plan import (
    pipeline_reserve_bytes,
    pipeline_resident_bytes,
    pipeline_state_stays,
)
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.pipeline import lanes
from sweepmaster.runtime.training.boundaries import metering
from sweepmaster.runtime.training.chain import ShardChain
from sweepmaster.runtime.training.plain import host_rng_guard, preserved_rng
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.runtime.training.tasks import ShardTask, TensorKey
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["PipelinedRun", "train_pipelined"]

#: Seconds between checks of a failed device while it waits for a neighbour.
_POLL_S = 0.05

#: ``(shard, microbatch)`` -> a kept input: on the device, or parked on the host.
_Kept = dict[tuple[int, int], torch.Tensor]


class _Aborted(Exception):
    """Another device failed; this one stops waiting."""


@dataclass
class _Pack:
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
class _Lane:
    """One device and its packs in order (pack p on device ``p mod D``)."""

    index: int
    device: Device
    packs: list[_Pack]
    current: _Pack | None = None  # the pack resident on the device
    #: a pack whose parameters are being copied in ahead of its turn
    prefetched: tuple[_Pack, DeviceTransfer] | None = None

    @property
    def wraps(self) -> bool:
        return len(self.packs) > 1


class PipelinedRun:
    """One spilled job trained over several devices, its packs flowing (see the module doc).

    Not thread-safe: one :meth:`run` at a time; it starts one thread per device.

    Args:
        job: The job (one member or a fused array), between steps (what its shard tasks kept
            or prefetched on a device is written back when the packs load); its plan's
            microbatch sizes give the pipeline's microbatch (the smallest).
        devices: D distinct devices, ``2 <= D <= P``: pack p runs on ``devices[p % D]``.
        cuts: Cut points ``(0, c1, ..., S)`` of the P packs over the job's shards.

    Attributes:
        peak_device_bytes: Per device, the highest metered bytes while the run held it.

    Raises:
        ValueError: Fewer than two packs, fewer than two devices or more than packs, devices
            not distinct, cut points that are not ``0 < ... < S``, or under ``grad_clip`` a
            tied parameter owned by a pack that is not its device's first.
    """

    def __init__(self, job: ShardChain, devices: Sequence[Device], cuts: Sequence[int]) -> None:
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
        self.packs = [_Pack(i, devices[i % num_devices], range(a, b))
                      for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
        self.lanes = [_Lane(d, devices[d], [self.packs[p] for p in lane])
                      for d, lane in enumerate(lanes(num_packs, num_devices))]
        holder: dict[TensorKey, int] = {}  # tensor -> the pack that installs it
        for pack in self.packs:
            keys = list(dict.fromkeys(k for s in pack.shards for k in job.shard_keys(s)))
            pack.own = [k for k in keys if k not in holder]
            pack.lent = [k for k in keys if k in holder]
            for key in pack.lent:
                if job.trainable(key):
                    self.packs[holder[key]].lenders.setdefault(key, []).append(pack.index)
            holder.update((k, pack.index) for k in pack.own)
        if job.clips and any(p.lenders and p.index >= num_devices for p in self.packs):
            raise ValueError("under grad_clip a tied parameter must belong to a device's first "
                             "pack")
        shard = min(range(num_shards), key=lambda i: job.plan.shards[i].microbatch_size)
        self._microbatch_shard = shard
        self._state_stays = pipeline_state_stays(job.plan, cuts, num_devices)
        self._prefetch_fits = self._prefetch_room()
        self.peak_device_bytes = {device.name: 0 for device in devices}
        self._lock = job.counter_lock  # the job's byte counters and host bookkeeping
        self._loaded = False
        self._failed = threading.Event()
        self._downstream: list[queue.Queue[Any]] = []  # pack p -> p + 1: activations
        self._upstream: list[queue.Queue[Any]] = []  # pack p + 1 -> p: their gradients
        self._tied: list[queue.Queue[Any]] = []
        self._norms: dict[int, dict[TensorKey, torch.Tensor]] = {}  # pack -> param -> norm
        self._coefs: list[torch.Tensor] = []  # per device
        self._barrier = threading.Barrier(1)
        self._last_state: torch.Tensor | None = None

    def _prefetch_room(self) -> dict[tuple[int, int], bool]:
        """``(pack, next pack on its device)`` -> whether the next one's parameters fit beside.

        Beside the pack's resident bytes, all its optimizer states and one boundary.
        """
        plan = self.job.plan
        resident = pipeline_resident_bytes(plan)
        reserve = pipeline_reserve_bytes(plan)
        fits = {}
        for lane in self.lanes:
            for a, b in zip(lane.packs, lane.packs[1:], strict=False):
                for one, other in ((a, b), (b, a)):
                    held = sum(resident[s] + plan.shards[s].optimizer_bytes for s in one.shards)
                    incoming = sum(plan.shards[s].param_bytes for s in other.shards)
                    fits[one.index, other.index] = (
                        held + reserve + incoming <= plan.budget_bytes)
        return fits

    # ------------------------------------------------------------------ run

    def run(self) -> None:
        """Train the job to its end (or until pruned or every member left), then unload.

        A job's result is its own (``SpilledJob.result``; a fused array's members report
        theirs as they leave).

        Raises:
            torch.OutOfMemoryError: A pack did not fit its device.
            FloatingPointError: The train loss became non-finite.
        """
        job = self.job
        try:
            self.load()
            while (task := job.next_task()) is not None:
                if task.phase == "train":
                    self.step()
                elif task.phase == "eval":
                    self.evaluate()
                else:
                    self.update()
        finally:
            self.unload()
        job.settle(self.devices[0])

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

    # ------------------------------------------------------------------ swaps

    def _hosts(self, pack: _Pack) -> list[torch.Tensor]:
        """The host tensors a pack's promotion copies: its own, then its lent tensors'."""
        job = self.job
        with self._lock:  # a lent tensor's holder may be installing it meanwhile
            return [job.host_tensor(k) for k in [*pack.own, *pack.lent]]

    def _swap_in(self, lane: _Lane, pack: _Pack, kept: _Kept, *, states: bool) -> None:
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
                if states and self._state_stays[shard]:
                    job.promote_state(shard, device)

    def _swap_out(self, lane: _Lane, kept: _Kept) -> None:
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
    def _drop_prefetch(lane: _Lane) -> tuple[_Pack, list[torch.Tensor]] | None:
        """The lane's prefetched pack and its copies, once copied (None: none)."""
        prefetched, lane.prefetched = lane.prefetched, None
        if prefetched is None:
            return None
        return prefetched[0], prefetched[1].wait_device()

    def _prefetch(self, lane: _Lane, pack: _Pack, following: _Pack | None) -> None:
        """Start copying ``following``'s parameters in while ``pack`` computes, if they fit."""
        if following is None or not self._prefetch_fits.get((pack.index, following.index)):
            return
        hosts = self._hosts(following)
        transfer = lane.device.transfer
        lane.prefetched = (following, transfer.copy_in(transfer.allocate(hosts), hosts))

    # ------------------------------------------------------------------ a step

    def step(self) -> None:
        """Run the job's next training step pipelined (its ``2 S - 1`` tasks at once).

        Raises:
            ValueError: The job's next task does not start a training step.
        """
        job = self.job
        num_shards = len(job.plan.shards)
        tasks = job.take_tasks(2 * num_shards - 1)
        expected = [("forward", s) for s in range(num_shards - 1)] + [
            ("backward", s) for s in range(num_shards - 1, -1, -1)]
        if [(t.kind, t.shard) for t in tasks] != expected or {t.phase for t in tasks} != {
                "train"}:
            raise ValueError(f"job {job.name!r}: the next tasks are not a training step")
        if not job.started:
            job.start(self.packs[0].device, tasks[0])
        self.load()
        swap_start = job.swap_bytes
        first, last = self.packs[0], self.packs[-1]
        job.start_step(first.device)
        ids_first = job.to_device(first.device, job.step_ids())
        ids_last = job.to_device(last.device, job.step_ids())
        clip = job.clips
        self._last_state = None
        self._barrier = threading.Barrier(len(self.lanes), action=self._clip_coefficients)
        self._run_lanes(functools.partial(self._train_lane, ids_first=ids_first,
                                          ids_last=ids_last, clip=clip))
        del ids_first, ids_last
        self._coefs = []
        self._return_tied()
        if self._last_state is not None:
            job.set_dropout_state(self._last_state)
        job.finish_step(last.device, job.swap_bytes - swap_start)
        self._end_tasks(tasks[-1])

    def _train_lane(self, lane: _Lane, ids_first: torch.Tensor, ids_last: torch.Tensor,
                    clip: bool) -> None:
        """One device's share of a step, on its own thread (see the module doc)."""
        job = self.job
        device = lane.device
        final = len(job.plan.shards) - 1
        microbatches = job.microbatches(self._microbatch_shard)
        weight = len(microbatches) > 1
        kept: _Kept = {}
        rngs: dict[int, JobRng | None] = {}
        following = [*lane.packs[1:], None]
        for pack, after in zip(lane.packs, following, strict=True):  # forwards
            # the last stays for its backward; under grad_clip only a first is updated then
            self._swap_in(lane, pack, kept,
                          states=after is None and (not clip or pack is lane.packs[0]))
            self._prefetch(lane, pack, after)
            is_first, is_last = pack.index == 0, pack.index == len(self.packs) - 1
            state, pending = None, []
            if not is_first:  # the stream as the previous pack's first microbatch left it
                pending.append(self._get(self._downstream[pack.index - 1]))
                state = pending[0][2]
            rng = rngs[pack.index] = job.dropout_stream(state)
            with _bound(rng, device):
                for mb, rows in enumerate(microbatches):
                    if is_first:
                        x = job.rows_of(ids_first, rows)
                    else:
                        got, x, _ = pending.pop() if pending else self._get(
                            self._downstream[pack.index - 1])
                        assert got == mb
                    for shard in pack.shards:
                        kept[shard, mb] = x
                        if shard == final:
                            break
                        x = job.forward_pass(shard, mb, rows, x, device, rng, pack.borrowed)
                    if is_last:
                        self._backward(pack, mb, rows, kept, job.rows_of(ids_last, rows), rng,
                                       weight, finish=not clip and mb == len(microbatches) - 1)
                    else:
                        state = rng.get_state() if mb == 0 and rng is not None else None
                        sent = self._p2p(device, [x], self.packs[pack.index + 1].device)[0]
                        self._downstream[pack.index].put((mb, sent, state))
                        del sent
                    del x
            if is_last and rng is not None:
                self._last_state = rng.saved_state()
        earlier = [None, *lane.packs[:-1]]
        for pack, before in zip(reversed(lane.packs), reversed(earlier), strict=True):
            if pack.index < len(self.packs) - 1:  # backwards (the last pack's ran already)
                self._swap_in(lane, pack, kept, states=not clip or before is None)
                self._prefetch(lane, pack, before)
                with _bound(rngs[pack.index], device):
                    for mb, rows in enumerate(microbatches):
                        got, grad, sender = self._get(self._upstream[pack.index])
                        assert got == mb
                        received = self._p2p(sender, [grad], device)[0]
                        del grad
                        self._backward(pack, mb, rows, kept, received, rngs[pack.index],
                                       weight, finish=not clip and mb == len(microbatches) - 1)
                        del received
            if clip:
                self._clip_norms(lane, pack, stays=before is None)
        if clip:
            self._wait_barrier()
            coef = self._coefs[lane.index]
            with metering(device):
                for shard in lane.packs[0].shards:
                    self._update(lane.packs[0], shard, coef)

    def _backward(self, pack: _Pack, mb: int, rows: slice, kept: _Kept, target: torch.Tensor,
                  rng: JobRng | None, weight: bool, finish: bool) -> None:
        """Microbatch ``mb``'s backward through the pack's shards, last first.

        ``target``: the labels (the last pack) or the gradient of the pack's output. With
        ``finish`` (the last microbatch), each shard is updated right after its backward.
        """
        job = self.job
        device = pack.device
        for shard in reversed(pack.shards):
            x = kept.pop((shard, mb))
            grad = job.backward_pass(shard, mb, rows, x, functools.partial(_given, target),
                                     device, weight, rng, pack.borrowed)
            del x
            target = grad  # type: ignore[assignment]
            if finish:
                with metering(device):
                    self._lend(pack, shard)
                    self._take_contributions(pack, shard)
                    self._update(pack, shard)
        if pack.index > 0:
            self._upstream[pack.index - 1].put((mb, target, device))

    def _stays(self, pack: _Pack) -> bool:
        """Whether the pack is on its device at the step's end (its device's first)."""
        return pack.index < len(self.lanes)

    def _lend(self, pack: _Pack, shard: int) -> None:
        """Send the pack's gradient contributions to tied tensors other packs hold.

        Once, after the backward of the pack's first shard (its last backward of the step):
        p2p from a device's first pack, through the host from a pack that leaves before the
        owner's update.
        """
        if shard != pack.shards[0]:
            return
        job = self.job
        for key, copy in pack.borrowed.items():
            if copy.requires_grad:
                assert copy.grad is not None
                holder = next(p for p in self.packs if key in p.lenders)
                message: tuple[TensorKey, torch.Tensor, Device | None, int]
                if self._stays(pack):
                    message = (key, copy.grad, pack.device, pack.index)
                else:
                    with self._lock:
                        message = (key, job.to_host(pack.device, copy.grad), None, pack.index)
                self._tied[holder.index].put(message)
                copy.grad = None

    def _take_contributions(self, pack: _Pack, shard: int) -> None:
        """Add the other packs' contributions to the shard's tied parameters' gradients.

        Like the one-device path: the later contributions summed first, then added.
        """
        job = self.job
        owned = [k for k in job.owned_keys(shard) if k in pack.lenders]
        if not owned:
            return
        expected = sum(len(pack.lenders[k]) for k in owned)
        received: dict[TensorKey, list[tuple[int, torch.Tensor]]] = {}
        for _ in range(expected):
            key, grad, sender, index = self._get(self._tied[pack.index])
            if sender is None:  # parked on the host
                with self._lock:
                    copy = job.to_device(pack.device, grad)
            else:
                copy = self._p2p(sender, [grad], pack.device)[0]
            received.setdefault(key, []).append((index, copy))
            del grad, copy
        for key in owned:
            parts = [g for _, g in sorted(received.pop(key), key=lambda item: -item[0])]
            total = parts[0]
            for part in parts[1:]:
                total = part + total
            grad = job.installed(key).grad
            assert grad is not None
            grad.add_(total)

    def _clip_norms(self, lane: _Lane, pack: _Pack, stays: bool) -> None:
        """``grad_clip``: a pack's norms; one that leaves parks its gradients (update deferred)."""
        job = self.job
        device = lane.device
        norms: dict[TensorKey, torch.Tensor] = {}
        with metering(device):
            self._lend(pack, pack.shards[0])
            for shard in pack.shards:
                self._take_contributions(pack, shard)
                norms.update(job.grad_norms(shard))
        with self._lock:
            self._norms[pack.index] = norms
            if stays:
                return
            for shard in pack.shards:
                job.park_grads(shard, device)

    def _update(self, pack: _Pack, shard: int, clip_coef: torch.Tensor | None = None) -> None:
        """The shard's just-in-time update; a state that does not stay goes home after it."""
        job = self.job
        if not job.updates(shard):
            return
        if self._state_stays[shard] and job.state_on_device(shard):
            job.update_shard(shard, pack.device, clip_coef)
            return
        with self._lock:  # the job's swap byte counter
            job.update_shard(shard, pack.device, clip_coef)
            if not self._state_stays[shard]:
                job.demote_state(shard, pack.device)

    def _clip_coefficients(self) -> None:
        """The global clip coefficient (``clip_grad_norm_``'s; per member ``(K,)``) everywhere.

        Computed on the first device from every norm; the barrier's action (every device
        waits for it). Deferred updates read it from the host.
        """
        job = self.job
        first = self.devices[0]
        norms: dict[TensorKey, torch.Tensor] = {}
        for lane in self.lanes:
            keys = [k for p in lane.packs for k in self._norms[p.index]]
            values = [v for p in lane.packs for v in self._norms[p.index].values()]
            if lane.index > 0:
                values = self._p2p(lane.device, values, first)
            norms.update(zip(keys, values, strict=True))
        with metering(first):
            coef = job.clip_coefficient(norms, first)
        self._coefs = [coef] + [self._p2p(first, [coef], lane.device)[0]
                                for lane in self.lanes[1:]]
        if any(job.deferred(s) for s in range(len(job.plan.shards))):
            with self._lock:
                job.defer_clip(coef, first)
        self._norms.clear()

    def _return_tied(self) -> None:
        """Give the updated tied parameters to the packs that hold copies of them.

        p2p to a borrowing pack on its device; to the host (its next promotion reads it there)
        when a borrowing pack is not, or will leave.
        """
        job = self.job
        for pack in self.packs:
            for key, borrowers in pack.lenders.items():
                if self.lanes[pack.index % len(self.lanes)].current is not pack:
                    continue  # written back when it left
                tensor = job.installed(key)
                for index in borrowers:
                    borrower = self.packs[index]
                    if self.lanes[index % len(self.lanes)].current is borrower:
                        with torch.no_grad():
                            self._p2p(pack.device, [tensor.detach()], borrower.device,
                                      outs=[borrower.borrowed[key]])
                if any(self.lanes[i % len(self.lanes)].wraps for i in borrowers):
                    with self._lock:
                        job.write_back_tensor(key, pack.device)

    def update(self) -> None:
        """Take the job's next ``update`` tasks (``S - 1``, after a step, under ``grad_clip``).

        The deferred clipped updates they stand for are applied as their packs come in, or
        when the packs go home (here, when the job's bookkeeping reads the host copies: a
        member leaves or checkpoints).

        Raises:
            ValueError: The job's next tasks are not ``update`` tasks.
        """
        job = self.job
        tasks = job.take_tasks(len(job.plan.shards) - 1)
        if any(t.phase != "update" for t in tasks):
            raise ValueError(f"job {job.name!r}: the next tasks are not deferred updates")
        self._end_tasks(tasks[-1])

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> None:
        """Run the job's next evaluation (its ``S`` tasks at once) through the packs.

        Raises:
            ValueError: The job's next task does not start an evaluation.
        """
        job = self.job
        num_shards = len(job.plan.shards)
        tasks = job.take_tasks(num_shards)
        if [(t.phase, t.shard) for t in tasks] != [("eval", s) for s in range(num_shards)]:
            raise ValueError(f"job {job.name!r}: the next tasks are not an evaluation")
        if not job.started:
            job.start(self.packs[0].device, tasks[0])
        self.load()
        with job.evaluating():
            ids_first = job.to_device(self.packs[0].device, job.eval_ids())
            ids_last = job.to_device(self.packs[-1].device, job.eval_ids())
            torch_device = self.packs[0].device.torch_device
            with host_rng_guard(torch_device), preserved_rng(torch_device):
                self._run_lanes(functools.partial(self._eval_lane, ids_first=ids_first,
                                                  ids_last=ids_last))
            del ids_first, ids_last
        job.finish_eval()
        self._end_tasks(tasks[-1])

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

    def _eval_lane(self, lane: _Lane, ids_first: torch.Tensor, ids_last: torch.Tensor) -> None:
        job = self.job
        device = lane.device
        num_rows = ids_first.shape[job.row_dim]
        for pack in lane.packs:
            self._swap_in(lane, pack, {}, states=False)
            is_last = pack.index == len(self.packs) - 1
            for mb, rows in enumerate(job.eval_chunks(self._microbatch_shard, num_rows)):
                if pack.index == 0:
                    x = job.rows_of(ids_first, rows)
                else:
                    got, x, _ = self._get(self._downstream[pack.index - 1])
                    assert got == mb
                with torch.no_grad(), metering(device):
                    for shard in pack.shards:
                        x = job.eval_pass(shard, x, device, pack.borrowed)
                    if is_last:
                        job.add_eval_loss(x, job.rows_of(ids_last, rows))
                if not is_last:
                    sent = self._p2p(device, [x], self.packs[pack.index + 1].device)[0]
                    self._downstream[pack.index].put((mb, sent, None))
                    del sent
                del x

    # ------------------------------------------------------------------ threads

    def _run_lanes(self, work: Callable[[_Lane], None]) -> None:
        """Run ``work`` for every device, one thread each; the first failure is raised."""
        num_packs = len(self.packs)
        self._failed.clear()
        self._downstream = [queue.Queue() for _ in range(num_packs - 1)]
        self._upstream = [queue.Queue() for _ in range(num_packs - 1)]
        self._tied = [queue.Queue() for _ in range(num_packs)]

        def guarded(lane: _Lane) -> None:
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
        self._downstream, self._upstream, self._tied = [], [], []
        if first is not None:
            raise first

    def _get(self, source: queue.Queue[Any]) -> Any:
        """The next message from a neighbour pack (raises :class:`_Aborted` if a device failed)."""
        while True:
            try:
                return source.get(timeout=_POLL_S)
            except queue.Empty:
                if self._failed.is_set():
                    raise _Aborted from None

    def _wait_barrier(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            if self._failed.is_set():
                raise _Aborted from None
            raise

    def _p2p(self, src: Device, tensors: Sequence[torch.Tensor], dst: Device,
             outs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Copy ``tensors`` from ``src`` to ``dst`` for the calling thread's compute; counted."""
        copies = src.transfer.p2p(tensors, dst, outs).wait_device()
        with self._lock:
            self.job.p2p_bytes += sum(t.nbytes for t in tensors)
        return copies


def _given(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _bound(rng: JobRng | None, device: Device) -> contextlib.AbstractContextManager[Any]:
    """``rng`` bound as the device's generator (nothing for a job without a stream)."""
    return contextlib.nullcontext() if rng is None else rng.bound(device.torch_device)


def train_pipelined(
    spec: TrainSpec,
    devices: Sequence[Device],
    plan: JobPlan,
    packs: Sequence[int],
    callbacks: TrainCallbacks | None = None,
) -> TrainResult:
    """Train one spilled job pipelined over ``devices`` (Harmony PP; see the module doc).

    Example:
        >>> shape = pipeline_shape(plan, len(devices))  # doctest: +SKIP
        >>> cuts = choose_packs(shape, len(devices))  # doctest: +SKIP
        >>> result = train_pipelined(spec, devices, plan, cuts)  # doctest: +SKIP

    Args:
        spec: The job (K = 1).
        devices: D distinct devices, ``2 <= D <= P``: pack p runs on ``devices[p % D]`` (one
            pack per device, or wrap-around when the packs are more).
        plan: Its plan for one of the devices (``plan_job``): shards and microbatch sizes.
        packs: Cut points ``(0, c1, ..., S)`` of the P packs over the plan's shards
            (:func:`~sweepmaster.runtime.scheduling.pipeline.choose_packs` of
            :func:`~sweepmaster.planning.pipeline_shape`).
        callbacks: Progress receiver (called on the calling thread).

    Returns:
        The result, weights equal to ``train_plain``'s (microbatch sums aside); ``swap_bytes``
        host <-> device, ``p2p_bytes`` device -> device, ``peak_device_bytes`` the highest
        metered peak of the devices.

    Raises:
        ValueError: Packs and devices do not match (see :class:`PipelinedRun`).
        torch.OutOfMemoryError: A pack did not fit its device.
        FloatingPointError: The train loss became non-finite.
    """
    job = SpilledJob(spec, plan, callbacks)
    pipe = PipelinedRun(job, devices, packs)
    pipe.run()
    result = job.result()
    result.peak_device_bytes = max(pipe.peak_device_bytes.values()) or None
    return result
