"""One training step of a pipelined job: microbatches through the packs, device to device.

Harmony's PP mode (Li et al., VLDB 2022, https://arxiv.org/abs/2202.01306;
:mod:`~sweepmaster.runtime.training.pipelined`) as GPipe's synchronous schedule (Huang et al.,
NeurIPS 2019): :class:`PipelinedStep` runs a step's ``2 S - 1`` shard tasks at once, one thread
per device running its packs in order, each over every microbatch (input-batch grouping). It is
a part of :class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, over two others: the
layout and its threads (:class:`~sweepmaster.runtime.training.pipeline_lanes.PipelineLanes`)
and the packs' swaps (:class:`~sweepmaster.runtime.training.pipeline_swaps.PackSwaps`):

* **order**: a device's forwards run its packs first to last, its backwards last to first (its
  last pack stays between the two; :mod:`~sweepmaster.runtime.training.pipeline_swaps` swaps
  the others in and out);
* **step**: pack p runs microbatch m's forward over its shards without grad, keeping each
  shard's input for the recompute, and sends its output to pack p + 1 device to device
  (:meth:`~sweepmaster.runtime.devices.transfer.TransferEngine.p2p`), never through the host;
  the last pack runs forward, loss and backward of each microbatch at once; backwards flow back
  pack to pack, each shard's pass recomputing its forward from its kept input with the dropout
  RNG replayed. A shard is updated right after its last microbatch's backward while resident
  (Harmony's just-in-time update). A tied parameter's gradient contribution goes to its owner's
  pack before the owner's update (p2p from a device's first pack; through the host from a pack
  that leaves before), and the updated value goes to the borrowing packs on their devices after
  the step (p2p), and to the host for those that come in later (parked without a host wait,
  :func:`~sweepmaster.runtime.training.pipeline_swaps.park`). With ``grad_clip`` every pack's
  per-parameter norms cross to the first device and the coefficient comes back once every
  device is done; each device's first pack is updated then, a pack that left already parks its
  gradients on the host and is updated when it comes back (the next step's forward, or the
  run's end). A tied parameter's norm is its owner's, taken once every contribution is added
  (counted once, as on one device); an owner updated late hands the new value to the packs
  holding copies through the host before their forward
  (:mod:`~sweepmaster.runtime.training.pipeline_swaps`);
* **hand-offs**: an activation is copied onto the next pack's device as it is sent (on a
  device of one pack, an input that came early is kept until the pack's backward anyway, or,
  in the last pack, takes the place of a gradient sent later and still held: the peak is
  reached with all of them there, however early they came); a gradient stays on its
  sender's device until a fixed point of the sender's own order: where the lane's next
  backward receives the same microbatch's gradient (the packs between took it by then), or,
  after the lane's last backward, once the previous pack took it. A device's peak therefore
  does not depend on how far the other lanes are (with microbatches of one size; the worst
  case is :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_device_bytes` either
  way), save a wrap-around device receiving a later pack's inputs while it runs an earlier
  one, which its reserve covers;
* **dropout**: pack p draws from its own copy of the job's stream, started from the state the
  stream has after pack p - 1's shards' first microbatch (sent along with it): each shard
  records its RNG tape on microbatch 0 and replays it for the others and for its recompute,
  drawing full-minibatch masks (:class:`~sweepmaster.runtime.training.replay.RandomReplay`), so
  the masks are plain training's whatever the interleaving; after the step the job's stream
  takes the last pack's state. A fused array draws every member's noise of the step at its
  start (on the host, packed masks), and each pass promotes its layers' rows of it.

Shape legend: K members (a fused array), B batch, b microbatch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.training.boundaries import metering
from sweepmaster.runtime.training.pipeline_lanes import Lane, Pack
from sweepmaster.runtime.training.pipeline_swaps import KeptInputs, Parked, PipelineParts
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.tasks import TensorKey

__all__ = ["PipelinedStep"]

#: microbatch -> a gradient a pack sent to the previous one, still on the sender's device, and
#: the event the receiver sets once it copied it
SentGrads = dict[int, tuple[torch.Tensor, threading.Event]]


class PipelinedStep:
    """A pipelined job's training steps and their deferred updates (see the module doc).

    Not thread-safe: one :meth:`run` at a time (it starts one thread per device).

    Args:
        parts: The run's job (between steps), layout and swaps.
    """

    def __init__(self, parts: PipelineParts) -> None:
        self.parts = parts
        self._norms: dict[int, dict[TensorKey, torch.Tensor]] = {}  # pack -> param -> norm
        self._coefs: list[torch.Tensor] = []  # per device
        self._last_state: torch.Tensor | None = None

    def run(self) -> None:
        """Run the job's next training step pipelined (its ``2 S - 1`` tasks at once).

        Raises:
            ValueError: The job's next task does not start a training step.
        """
        job = self.parts.job
        num_shards = len(job.plan.shards)
        tasks = job.take_tasks(2 * num_shards - 1)
        expected = [("forward", s) for s in range(num_shards - 1)] + [
            ("backward", s) for s in range(num_shards - 1, -1, -1)]
        if [(t.kind, t.shard) for t in tasks] != expected or {t.phase for t in tasks} != {
                "train"}:
            raise ValueError(f"job {job.members.name!r}: the next tasks are not a training step")
        if not job.bookkeeping.started:
            job.bookkeeping.start(self.parts.layout.packs[0].device, tasks[0])
        self.parts.swaps.arm_tied()
        self.parts.swaps.load()
        swap_start = job.boundaries.swap_bytes
        first, last = self.parts.layout.packs[0], self.parts.layout.packs[-1]
        job.start_step(first.device)
        ids_first = job.boundaries.to_device(first.device, job.members.step_ids())
        targets = job.members.step_targets()  # the loss's labels: the ids without a loss mask
        ids_last = job.boundaries.to_device(
            last.device, job.members.step_ids() if targets is None else targets)
        clip = job.members.clips
        self._last_state = None
        self.parts.layout.run(functools.partial(self._train_lane, ids_first=ids_first,
                                          ids_last=ids_last, clip=clip),
                        barrier_action=self._clip_coefficients)
        del ids_first, ids_last
        self._coefs = []
        self._return_tied()
        if self._last_state is not None:
            job.members.set_dropout_state(self._last_state)
        job.bookkeeping.finish_step(last.device, job.boundaries.swap_bytes - swap_start)
        self.parts.swaps.end_tasks(tasks[-1])

    def _train_lane(self, lane: Lane, ids_first: torch.Tensor, ids_last: torch.Tensor,
                    clip: bool) -> None:
        """One device's share of a step, on its own thread (see the module doc)."""
        job = self.parts.job
        device = lane.device
        final = len(job.plan.shards) - 1
        microbatches = job.boundaries.microbatches(self.parts.layout.microbatch_shard)
        weight = len(microbatches) > 1
        kept: KeptInputs = {}
        handed: SentGrads = {}  # the gradients this lane's last backward sent upstream
        rngs: dict[int, JobRng | None] = {}
        following = [*lane.packs[1:], None]
        for pack, after in zip(lane.packs, following, strict=True):  # forwards
            self.parts.swaps.await_tied(pack)
            # the last stays for its backward; under grad_clip only a first is updated then
            self.parts.swaps.swap_in(lane, pack, kept,
                          states=after is None and (not clip or pack is lane.packs[0]))
            self.parts.swaps.prefetch(lane, pack, after)
            is_first, is_last = pack.index == 0, pack.index == len(self.parts.layout.packs) - 1
            state, pending = None, []
            if not is_first:  # the stream as the previous pack's first microbatch left it
                pending.append(self.parts.layout.get(self.parts.layout.downstream[pack.index - 1]))
                state = pending[0][2]
            rng = rngs[pack.index] = job.members.dropout_stream(state)
            with _bound(rng, device):
                for mb, rows in enumerate(microbatches):
                    if is_first:
                        x = job.boundaries.rows_of(ids_first, rows)
                    else:
                        got, x, _ = pending.pop() if pending else self.parts.layout.get(
                            self.parts.layout.downstream[pack.index - 1])
                        assert got == mb
                    for shard in pack.shards:
                        kept[shard, mb] = x
                        if shard == final:
                            break
                        x = job.compute.forward_pass(shard, mb, rows, x, device, rng,
                                                     pack.borrowed)
                    if is_last:
                        self._backward(pack, mb, rows, kept,
                                       job.boundaries.rows_of(ids_last, rows), rng,
                                       weight, handed,
                                       finish=not clip and mb == len(microbatches) - 1)
                    else:
                        state = rng.get_state() if mb == 0 and rng is not None else None
                        following_device = self.parts.layout.packs[pack.index + 1].device
                        sent = self.parts.layout.p2p(device, [x], following_device)[0]
                        self.parts.layout.downstream[pack.index].put((mb, sent, state))
                        del sent
                    del x
            if is_last and rng is not None:
                self._last_state = rng.saved_state()
        earlier = [None, *lane.packs[:-1]]
        for pack, before in zip(reversed(lane.packs), reversed(earlier), strict=True):
            # backwards (the last pack's ran already)
            if pack.index < len(self.parts.layout.packs) - 1:
                self.parts.swaps.swap_in(lane, pack, kept, states=not clip or before is None)
                self.parts.swaps.prefetch(lane, pack, before)
                waiting, handed = handed, {}
                with _bound(rngs[pack.index], device):
                    for mb, rows in enumerate(microbatches):
                        got, grad, sender, taken = self.parts.layout.get(
                            self.parts.layout.upstream[pack.index])
                        assert got == mb
                        received = self.parts.layout.p2p(sender, [grad], device)[0]
                        del grad
                        taken.set()
                        if waiting:  # the packs between took this microbatch's gradient
                            self._let_go(waiting, mb)  # the lane sent before: it goes now
                        self._backward(pack, mb, rows, kept, received, rngs[pack.index],
                                       weight, handed,
                                       finish=not clip and mb == len(microbatches) - 1)
                        del received
                assert not waiting
            if before is None:  # the lane's last backward: its gradients go once taken
                for mb in list(handed):
                    self._let_go(handed, mb)
            if clip:
                self._clip_norms(lane, pack, stays=before is None)
        if clip:
            self.parts.layout.wait_barrier()
            coef = self._coefs[lane.index]
            with metering(device):
                for shard in lane.packs[0].shards:
                    self._update(lane.packs[0], shard, coef)

    def _backward(self, pack: Pack, mb: int, rows: slice, kept: KeptInputs, target: torch.Tensor,
                  rng: JobRng | None, weight: bool, sent: SentGrads, finish: bool) -> None:
        """Microbatch ``mb``'s backward through the pack's shards, last first.

        ``target``: the labels (the last pack) or the gradient of the pack's output. With
        ``finish`` (the last microbatch), each shard is updated right after its backward. The
        gradient of the pack's input goes to the previous pack, and stays in ``sent`` (on this
        device) until :meth:`_let_go` drops it.
        """
        job = self.parts.job
        device = pack.device
        for shard in reversed(pack.shards):
            x = kept.pop((shard, mb))
            assert isinstance(x, torch.Tensor)  # its pack is resident: so are its inputs
            grad = job.compute.backward_pass(shard, mb, rows, x, functools.partial(_given, target),
                                     device, weight, rng, pack.borrowed)
            del x
            target = grad  # type: ignore[assignment]
            if finish:
                with metering(device):
                    self._lend(pack, shard)
                    self._take_contributions(pack, shard)
                    self._update(pack, shard)
        if pack.index > 0:
            taken = threading.Event()
            self.parts.layout.upstream[pack.index - 1].put((mb, target, device, taken))
            sent[mb] = (target, taken)

    def _let_go(self, sent: SentGrads, mb: int) -> None:
        """Drop microbatch ``mb``'s gradient from ``sent`` once the previous pack copied it.

        The sender frees it here, at a point of its own order, never whenever the receiver
        happens to copy it: a device's live bytes do not depend on how far the other lanes
        are. Where the lane's next backward has just received the same microbatch's gradient,
        the packs between took it already: no wait.
        """
        grad, taken = sent.pop(mb)
        self.parts.layout.wait(taken)
        del grad

    def _lend(self, pack: Pack, shard: int) -> None:
        """Send the pack's gradient contributions to tied tensors other packs hold.

        Once, after the backward of the pack's first shard (its last backward of the step):
        p2p from a device's first pack, through the host from a pack that leaves before the
        owner's update.
        """
        if shard != pack.shards[0]:
            return
        for key, copy in pack.borrowed.items():
            if copy.requires_grad:
                assert copy.grad is not None
                holder = next(p for p in self.parts.layout.packs if key in p.lenders)
                message: tuple[TensorKey, torch.Tensor | Parked, Device | None, int]
                if self.parts.layout.stays(pack):
                    message = (key, copy.grad, pack.device, pack.index)
                else:  # parked on the host: its owner's pack copies it in, no host wait
                    message = (key, self.parts.swaps.send_home(pack.device, copy.grad), None,
                               pack.index)
                self.parts.layout.tied[holder.index].put(message)
                copy.grad = None

    def _take_contributions(self, pack: Pack, shard: int) -> None:
        """Add the other packs' contributions to the shard's tied parameters' gradients.

        Like the one-device path: the later contributions summed first, then added.
        """
        job = self.parts.job
        owned = [k for k in job.members.owned_keys(shard) if k in pack.lenders]
        if not owned:
            return
        expected = sum(len(pack.lenders[k]) for k in owned)
        received: dict[TensorKey, list[tuple[int, torch.Tensor]]] = {}
        for _ in range(expected):
            key, grad, sender, index = self.parts.layout.get(self.parts.layout.tied[pack.index])
            if sender is None:  # parked on the host
                copy = self.parts.swaps.bring_back(pack.device, grad)
            else:
                copy = self.parts.layout.p2p(sender, [grad], pack.device)[0]
            received.setdefault(key, []).append((index, copy))
            del grad, copy
        for key in owned:
            parts = [g for _, g in sorted(received.pop(key), key=lambda item: -item[0])]
            total = parts[0]
            for part in parts[1:]:
                total = part + total
            grad = job.store.installed(key).grad
            assert grad is not None
            grad.add_(total)

    def _clip_norms(self, lane: Lane, pack: Pack, stays: bool) -> None:
        """``grad_clip``: a pack's norms; one that leaves parks its gradients (update deferred)."""
        job = self.parts.job
        device = lane.device
        norms: dict[TensorKey, torch.Tensor] = {}
        with metering(device):
            self._lend(pack, pack.shards[0])
            for shard in pack.shards:
                self._take_contributions(pack, shard)
                norms.update(job.compute.grad_norms(shard))
        with self.parts.layout.lock:
            self._norms[pack.index] = norms
            if stays:
                return
            for shard in pack.shards:
                job.compute.park_grads(shard, device)

    def _update(self, pack: Pack, shard: int, clip_coef: torch.Tensor | None = None) -> None:
        """The shard's just-in-time update; a state that does not stay goes home after it."""
        job = self.parts.job
        if not job.members.updates(shard):
            return
        if self.parts.swaps.state_stays(shard) and job.store.state_on_device(shard):
            job.compute.update_shard(shard, pack.device, clip_coef)
            return
        with self.parts.layout.lock:  # the job's swap byte counter
            job.compute.update_shard(shard, pack.device, clip_coef)
            if not self.parts.swaps.state_stays(shard):
                job.store.demote_state(shard, pack.device)

    def _clip_coefficients(self) -> None:
        """The global clip coefficient (``clip_grad_norm_``'s; per member ``(K,)``) everywhere.

        Computed on the first device from every norm; the barrier's action (every device
        waits for it). Deferred updates read it from the host.
        """
        job = self.parts.job
        first = self.parts.layout.devices[0]
        norms: dict[TensorKey, torch.Tensor] = {}
        for lane in self.parts.layout.lanes:
            keys = [k for p in lane.packs for k in self._norms[p.index]]
            values = [v for p in lane.packs for v in self._norms[p.index].values()]
            if lane.index > 0:
                values = self.parts.layout.p2p(lane.device, values, first)
            norms.update(zip(keys, values, strict=True))
        with metering(first):
            coef = job.members.clip_coefficient(norms, first)
        self._coefs = [coef] + [self.parts.layout.p2p(first, [coef], lane.device)[0]
                                for lane in self.parts.layout.lanes[1:]]
        if any(job.compute.deferred(s) for s in range(len(job.plan.shards))):
            with self.parts.layout.lock:
                job.compute.defer_clip(coef, first)
        self._norms.clear()

    def _return_tied(self) -> None:
        """Give the updated tied parameters to the packs that hold copies of them.

        p2p to a borrowing pack on its device; to the host (its next promotion reads it there)
        when a borrowing pack is not, or will leave.
        """
        job, layout = self.parts.job, self.parts.layout
        for pack in layout.packs:
            for key, borrowers in pack.lenders.items():
                if layout.lane_of(pack).current is not pack:
                    continue  # written back when it left
                tensor = job.store.installed(key)
                for index in borrowers:
                    borrower = layout.packs[index]
                    if layout.lane_of(borrower).current is borrower:
                        with torch.no_grad():
                            layout.p2p(pack.device, [tensor.detach()], borrower.device,
                                       outs=[borrower.borrowed[key]])
                if any(layout.lane_of(layout.packs[i]).wraps for i in borrowers):
                    with layout.lock:
                        job.store.write_back_tensor(key, pack.device)

    def update(self) -> None:
        """Take the job's next ``update`` tasks (``S - 1``, after a step, under ``grad_clip``).

        The deferred clipped updates they stand for are applied as their packs come in, or
        when the packs go home (here, when the job's bookkeeping reads the host copies: a
        member leaves or checkpoints).

        Raises:
            ValueError: The job's next tasks are not ``update`` tasks.
        """
        job = self.parts.job
        tasks = job.take_tasks(len(job.plan.shards) - 1)
        if any(t.phase != "update" for t in tasks):
            raise ValueError(f"job {job.members.name!r}: the next tasks are not deferred updates")
        self.parts.swaps.end_tasks(tasks[-1])


def _given(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _bound(rng: JobRng | None, device: Device) -> contextlib.AbstractContextManager[Any]:
    """``rng`` bound as the device's generator (nothing for a job without a stream)."""
    return contextlib.nullcontext() if rng is None else rng.bound(device.torch_device)

