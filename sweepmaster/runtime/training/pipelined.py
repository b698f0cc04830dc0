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
:class:`~sweepmaster.runtime.training.pipeline_job.PipelinedJob` (and nothing else): one member
(:class:`~sweepmaster.runtime.training.spill.SpilledJob`) or a fused array of K stacked members
(:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`, ``vmap`` over members, its
boundaries ``(K, B, ...)``, its clip norms and coefficients per member ``(K,)``). It is the same
trainer (its microbatch passes, dropout, optimizers, just-in-time update, step and evaluation
bookkeeping, task chain), only placed differently. One thread per device runs its packs in order
(each over every microbatch: input-batch grouping). :class:`PipelinedRun` holds its parts, each
a small class over the job and the parts it names in its constructor (the training steps and
the evaluations take the job, layout and swaps as one
:class:`~sweepmaster.runtime.training.pipeline_swaps.PipelineParts`):

* ``layout``, :class:`~sweepmaster.runtime.training.pipeline_lanes.PipelineLanes`: the packs
  and lanes (each device's packs), the device threads, the messages between neighbour packs
  and the counted device -> device copies;
* ``swaps``, :class:`~sweepmaster.runtime.training.pipeline_swaps.PackSwaps` (over the
  layout): load, wrap-around swaps (with prefetch), unload: every host <-> device copy of the
  packs, parked tensors without a host wait;
* ``training``, :class:`~sweepmaster.runtime.training.pipeline_step.PipelinedStep` (over both):
  a training step's microbatches through the packs, tied gradients, ``grad_clip``, the
  just-in-time update and the dropout streams;
* ``evaluation``, :class:`PipelinedEval` (over both): the evaluation batches flow through the
  packs forward only, in the microbatches of a step, each chunk's token ids copied in as the
  first pack (its input) and the last (its labels) take it.
  A block for a device's first pack waits on its sender until that device takes it; under
  wrap-around a block for a later pack of its device is parked on the host (that device is
  busy with its earlier packs, which wait for the sender's blocks), and comes in as its pack
  takes it. What a device holds of the evaluation does not grow with its size (the chunk its
  pack computes, and the one it sends until a device's first pack takes it): its peak stays
  within :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_device_bytes` without
  using the wrap-around reserve.

Bytes: with one pack per device, host -> device only the one-time load, the token ids of each
step (to the first and the last pack) and of each evaluation, the optimizer states that do
not stay (back and forth at each update), and a fused array's dropout masks (each pass's
microbatch rows); device -> host the final write-back. Wrap-around adds
each device's swaps (:func:`~sweepmaster.runtime.scheduling.pipeline.pipeline_step` predicts
them per device), and in an evaluation the packs after each device's first coming in (without
optimizer states) and the parked blocks: a boundary into a device's later pack over the
evaluation set goes device -> host and host -> device (evaluations are not in the cost model).
Device -> device per step: every pack boundary's activations and gradients over the minibatch,
the tied parameters' contributions and values of devices' first packs, and under
``grad_clip`` 4 bytes per norm of a device but the first, and per coefficient; per evaluation,
the boundaries into devices' first packs over the evaluation set.

A pipelined step recomputes every activation (Hydra), whatever the job's memory plan: the plan
is the shard tasks' (they keep using it between pipelined steps), it is not refused, and its
swaps never run in a pipelined step (``activation_swap_bytes`` does not grow). What the pipeline
moves and peaks at is what the job plan's Hydra recompute gives, which is what
:func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_shape` plans from. (A memory plan's
decisions are per shard task, one shard's passes on a device at a time; a pack holds every
shard's passes of every microbatch between its forward and its backward, which the plan does
not budget.) Checkpoints (``checkpoint_every``) are the job's own, written at
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

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import metering
from sweepmaster.runtime.training.pipeline_job import PipelinedJob
from sweepmaster.runtime.training.pipeline_lanes import Lane, Pack, PipelineLanes
from sweepmaster.runtime.training.pipeline_step import PipelinedStep
from sweepmaster.runtime.training.pipeline_swaps import PackSwaps, Parked, PipelineParts
from sweepmaster.runtime.training.plain import host_rng_guard, preserved_rng
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["PipelinedEval", "PipelinedRun", "train_pipelined"]


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
        job: The job.
        layout: Its packs over the devices and the threads that run them.
        swaps: Its packs on and off the devices.
        training: Its pipelined training steps.
        evaluation: Its pipelined evaluations.

    Raises:
        ValueError: Fewer than two packs, fewer than two devices or more than packs, devices
            not distinct, cut points that are not ``0 < ... < S``, or a job plan that updates
            on the host (a pack keeps its shards and their state on its device).
    """

    def __init__(self, job: PipelinedJob, devices: Sequence[Device], cuts: Sequence[int]) -> None:
        if job.plan.update_on == "host":
            raise ValueError("a pipelined job updates on the device: its plan's update_on is "
                             "'host'")
        self.job = job
        self.layout = PipelineLanes(job, devices, cuts)
        self.swaps = PackSwaps(job, self.layout)
        parts = PipelineParts(job, self.layout, self.swaps)
        self.training = PipelinedStep(parts)
        self.evaluation = PipelinedEval(parts)

    @property
    def cuts(self) -> tuple[int, ...]:
        """The cut points ``(0, c1, ..., S)`` of the packs."""
        return self.layout.cuts

    @property
    def devices(self) -> list[Device]:
        """The D devices (pack p on ``devices[p % D]``)."""
        return self.layout.devices

    @property
    def packs(self) -> list[Pack]:
        """The P packs, in order."""
        return self.layout.packs

    @property
    def lanes(self) -> list[Lane]:
        """Each device's packs (:attr:`Lane.current`: the one resident there)."""
        return self.layout.lanes

    @property
    def peak_device_bytes(self) -> dict[str, int]:
        """Per device, the highest metered bytes while the run held it."""
        return self.swaps.peak_device_bytes

    def load(self) -> None:
        """Promote each device's first pack (see :meth:`PackSwaps.load`)."""
        self.swaps.load()

    def unload(self) -> None:
        """Write the packs back to the host and free the devices (see :meth:`PackSwaps.unload`)."""
        self.swaps.unload()

    def step(self) -> None:
        """Run the job's next training step pipelined (see :meth:`PipelinedStep.run`).

        Raises:
            ValueError: The job's next task does not start a training step.
        """
        self.training.run()

    def update(self) -> None:
        """Take the job's next deferred ``update`` tasks (see :meth:`PipelinedStep.update`).

        Raises:
            ValueError: The job's next tasks are not ``update`` tasks.
        """
        self.training.update()

    def evaluate(self) -> None:
        """Run the job's next evaluation through the packs (see :meth:`PipelinedEval.run`).

        Raises:
            ValueError: The job's next task does not start an evaluation.
        """
        self.evaluation.run()

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


@dataclass(frozen=True)
class PipelinedEval:
    """A pipelined job's evaluations: its evaluation set forward through the packs.

    Holds no state of its own; one :meth:`run` at a time (it starts one thread per device).

    Attributes:
        parts: The run's job (between steps), layout and swaps.
    """

    parts: PipelineParts

    def run(self) -> None:
        """Run the job's next evaluation (its ``S`` tasks at once) through the packs.

        Raises:
            ValueError: The job's next task does not start an evaluation.
        """
        job = self.parts.job
        num_shards = len(job.plan.shards)
        tasks = job.take_tasks(num_shards)
        if [(t.phase, t.shard) for t in tasks] != [("eval", s) for s in range(num_shards)]:
            raise ValueError(f"job {job.members.name!r}: the next tasks are not an evaluation")
        if not job.bookkeeping.started:
            job.bookkeeping.start(self.parts.layout.packs[0].device, tasks[0])
        self.parts.swaps.arm_tied()
        self.parts.swaps.load()
        with job.compute.evaluating():
            torch_device = self.parts.layout.packs[0].device.torch_device
            with host_rng_guard(torch_device), preserved_rng(torch_device):
                self.parts.layout.run(functools.partial(
                    self._eval_lane, ids=job.members.eval_ids(),
                    targets=job.members.eval_targets()))
        job.bookkeeping.finish_eval()
        self.parts.swaps.end_tasks(tasks[-1])

    def _eval_lane(self, lane: Lane, ids: torch.Tensor, targets: torch.Tensor | None) -> None:
        """One device's share of an evaluation, on its own thread (see :meth:`_send_block`).

        ``ids``: the evaluation blocks on the host; each chunk's rows go to the first pack (its
        input) and to the last (its labels: ``targets``, the ids when ``None``) as the pack
        takes the chunk.
        """
        job = self.parts.job
        device = lane.device
        num_rows = ids.shape[job.boundaries.row_dim]
        for pack in lane.packs:
            self.parts.swaps.await_tied(pack)
            self.parts.swaps.swap_in(lane, pack, {}, states=False)
            is_last = pack.index == len(self.parts.layout.packs) - 1
            chunks = job.boundaries.eval_chunks(self.parts.layout.microbatch_shard, num_rows)
            for mb, rows in enumerate(chunks):
                if pack.index == 0:
                    x = job.boundaries.to_device(device, job.boundaries.rows_of(ids, rows))
                else:
                    got, sent, sender, taken = self.parts.layout.get(
                        self.parts.layout.downstream[pack.index - 1])
                    assert got == mb
                    if sender is not None:  # copied here, as this device takes it
                        x = self.parts.layout.p2p(sender, [sent], device)[0]
                        taken.set()
                    else:  # parked on the host: it comes in as this pack takes it
                        x = self.parts.swaps.bring_back(device, sent)
                    del sent
                with torch.no_grad(), metering(device):
                    for shard in pack.shards:
                        x = job.compute.eval_pass(shard, x, device, pack.borrowed)
                    if is_last:
                        labels = job.boundaries.to_device(device, job.boundaries.rows_of(
                            ids if targets is None else targets, rows))
                        job.compute.add_eval_loss(x, labels, device)
                        del labels
                if not is_last:
                    self._send_block(pack, mb, x)
                del x

    def _send_block(self, pack: Pack, mb: int, x: torch.Tensor) -> None:
        """Hand an evaluation block's activations ``x`` to the next pack.

        To a device's first pack, the block waits on this device until that device takes it
        (and copies it then): one block in flight, whatever the evaluation's size, and both
        devices' bytes change at points of their own order. A later pack of its device takes
        its blocks only once the device's earlier packs are done, and this device cannot wait
        for that (the earlier packs wait for this one's blocks): the block is parked on the
        host at once (counted in ``swap_bytes``; the host does not wait for the copy) and
        comes in as that pack takes it. Neither device holds more of the evaluation as it grows.
        """
        following = self.parts.layout.packs[pack.index + 1]
        if self.parts.layout.stays(following):
            taken = threading.Event()
            self.parts.layout.downstream[pack.index].put((mb, x, pack.device, taken))
            self.parts.layout.wait(taken)
        else:
            parked: Parked = self.parts.swaps.send_home(pack.device, x)
            self.parts.layout.downstream[pack.index].put((mb, parked, None, None))


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
            :func:`~sweepmaster.sweep.plan.pipeline_shape`).
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
