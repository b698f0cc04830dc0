"""Pipelined training of one spilled job over several devices (Harmony's PP mode).

Harmony (Li et al., VLDB 2022, https://arxiv.org/abs/2202.01306) trains a model larger than a
device on several devices at once: the job's shards are split into contiguous **packs**
(balanced-time packing, :func:`~sweepmaster.runtime.planning.partition.pipeline_packs`), and
the minibatch's M microbatches flow through the packs as a pipeline, GPipe-style (Huang et al.,
NeurIPS 2019): all forwards, then all backwards, flushed at the end of every step (synchronous
SGD, the numbers of ``train_plain``). With P packs on D devices, pack p runs on device
``p mod D``: one pack per device (P = D), each resident for the whole run; or **wrap-around**
(P > D, :func:`~sweepmaster.runtime.planning.partition.pipeline_wrap`), each device swapping
its packs in and out from the host in turn while the activations still flow pack to pack device
to device.

:class:`PipelinedRun` drives a :class:`~sweepmaster.runtime.training.spill.SpilledJob` that way;
it is the same trainer (its microbatch passes, dropout replay, optimizers, just-in-time update,
step and evaluation bookkeeping, task chain), only placed differently. One thread per device
runs its packs in order (each over every microbatch: input-batch grouping):

* **load**: each device's first pack's shards (parameters, buffers, and on a device of one pack
  the optimizer states that have room,
  :func:`~sweepmaster.runtime.planning.partition.pipeline_state_stays`) are promoted; clipped
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
  takes the last pack's state;
* **evaluation**: the evaluation batches flow through the packs forward only;
* **unload** (the run's end): changed parameters and the optimizer state are written back to
  the host (a deferred clipped update applied first).

Bytes: with one pack per device, host -> device only the one-time load, the token ids of each
step (to the first and the last pack) and of each evaluation, and the optimizer states that do
not stay (back and forth at each update); device -> host the final write-back. Wrap-around adds
each device's swaps (:func:`~sweepmaster.runtime.scheduling.pipeline.pipeline_step` predicts
them per device). Device -> device per step: every pack boundary's activations and gradients
over the minibatch, the tied parameters' contributions and values of devices' first packs, and
under ``grad_clip`` 4 bytes per norm of a device but the first, and per coefficient.

A pipelined step recomputes every activation (Hydra), whatever the job's memory plan (its
shard tasks keep using it). Not supported yet: fused arrays (K > 1), checkpoints
(``checkpoint_every``).
Each device's thread computes with torch's intra-op thread count; split the cores between the
devices with ``torch.set_num_threads`` before the run (as the executor does between its workers).

Shape legend: B batch, b microbatch, T tokens per block, C hidden.
"""

from __future__ import annotations

import concurrent.futures
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
from sweepmaster.runtime.planning.partition import (
    pipeline_reserve_bytes,
    pipeline_resident_bytes,
    pipeline_state_stays,
)
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.pipeline import lanes
from sweepmaster.runtime.training.chain import metering
from sweepmaster.runtime.training.fused_optim import clip_coefficients
from sweepmaster.runtime.training.plain import host_rng_guard, preserved_rng
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.workload.models import causal_lm_loss
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
    own: list[torch.Tensor] = field(default_factory=list)  # installed by this pack
    lent: list[torch.Tensor] = field(default_factory=list)  # an earlier pack installs them
    #: id(tensor) -> this pack's copy of a lent tensor, while the pack is resident
    borrowed: dict[int, torch.Tensor] = field(default_factory=dict)
    #: id(parameter) -> packs sending it a gradient contribution (it owns a tied parameter)
    lenders: dict[int, list[int]] = field(default_factory=dict)


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
        job: The job, between steps (what its shard tasks kept or prefetched on a device is
            written back when the packs load); its plan's microbatch sizes give the pipeline's
            microbatch (the smallest).
        devices: D distinct devices, ``2 <= D <= P``: pack p runs on ``devices[p % D]``.
        cuts: Cut points ``(0, c1, ..., S)`` of the P packs over the job's shards.

    Attributes:
        peak_device_bytes: Per device, the highest metered bytes while the run held it.

    Raises:
        ValueError: Fewer than two packs, fewer than two devices or more than packs, devices
            not distinct, cut points that are not ``0 < ... < S``, checkpoints asked for, or
            under ``grad_clip`` a tied parameter owned by a pack that is not its device's first.
    """

    def __init__(self, job: SpilledJob, devices: Sequence[Device], cuts: Sequence[int]) -> None:
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
        if job.spec.checkpoint_every is not None and job.spec.state_dir is not None:
            raise ValueError("a pipelined job writes no checkpoints: checkpoint_every is set")
        self.job = job
        self.cuts = cuts
        self.devices = list(devices)
        self.packs = [_Pack(i, devices[i % num_devices], range(a, b))
                      for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
        self.lanes = [_Lane(d, devices[d], [self.packs[p] for p in lane])
                      for d, lane in enumerate(lanes(num_packs, num_devices))]
        holder: dict[int, int] = {}  # id(tensor) -> the pack that installs it
        for pack in self.packs:
            tensors = list({id(t): t for s in pack.shards for t in job._resident[s]}.values())
            pack.own = [t for t in tensors if id(t) not in holder]
            pack.lent = [t for t in tensors if id(t) in holder]
            for tensor in pack.lent:
                if tensor.requires_grad:
                    self.packs[holder[id(tensor)]].lenders.setdefault(id(tensor), []).append(
                        pack.index)
            holder.update((id(t), pack.index) for t in pack.own)
        if job.spec.optimizer.grad_clip is not None and any(
                p.lenders and p.index >= num_devices for p in self.packs):
            raise ValueError("under grad_clip a tied parameter must belong to a device's first "
                             "pack")
        shard = min(range(num_shards), key=lambda i: job.plan.shards[i].microbatch_size)
        self._microbatch_shard = shard
        self._state_stays = pipeline_state_stays(job.plan, cuts, num_devices)
        self._prefetch_fits = self._prefetch_room()
        self.peak_device_bytes = {device.name: 0 for device in devices}
        self._lock = threading.Lock()  # the job's byte counters and host bookkeeping
        self._loaded = False
        self._failed = threading.Event()
        self._downstream: list[queue.Queue[Any]] = []  # pack p -> p + 1: activations
        self._upstream: list[queue.Queue[Any]] = []  # pack p + 1 -> p: their gradients
        self._tied: list[queue.Queue[Any]] = []
        self._norms: dict[int, dict[int, torch.Tensor]] = {}  # pack -> id(param) -> norm
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

    def run(self) -> TrainResult:
        """Train the job to its end (or until pruned) and return its result.

        Returns:
            As ``train_spilled``'s, ``device`` naming every device (``p2p_bytes``: the job's
            device -> device bytes).

        Raises:
            torch.OutOfMemoryError: A pack did not fit its device.
            FloatingPointError: The train loss became non-finite.
        """
        job = self.job
        try:
            self.load()
            num_shards = len(job.plan.shards)
            while (task := job.next_task()) is not None:
                if task.phase == "train":
                    self.step()
                elif task.phase == "eval":
                    self.evaluate()
                else:  # deferred clipped updates: applied when their packs come in
                    job.take_tasks(num_shards - 1)
        finally:
            self.unload()
        result = job.result()
        result.peak_device_bytes = max(self.peak_device_bytes.values()) or None
        return result

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
        job._device_name = ",".join(d.name for d in self.devices)

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
                    if any(s in job._pending for s in pack.shards):
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
            return [t.data for t in pack.own] + [job._host_data.get(id(t), t.data)
                                                 for t in pack.lent]

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
            job._install(pack.own, copies[:num_own])
            pack.borrowed = {id(t): c.requires_grad_(t.requires_grad)
                             for t, c in zip(pack.lent, copies[num_own:], strict=True)}
            lane.current = pack
            kept.update(zip(parked, back, strict=True))
            for shard in pack.shards:
                if shard in job._pending:  # a deferred clipped update
                    job._apply_pending(shard, device)
                optimizer = job._optimizers[shard]
                if (states and optimizer is not None and self._state_stays[shard]
                        and shard not in job._device_state):
                    job._device_state[shard] = job._promote_state(optimizer, device)

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
            job._uninstall(pack.own, device)
            for shard in pack.shards:
                job._demote_state(shard, device)
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
            raise ValueError(f"job {job.spec.name!r}: the next tasks are not a training step")
        if not job._started:
            job._start(self.packs[0].device)
        self.load()
        swap_start = job.swap_bytes
        job._next_batch()
        first, last = self.packs[0], self.packs[-1]
        ids_first = job._to_device(first.device, job._input_ids_BT)
        ids_last = job._to_device(last.device, job._input_ids_BT)
        clip = job.spec.optimizer.grad_clip is not None
        self._barrier = threading.Barrier(len(self.lanes), action=self._clip_coefficients)
        self._run_lanes(functools.partial(self._train_lane, ids_first=ids_first,
                                          ids_last=ids_last, clip=clip))
        del ids_first, ids_last
        self._coefs = []
        self._return_tied()
        assert self._last_state is not None
        job.rng.load_state(self._last_state)
        job._task_swap += job.swap_bytes - swap_start
        job._finish_step(last.device)

    def _train_lane(self, lane: _Lane, ids_first: torch.Tensor, ids_last: torch.Tensor,
                    clip: bool) -> None:
        """One device's share of a step, on its own thread (see the module doc)."""
        job = self.job
        device = lane.device
        final = len(job.plan.shards) - 1
        microbatches = job._microbatches(self._microbatch_shard)
        weight = len(microbatches) > 1
        kept: _Kept = {}
        rngs: dict[int, JobRng] = {}
        following = [*lane.packs[1:], None]
        for pack, after in zip(lane.packs, following, strict=True):  # forwards
            # the last stays for its backward; under grad_clip only a first is updated then
            self._swap_in(lane, pack, kept,
                          states=after is None and (not clip or pack is lane.packs[0]))
            self._prefetch(lane, pack, after)
            is_first, is_last = pack.index == 0, pack.index == len(self.packs) - 1
            rng, pending = job.rng, []
            if not is_first:  # the stream as the previous pack's first microbatch left it
                pending.append(self._get(self._downstream[pack.index - 1]))
                rng = JobRng(job.rng.device_type, pending[0][2])
            rngs[pack.index] = rng
            with rng.bound(device.torch_device):
                for mb, rows in enumerate(microbatches):
                    if is_first:
                        x = ids_first[rows]
                    else:
                        got, x, _ = pending.pop() if pending else self._get(
                            self._downstream[pack.index - 1])
                        assert got == mb
                    for shard in pack.shards:
                        kept[shard, mb] = x
                        if shard == final:
                            break
                        x = job._forward_pass(shard, mb, rows, x, device, rng, pack.borrowed)
                    if is_last:
                        self._backward(pack, mb, rows, kept, ids_last[rows], rng, weight,
                                       finish=not clip and mb == len(microbatches) - 1)
                    else:
                        state = rng.get_state() if mb == 0 else None
                        sent = self._p2p(device, [x], self.packs[pack.index + 1].device)[0]
                        self._downstream[pack.index].put((mb, sent, state))
                        del sent
                    del x
            if is_last:
                self._last_state = rng.saved_state()
        earlier = [None, *lane.packs[:-1]]
        for pack, before in zip(reversed(lane.packs), reversed(earlier), strict=True):
            if pack.index < len(self.packs) - 1:  # backwards (the last pack's ran already)
                self._swap_in(lane, pack, kept, states=not clip or before is None)
                self._prefetch(lane, pack, before)
                with rngs[pack.index].bound(device.torch_device):
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
                  rng: JobRng, weight: bool, finish: bool) -> None:
        """Microbatch ``mb``'s backward through the pack's shards, last first.

        ``target``: the labels (the last pack) or the gradient of the pack's output. With
        ``finish`` (the last microbatch), each shard is updated right after its backward.
        """
        job = self.job
        device = pack.device
        for shard in reversed(pack.shards):
            x = kept.pop((shard, mb))
            grad = job._backward_pass(shard, mb, rows, x, functools.partial(_given, target),
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
                message: tuple[int, torch.Tensor, Device | None, int]
                if self._stays(pack):
                    message = (key, copy.grad, pack.device, pack.index)
                else:
                    with self._lock:
                        message = (key, job._to_host(pack.device, copy.grad), None, pack.index)
                self._tied[holder.index].put(message)
                copy.grad = None

    def _take_contributions(self, pack: _Pack, shard: int) -> None:
        """Add the other packs' contributions to the shard's tied parameters' gradients.

        Like the one-device path: the later contributions summed first, then added.
        """
        job = self.job
        owned = [p for p in job._owned[shard] if id(p) in pack.lenders]
        if not owned:
            return
        expected = sum(len(pack.lenders[id(p)]) for p in owned)
        received: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for _ in range(expected):
            key, grad, sender, index = self._get(self._tied[pack.index])
            if sender is None:  # parked on the host
                with self._lock:
                    copy = job._to_device(pack.device, grad)
            else:
                copy = self._p2p(sender, [grad], pack.device)[0]
            received.setdefault(key, []).append((index, copy))
            del grad, copy
        for param in owned:
            parts = [g for _, g in sorted(received.pop(id(param)), key=lambda item: -item[0])]
            total = parts[0]
            for part in parts[1:]:
                total = part + total
            assert param.grad is not None
            param.grad.add_(total)

    def _clip_norms(self, lane: _Lane, pack: _Pack, stays: bool) -> None:
        """``grad_clip``: a pack's norms; one that leaves parks its gradients (update deferred)."""
        job = self.job
        device = lane.device
        norms: dict[int, torch.Tensor] = {}
        with metering(device):
            self._lend(pack, pack.shards[0])
            for shard in pack.shards:
                self._take_contributions(pack, shard)
                owned = job._owned[shard]
                if owned:
                    values = torch._foreach_norm([p.grad for p in owned], 2.0)  # type: ignore
                    norms.update(zip([id(p) for p in owned], values, strict=True))
        with self._lock:
            self._norms[pack.index] = norms
            if stays:
                return
            for shard in pack.shards:
                if job._optimizers[shard] is None:
                    continue
                for param in job._owned[shard]:
                    assert param.grad is not None
                    job._host_grads[id(param)] = job._to_host(
                        device, param.grad, job._host_grads.get(id(param)))
                    param.grad = None
                job._pending[shard] = job.step

    def _update(self, pack: _Pack, shard: int, clip_coef: torch.Tensor | None = None) -> None:
        """The shard's just-in-time update; a state that does not stay goes home after it."""
        job = self.job
        if job._optimizers[shard] is None:
            return
        if self._state_stays[shard] and shard in job._device_state:
            job._update(shard, pack.device, job.step, clip_coef)
            return
        with self._lock:  # the job's swap byte counter
            job._update(shard, pack.device, job.step, clip_coef)
            if not self._state_stays[shard]:
                job._demote_state(shard, pack.device)

    def _clip_coefficients(self) -> None:
        """The global clip coefficient (``clip_grad_norm_``'s) on every device.

        Computed on the first device from every norm; the barrier's action (every device
        waits for it). Deferred updates read it from the host.
        """
        job = self.job
        first = self.devices[0]
        norms: dict[int, torch.Tensor] = {}
        for lane in self.lanes:
            keys = [k for p in lane.packs for k in self._norms[p.index]]
            values = [v for p in lane.packs for v in self._norms[p.index].values()]
            if lane.index > 0:
                values = self._p2p(lane.device, values, first)
            norms.update(zip(keys, values, strict=True))
        ordered = [norms[id(p)] for p in job.model.parameters() if id(p) in norms]
        assert job.spec.optimizer.grad_clip is not None
        with metering(first):
            total = torch.linalg.vector_norm(torch.stack(ordered), 2.0)
            coef = clip_coefficients(total.reshape(1), [job.spec.optimizer.grad_clip])[0]
        self._coefs = [coef] + [self._p2p(first, [coef], lane.device)[0]
                                for lane in self.lanes[1:]]
        if job._pending:
            with self._lock:
                job._clip_coef = job._to_host(first, coef)
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
                tensor = next(t for t in pack.own if id(t) == key)
                for index in borrowers:
                    borrower = self.packs[index]
                    if self.lanes[index % len(self.lanes)].current is borrower:
                        with torch.no_grad():
                            self._p2p(pack.device, [tensor.data], borrower.device,
                                      outs=[borrower.borrowed[key]])
                if any(self.lanes[i % len(self.lanes)].wraps for i in borrowers) and (
                        key in job._dirty):
                    with self._lock:
                        job.swap_bytes += tensor.nbytes
                        pack.device.transfer.demote([tensor.data], [job._host_data[key]])
                        job._dirty.discard(key)

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
            raise ValueError(f"job {job.spec.name!r}: the next tasks are not an evaluation")
        if not job._started:
            job._start(self.packs[0].device)
        self.load()
        assert job.eval_data is not None
        job._eval_sum = 0.0
        layers = job.stack.layers
        modes = [layer.training for layer in layers]
        for layer in layers:
            layer.eval()
        ids_first = job._to_device(self.packs[0].device, job.eval_data)
        ids_last = job._to_device(self.packs[-1].device, job.eval_data)
        torch_device = self.packs[0].device.torch_device
        try:
            with host_rng_guard(torch_device), preserved_rng(torch_device):
                self._run_lanes(functools.partial(self._eval_lane, ids_first=ids_first,
                                                  ids_last=ids_last))
        finally:
            for layer, mode in zip(layers, modes, strict=True):
                layer.train(mode)
        job._finish_eval()

    def _eval_lane(self, lane: _Lane, ids_first: torch.Tensor, ids_last: torch.Tensor) -> None:
        job = self.job
        device = lane.device
        num_rows = ids_first.shape[0]
        for pack in lane.packs:
            self._swap_in(lane, pack, {}, states=False)
            is_last = pack.index == len(self.packs) - 1
            for mb, rows in enumerate(job._eval_chunks(self._microbatch_shard, num_rows)):
                if pack.index == 0:
                    x = ids_first[rows]
                else:
                    got, x, _ = self._get(self._downstream[pack.index - 1])
                    assert got == mb
                with torch.no_grad(), metering(device):
                    for shard in pack.shards:
                        x = job._run_layers(shard, x, pack.borrowed)
                    if is_last:
                        ids = ids_last[rows]
                        tokens = ids.shape[0] * (ids.shape[1] - 1)
                        job._eval_sum += float(causal_lm_loss(x, ids).double().item()) * tokens
                        del ids
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
        spec: The job (K = 1; no checkpoints).
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
    return PipelinedRun(SpilledJob(spec, plan, callbacks), devices, packs).run()
