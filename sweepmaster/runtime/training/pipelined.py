"""Pipelined training of one spilled job over several devices (Harmony's PP mode).

Harmony (Li et al., VLDB 2022, https://arxiv.org/abs/2202.01306) trains a model larger than a
device on several devices at once: the job's shards are split into contiguous **packs**, one per
device (balanced-time packing, :func:`~sweepmaster.runtime.planning.partition.pipeline_packs`),
each pack stays resident on its device for the whole run, and the minibatch's M microbatches
flow through the packs as a pipeline, GPipe-style (Huang et al., NeurIPS 2019): all forwards,
then all backwards, flushed at the end of every step (synchronous SGD, the numbers of
``train_plain``).

:class:`PipelinedRun` drives a :class:`~sweepmaster.runtime.training.spill.SpilledJob` that way;
it is the same trainer (its microbatch passes, dropout replay, optimizers, just-in-time update,
step and evaluation bookkeeping, task chain), only placed differently:

* **load**: each pack's shards (parameters, buffers, optimizer state) are promoted once to its
  device and stay there (an optimizer state only where the pack has room for it,
  :func:`~sweepmaster.runtime.planning.partition.pipeline_state_stays`, as the one-device path
  keeps a kept shard's state; elsewhere it is promoted for each update and demoted after);
  clipped updates the job's shard tasks deferred are applied there; a tied parameter another
  pack holds (GPT-2's ``wte`` in the head's pack) gets a copy of its own on that pack's device;
* **step**: one device thread per pack. Pack p runs microbatch m's forward over its shards
  without grad, keeping each shard's input on the device for the recompute, and sends its
  output to pack p + 1 device to device (:meth:`~sweepmaster.runtime.devices.transfer.
  TransferEngine.p2p`), never through the host; the last pack runs forward, loss and backward
  of each microbatch at once; backwards flow back pack to pack, each shard's pass recomputing
  its forward from its kept input with the dropout RNG replayed. A shard is updated right after
  its last microbatch's backward while resident (Harmony's just-in-time update); a tied
  parameter's gradient contribution goes p2p to its owner's pack before the owner's update, and
  the updated value comes back after the step. With ``grad_clip`` every pack waits for the
  global norm (its per-parameter norms cross to the first pack, the coefficient comes back),
  then updates;
* **dropout**: pack p draws from its own copy of the job's stream, started from the state the
  stream has after pack p - 1's shards' first microbatch (sent along with it): each shard
  records its RNG tape on microbatch 0 and replays it for the others and for its recompute,
  drawing full-minibatch masks (:class:`~sweepmaster.runtime.training.replay.RandomReplay`), so
  the masks are plain training's whatever the interleaving; after the step the job's stream
  takes the last pack's state;
* **evaluation**: the evaluation batches flow through the packs forward only;
* **unload** (the run's end): changed parameters and the optimizer state are written back to
  the host.

Bytes: host -> device only the one-time load, the token ids of each step (to the first and the
last pack) and of each evaluation, and the optimizer states that do not stay (back and forth at
each update); device -> host the final write-back; device -> device per step: every pack
boundary's activations and gradients over the minibatch, the tied parameters' contributions and
values, and under ``grad_clip`` 4 bytes per norm and coefficient
(:func:`~sweepmaster.runtime.scheduling.pipeline.pipeline_step` predicts all but these).

A pipelined step recomputes every activation (Hydra), whatever the job's memory plan (its
shard tasks keep using it). Not supported yet: fused arrays (K > 1), checkpoints
(``checkpoint_every``).
Each pack thread computes with torch's intra-op thread count; split the cores between the packs
with ``torch.set_num_threads`` before the run (as the executor does between its workers).

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
from sweepmaster.runtime.devices.transfer import settle_all
from sweepmaster.runtime.execution.events import TrainCallbacks
from sweepmaster.runtime.planning.partition import pipeline_state_stays
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.chain import metering
from sweepmaster.runtime.training.fused_optim import clip_coefficients
from sweepmaster.runtime.training.plain import host_rng_guard, preserved_rng
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.workload.models import causal_lm_loss
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["PipelinedRun", "train_pipelined"]

#: Seconds between checks of a failed pack while a pack waits for its neighbour.
_POLL_S = 0.05


class _Aborted(Exception):
    """Another pack failed; this one stops waiting."""


@dataclass
class _Pack:
    """One pack: its shards on its device, and what it holds there."""

    index: int
    device: Device
    shards: range
    installed: list[torch.Tensor] = field(default_factory=list)  # their data is on the device
    #: id(tensor) -> this pack's copy of a tensor an earlier pack installed (tied)
    borrowed: dict[int, torch.Tensor] = field(default_factory=dict)
    #: id(parameter) -> packs sending it a gradient contribution (it owns a tied parameter)
    lenders: dict[int, list[int]] = field(default_factory=dict)


class PipelinedRun:
    """One spilled job trained over several devices, its packs resident (see the module doc).

    Not thread-safe: one :meth:`run` at a time; it starts one thread per pack.

    Args:
        job: The job, between steps (what its shard tasks kept or prefetched on a device is
            written back when the packs load); its plan's microbatch sizes give the pipeline's
            microbatch (the smallest).
        devices: One device per pack, in pack order, all distinct.
        cuts: Cut points ``(0, c1, ..., S)`` of the packs over the job's shards.

    Attributes:
        peak_device_bytes: Per device, the highest metered bytes while the run held it.

    Raises:
        ValueError: Fewer than two packs, devices not one per pack or not distinct, cut points
            that are not ``0 < ... < S``, or checkpoints asked for.
    """

    def __init__(self, job: SpilledJob, devices: Sequence[Device], cuts: Sequence[int]) -> None:
        num_shards = len(job.plan.shards)
        cuts = tuple(cuts)
        if len(cuts) < 3 or cuts[0] != 0 or cuts[-1] != num_shards or any(
                a >= b for a, b in zip(cuts, cuts[1:], strict=False)):
            raise ValueError(f"pack cut points {cuts} are not 0 < ... < {num_shards} with at "
                             "least two packs")
        if len(devices) != len(cuts) - 1 or len({d.name for d in devices}) != len(devices):
            raise ValueError(f"a pipeline of {len(cuts) - 1} packs needs as many distinct "
                             f"devices, got {[d.name for d in devices]}")
        if job.spec.checkpoint_every is not None and job.spec.state_dir is not None:
            raise ValueError("a pipelined job writes no checkpoints: checkpoint_every is set")
        self.job = job
        self.cuts = cuts
        self.packs = [_Pack(i, device, range(a, b)) for i, (device, a, b)
                      in enumerate(zip(devices, cuts, cuts[1:], strict=False))]
        shard = min(range(num_shards), key=lambda i: job.plan.shards[i].microbatch_size)
        self._microbatch_shard = shard
        self._state_stays = pipeline_state_stays(job.plan, cuts)
        self.peak_device_bytes = {device.name: 0 for device in devices}
        self._lock = threading.Lock()
        self._loaded = False
        self._failed = threading.Event()
        self._downstream: list[queue.Queue[Any]] = []  # pack p -> p + 1: activations
        self._upstream: list[queue.Queue[Any]] = []  # pack p + 1 -> p: their gradients
        self._tied: list[queue.Queue[Any]] = []
        self._norms: dict[int, dict[int, torch.Tensor]] = {}
        self._coefs: list[torch.Tensor] = []
        self._barrier = threading.Barrier(1)
        self._last_state: torch.Tensor | None = None

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
                else:  # a deferred clipped update: a pipelined step defers none
                    job.take_tasks(num_shards - 1)
        finally:
            self.unload()
        result = job.result()
        result.peak_device_bytes = max(self.peak_device_bytes.values()) or None
        return result

    def load(self) -> None:
        """Promote each pack's shards to its device once (a tied tensor: a copy per pack)."""
        if self._loaded:
            return
        job = self.job
        job.release()  # a shard kept or prefetched by its shard tasks: the packs replace it
        holder: dict[int, int] = {}  # id(tensor) -> the pack that installed it
        for pack in self.packs:
            device = pack.device
            meter = device.meter
            if meter is not None:
                meter.reset_peak()
            tensors = list({id(t): t for s in pack.shards for t in job._resident[s]}.values())
            pack.installed = [t for t in tensors if id(t) not in holder]
            lent = [t for t in tensors if id(t) in holder]
            hosts = [t.data for t in pack.installed] + [job._host_data[id(t)] for t in lent]
            copies = device.transfer.promote(hosts)
            job.swap_bytes += sum(copy.nbytes for copy in copies)
            job.num_promotes += len(pack.shards)
            job._install(pack.installed, copies[: len(pack.installed)])
            for tensor, copy in zip(lent, copies[len(pack.installed):], strict=True):
                pack.borrowed[id(tensor)] = copy.requires_grad_(tensor.requires_grad)
                if tensor.requires_grad:
                    self.packs[holder[id(tensor)]].lenders.setdefault(id(tensor), []).append(
                        pack.index)
            holder.update((id(t), pack.index) for t in pack.installed)
            for shard in pack.shards:
                if shard in job._pending:  # a clipped update deferred by a shard task step
                    job._apply_pending(shard, device)
                optimizer = job._optimizers[shard]
                if optimizer is not None and self._state_stays[shard]:
                    job._device_state[shard] = job._promote_state(optimizer, device)
        job._device_name = ",".join(pack.device.name for pack in self.packs)
        self._loaded = True

    def unload(self) -> None:
        """Write changed parameters and the optimizer state back to the host; free the packs."""
        if not self._loaded:
            return
        self._loaded = False
        job = self.job
        for pack in self.packs:
            job._uninstall(pack.installed, pack.device)
            for shard in pack.shards:
                job._demote_state(shard, pack.device)
            job.num_demotes += len(pack.shards)
            pack.installed = []
            pack.borrowed.clear()
            pack.lenders.clear()
            meter = pack.device.meter
            if meter is not None:
                name = pack.device.name
                self.peak_device_bytes[name] = max(self.peak_device_bytes[name],
                                                   meter.peak_bytes)
        job.peak_device_bytes = max(job.peak_device_bytes, *self.peak_device_bytes.values())
        settle_all()

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
        self._barrier = threading.Barrier(len(self.packs), action=self._clip_coefficients)
        self._run_packs(functools.partial(self._train_pack, ids_first=ids_first,
                                          ids_last=ids_last, clip=clip))
        del ids_first, ids_last
        self._coefs = []
        self._return_tied()
        assert self._last_state is not None
        job.rng.load_state(self._last_state)
        job._task_swap += job.swap_bytes - swap_start
        job._finish_step(last.device)

    def _train_pack(self, pack: _Pack, ids_first: torch.Tensor, ids_last: torch.Tensor,
                    clip: bool) -> None:
        """One pack's share of a step, on its own thread (see the module doc)."""
        job = self.job
        device = pack.device
        is_first, is_last = pack.index == 0, pack.index == len(self.packs) - 1
        final = len(job.plan.shards) - 1
        microbatches = job._microbatches(self._microbatch_shard)
        weight = len(microbatches) > 1
        kept: dict[tuple[int, int], torch.Tensor] = {}  # (shard, mb) -> its input
        rng, pending = job.rng, []
        if not is_first:  # the stream as the previous pack's first microbatch left it
            pending.append(self._get(self._downstream[pack.index - 1]))
            rng = JobRng(job.rng.device_type, pending[0][2])
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
            if not is_last:
                for mb, rows in enumerate(microbatches):
                    got, grad, sender = self._get(self._upstream[pack.index])
                    assert got == mb
                    received = self._p2p(sender, [grad], device)[0]
                    del grad
                    self._backward(pack, mb, rows, kept, received, rng, weight,
                                   finish=not clip and mb == len(microbatches) - 1)
                    del received
        if is_last:
            self._last_state = rng.saved_state()
        if clip:
            self._clipped_update(pack)

    def _backward(self, pack: _Pack, mb: int, rows: slice,
                  kept: dict[tuple[int, int], torch.Tensor], target: torch.Tensor, rng: JobRng,
                  weight: bool, finish: bool) -> None:
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

    def _lend(self, pack: _Pack, shard: int) -> None:
        """Send the pack's gradient contributions to tied tensors other packs hold.

        Once, after the backward of the pack's first shard (its last backward of the step).
        """
        if shard != pack.shards[0]:
            return
        for key, copy in pack.borrowed.items():
            if copy.requires_grad:
                assert copy.grad is not None
                holder = next(p for p in self.packs if key in p.lenders)
                self._tied[holder.index].put((key, copy.grad, pack.device, pack.index))
                copy.grad = None

    def _take_contributions(self, pack: _Pack, shard: int) -> None:
        """Add the other packs' contributions to the shard's tied parameters' gradients.

        Like the one-device path: the later contributions summed first, then added.
        """
        owned = [p for p in self.job._owned[shard] if id(p) in pack.lenders]
        if not owned:
            return
        expected = sum(len(pack.lenders[id(p)]) for p in owned)
        received: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for _ in range(expected):
            key, grad, sender, index = self._get(self._tied[pack.index])
            received.setdefault(key, []).append(
                (index, self._p2p(sender, [grad], pack.device)[0]))
            del grad
        for param in owned:
            parts = [g for _, g in sorted(received.pop(id(param)), key=lambda item: -item[0])]
            total = parts[0]
            for part in parts[1:]:
                total = part + total
            assert param.grad is not None
            param.grad.add_(total)

    def _clipped_update(self, pack: _Pack) -> None:
        """``grad_clip``: norms, wait for the global coefficient, update every shard."""
        job = self.job
        device = pack.device
        norms: dict[int, torch.Tensor] = {}
        with metering(device):
            self._lend(pack, pack.shards[0])
            for shard in pack.shards:
                self._take_contributions(pack, shard)
                owned = job._owned[shard]
                if owned:
                    values = torch._foreach_norm([p.grad for p in owned], 2.0)  # type: ignore
                    norms.update(zip([id(p) for p in owned], values, strict=True))
        self._norms[pack.index] = norms
        self._wait_barrier()
        coef = self._coefs[pack.index]
        with metering(device):
            for shard in pack.shards:
                self._update(pack, shard, coef)

    def _update(self, pack: _Pack, shard: int, clip_coef: torch.Tensor | None = None) -> None:
        """The shard's just-in-time update; a state that does not stay goes home after it."""
        job = self.job
        if job._optimizers[shard] is None:
            return
        if self._state_stays[shard]:
            job._update(shard, pack.device, job.step, clip_coef)
            return
        with self._lock:  # the job's swap byte counter
            job._update(shard, pack.device, job.step, clip_coef)
            job._demote_state(shard, pack.device)

    def _clip_coefficients(self) -> None:
        """The global clip coefficient (``clip_grad_norm_``'s) on every pack's device.

        Computed on the first pack's device from every norm; the barrier's action (every pack
        waits for it).
        """
        job = self.job
        first = self.packs[0].device
        norms = dict(self._norms[0])
        for pack in self.packs[1:]:
            keys = list(self._norms[pack.index])
            values = [self._norms[pack.index][k] for k in keys]
            norms.update(zip(keys, self._p2p(pack.device, values, first), strict=True))
        ordered = [norms[id(p)] for p in job.model.parameters() if id(p) in norms]
        assert job.spec.optimizer.grad_clip is not None
        with metering(first):
            total = torch.linalg.vector_norm(torch.stack(ordered), 2.0)
            coef = clip_coefficients(total.reshape(1), [job.spec.optimizer.grad_clip])[0]
        self._coefs = [coef] + [self._p2p(first, [coef], pack.device)[0]
                                for pack in self.packs[1:]]
        self._norms.clear()

    def _return_tied(self) -> None:
        """Copy the updated tied parameters to the packs that hold copies of them."""
        for pack in self.packs:
            for key, lenders in pack.lenders.items():
                tensor = next(t for t in pack.installed if id(t) == key)
                for index in lenders:
                    borrower = self.packs[index]
                    with torch.no_grad():
                        self._p2p(pack.device, [tensor.data], borrower.device,
                                  outs=[borrower.borrowed[key]])

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
                self._run_packs(functools.partial(self._eval_pack, ids_first=ids_first,
                                                  ids_last=ids_last))
        finally:
            for layer, mode in zip(layers, modes, strict=True):
                layer.train(mode)
        job._finish_eval()

    def _eval_pack(self, pack: _Pack, ids_first: torch.Tensor, ids_last: torch.Tensor) -> None:
        job = self.job
        device = pack.device
        is_last = pack.index == len(self.packs) - 1
        num_rows = ids_first.shape[0]
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

    def _run_packs(self, work: Callable[[_Pack], None]) -> None:
        """Run ``work`` for every pack, one thread each; the first failure is raised."""
        num_packs = len(self.packs)
        self._failed.clear()
        self._downstream = [queue.Queue() for _ in range(num_packs - 1)]
        self._upstream = [queue.Queue() for _ in range(num_packs - 1)]
        self._tied = [queue.Queue() for _ in range(num_packs)]

        def guarded(pack: _Pack) -> None:
            try:
                work(pack)
            except BaseException:
                self._failed.set()
                self._barrier.abort()
                raise

        with concurrent.futures.ThreadPoolExecutor(num_packs, "pack") as pool:
            futures = [pool.submit(guarded, pack) for pack in self.packs]
            concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        first = next((e for e in errors if not isinstance(
            e, (_Aborted, threading.BrokenBarrierError))), errors[0] if errors else None)
        self._downstream, self._upstream, self._tied = [], [], []
        if first is not None:
            raise first

    def _get(self, source: queue.Queue[Any]) -> Any:
        """The next message from a neighbour pack (raises :class:`_Aborted` if a pack failed)."""
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
        >>> result = train_pipelined(spec, devices, plan, shape.packs[-1])  # doctest: +SKIP

    Args:
        spec: The job (K = 1; no checkpoints).
        devices: One device per pack, in pack order.
        plan: Its plan for one of the devices (``plan_job``): shards and microbatch sizes.
        packs: Cut points ``(0, c1, ..., S)`` of the packs over the plan's shards
            (:func:`~sweepmaster.planning.pipeline_shape`'s ``packs``).
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
