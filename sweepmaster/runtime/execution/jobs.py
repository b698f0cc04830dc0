"""What the executor runs: a job's chain of shard tasks for the policy, and the work behind it.

The SHARP policy (:mod:`~sweepmaster.runtime.scheduling.scheduler`) sees a job as a chain of
:class:`~sweepmaster.runtime.scheduling.chains.TaskSpec` s, one minibatch after another
(:func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`). An :class:`ExecutorJob` couples
that chain with the real work:

* :class:`SpilledRun`: every unfused job, a
  :class:`~sweepmaster.runtime.training.spill.SpilledJob` of S >= 1 shards; each policy task is
  its next training shard task (forward of shard ``i``, or backward + just-in-time update of
  shard ``i``). Evaluation passes and deferred updates are not in the policy's chain: they run on
  the same device right before the training task that follows them (and after the last one), so
  the chain stays ``2S - 1`` tasks per minibatch as in Hydra. A job that fits its device is one
  shard (S = 1): one ``"step"`` task per optimizer step, its weights and optimizer state kept
  resident on the device between its steps while the residency cache lets them, so the policy
  interleaves it with other jobs step by step (Hydra's SHARP) at no copy cost.

A job that runs out of device memory before its first step ends may be re-planned by the
executor and restarted from its spec as a new job of the same name (:attr:`ExecutorJob.restarts`);
its :class:`~sweepmaster.runtime.execution.attempts.AttemptCallbacks` carry over, so its
receiver hears each event once.

Fused arrays and the measurement of fusion degrees are jobs too
(:mod:`~sweepmaster.runtime.execution.fused_jobs`). Every job reports each real task it runs as a
:class:`~sweepmaster.runtime.events.TaskRecord`.
A job is not thread-safe: the executor holds :attr:`ExecutorJob.lock` around every call.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.events import TaskRecord, TrainCallbacks
from sweepmaster.runtime.execution.attempts import AttemptCallbacks
from sweepmaster.runtime.execution.policy_chain import shard_chain
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.pipeline_plan import pipeline_shape
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.scheduling.pipeline import PipelineDecision
from sweepmaster.runtime.training.pipelined import PipelinedRun
from sweepmaster.runtime.training.shard_trainer import ShardTrainer
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.runtime.training.tasks import ShardTask
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["ExecutorJob", "SpilledRun", "TaskSink"]

#: Receives every task a job runs (the device timeline).
TaskSink = Callable[[TaskRecord], None]


class ExecutorJob(ABC):
    """One job of an executor: its policy chain, its work, and its result.

    Args:
        job_id: The job's unique name in its executor.
        spec: What to train.
        plan: The job's plan for the smallest device it may run on (bytes, seconds).
        callbacks: Progress receiver (called on the worker thread running the task).
        on_task: Receives a :class:`TaskRecord` per task run.

    Attributes:
        num_tasks: Tasks of its chain.
        lock: Held by the executor around every call to the job.
        callbacks: Its receiver, as
            :class:`~sweepmaster.runtime.execution.attempts.AttemptCallbacks` (they count its
            steps).
        num_replans: Times the executor re-planned it so far (this is attempt
            ``num_replans + 1``).
    """

    #: Whether the executor may re-plan and restart the job when it runs out of device memory
    #: before its first step ends (:attr:`first_step_pending`): a fresh build from its spec
    #: then repeats exactly what the failed attempt did.
    restarts: ClassVar[bool] = False

    def __init__(self, job_id: str, spec: TrainSpec, plan: JobPlan,
                 callbacks: TrainCallbacks | None, on_task: TaskSink | None) -> None:
        self.job_id = job_id
        self.spec = spec
        self.plan = plan
        self.callbacks = AttemptCallbacks.of(callbacks)
        self.on_task = on_task
        self.lock = threading.Lock()
        self.num_tasks = self.chain().num_tasks
        self.num_replans = 0

    @property
    def receivers(self) -> list[AttemptCallbacks]:
        """Its trials' progress receivers: :attr:`callbacks` (a fused array: its members')."""
        return [self.callbacks]

    @property
    def first_step_pending(self) -> bool:
        """Whether no optimizer step of the job has ended yet (in this run, if it resumed).

        Until then nothing of the trial changed that a fresh build from its spec does not
        reproduce: jit updates of a spilled job's later shards during its first backward, say.
        """
        return all(receiver.num_steps == 0 for receiver in self.receivers)

    def replanned(self, plan: JobPlan, memory_plan: MemoryPlan | None,
                  pipeline_devices: int = 0) -> ExecutorJob:
        """A fresh job of the same name, spec and receivers, spilled on ``plan`` (a re-plan).

        Built from the spec (seeded) as this job was, so it trains exactly as a job first
        submitted with ``plan`` would; for a job that :attr:`restarts`. ``pipeline_devices``
        as for :class:`SpilledRun`.

        Raises:
            ValueError: ``plan`` is for another model, or ``memory_plan`` for another plan.
        """
        return SpilledRun(self.job_id, self.spec, plan, self.callbacks, self.on_task,
                          memory_plan=memory_plan, pipeline_devices=pipeline_devices)

    @property
    def planned_peak_bytes(self) -> int:
        """The device peak its plan allows it (bytes): plain training's estimate here."""
        return self.plan.plain_bytes

    @abstractmethod
    def chain(self) -> JobSpec:
        """The job's chain of tasks for the policy (estimated seconds and bytes from the plan)."""

    @abstractmethod
    def run(self, task: TaskSpec, device: Device, *, prefetch: bool, prefetch_next: bool) -> None:
        """Do the work of the policy's ``task`` on ``device``.

        Args:
            task: The task the policy handed out (the job's next one).
            device: Where it runs.
            prefetch: The job may prefetch its own shards onto ``device`` (False when another
                job's shard is being prefetched there: the device's spare memory is taken).
            prefetch_next: The device will likely run this job's next task too: prefetch it.

        Raises:
            torch.OutOfMemoryError: The task did not fit the device.
            FloatingPointError: The train loss became non-finite.
            Exception: Anything a callback raised.
        """

    @property
    @abstractmethod
    def done(self) -> bool:
        """Whether the job has no work left (finished, or pruned by a callback)."""

    @abstractmethod
    def result(self) -> Any:
        """What the job's future resolves with once :attr:`done` (may save a checkpoint).

        A trial's :class:`~sweepmaster.workload.spec.TrainResult`; ``None`` from a job that
        resolves its futures itself (a fused array, one future per member).
        """

    def peak_bytes(self, task: TaskSpec) -> int:
        """Planned device peak of ``task`` (bytes): what it leaves free for a prefetch."""
        return self.plan.plain_bytes

    def grown_chain(self) -> JobSpec | None:
        """Its chain, when the job has grown past the one the policy has (else ``None``).

        A spilled fused array a member joined trains for more steps; the executor gives the
        policy the longer chain (:meth:`~sweepmaster.runtime.scheduling.scheduler.Policy.\
extend_job`), so those steps are shard tasks the policy interleaves with other jobs'.
        """
        return None

    def prefetch(self, device: Device, headroom_bytes: int) -> None:  # noqa: B027
        """Promote the job's next shard to ``device`` ahead of time, if it fits ``headroom_bytes``.

        Called while another job's task runs on ``device`` (Hydra's double buffering across
        jobs); a job that does not spill has nothing to prefetch.
        """

    def discard_prefetch(self, device: Device) -> None:  # noqa: B027
        """Free whatever :meth:`prefetch` put on ``device``."""

    def resident_shard(self, device: Device) -> int | None:
        """The shard the job keeps resident on ``device`` between its tasks, if any."""
        return None

    def resident_bytes(self, device: Device) -> int:
        """Planned bytes the job keeps on ``device`` between its tasks (0: nothing)."""
        return 0

    def evict(self, device: Device) -> None:  # noqa: B027
        """Write back and free the shard the job keeps resident on ``device``, if any."""

    def release(self) -> None:  # noqa: B027
        """Free whatever the job still holds on any device (it failed or left its executor).

        Called once, when the job ends; the job runs no task after it.
        """

    def ended(self) -> None:  # noqa: B027
        """Hear that the job has ended (after :meth:`release`), with no executor lock held.

        Called once, on a worker thread (or the thread that cancelled it), so that what it
        calls may call the executor (a fused array's vacancy hook).
        """

    def _record(self, device: Device, shard: int, kind: str, start_s: float, end_s: float,
                swap_bytes: int, step: int, p2p_bytes: int = 0) -> None:
        if self.on_task is None:
            return
        meter = device.meter
        self.on_task(TaskRecord(device.name, self.job_id, shard, kind, start_s, end_s, step,
                                swap_bytes=swap_bytes, p2p_bytes=p2p_bytes,
                                peak_bytes=None if meter is None else meter.peak_bytes))


class SpilledRun(ExecutorJob):
    """A job of S >= 1 shards: one policy task per training shard task (module doc).

    Drives any :class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer` (:attr:`job`): a
    :class:`~sweepmaster.runtime.training.spill.SpilledJob` here, a spilled fused array in
    :class:`~sweepmaster.runtime.execution.fused_jobs.SpilledFusedRun`.

    Args:
        job_id: The job's unique name in its executor.
        spec: What to train.
        plan: Its plan (one shard when the job fits), made for the smallest device it may run
            on.
        callbacks: Progress receiver.
        on_task: Receives a :class:`TaskRecord` per shard task run.
        memory_plan: Keep / swap / recompute of its activations (mu-TWO); ``None``: Hydra's
            recompute of every activation.
        pipeline_devices: Devices a step of it may be pipelined over (Harmony PP, see
            :meth:`run_pipelined`); 0 or 1: never.

    Raises:
        ValueError: The spec is invalid (see ``train_plain``), or the memory plan is for
            another partition.
    """

    _pipe: PipelinedRun | None = None  # its packs on devices, between pipelined steps
    _pipeline_devices = 0
    _step = 0  # the step of its last task
    restarts = True

    def __init__(self, job_id: str, spec: TrainSpec, plan: JobPlan,
                 callbacks: TrainCallbacks | None, on_task: TaskSink | None, *,
                 memory_plan: MemoryPlan | None = None, pipeline_devices: int = 0) -> None:
        callbacks = AttemptCallbacks.of(callbacks)
        # Built first: a job resumed from a checkpoint has a shorter chain.
        self.job: ShardTrainer = SpilledJob(dataclasses.replace(spec, name=job_id), plan,
                                          callbacks, memory_plan=memory_plan)
        self._pipeline_devices = pipeline_devices
        super().__init__(job_id, spec, plan, callbacks, on_task)

    def chain(self) -> JobSpec:
        """Hydra's chain: forward of shards ``0..S-2``, then backward of ``S-1..0``, per step.

        Only the steps left: a job resumed from a checkpoint after step k has
        ``total_steps - k`` (at least 1, whose tasks find nothing left to do when k is the last).
        """
        spec, job = self.spec, self.job
        assert isinstance(job, SpilledJob)
        eval_data = job.members.eval_data
        chain = shard_chain(self.job_id, self.plan, max(1, spec.total_steps - job.members.step),
                            first_step=job.members.step,
                            eval_rows=0 if eval_data is None else len(eval_data),
                            eval_every=spec.eval_every, memory_plan=job.memory_plan)
        return self._with_pipeline(chain)

    def _with_pipeline(self, chain: JobSpec, num_members: int = 1) -> JobSpec:
        """``chain`` with its pipeline shape, when its steps may be pipelined (Harmony PP).

        Only over two devices or more, when every step is Hydra's ``2S - 1`` tasks (a
        memory plan's steps are too), and when the job updates on the device (a pack keeps
        its shards and their state there). ``num_members``: K of a fused array's stacked plan.
        """
        steps_alike = len(chain.step_tasks) == 2 * len(self.plan.shards) - 1
        if self._pipeline_devices < 2 or not steps_alike or self.plan.update_on == "host":
            return chain
        shape = pipeline_shape(self.plan, self._pipeline_devices, num_members=num_members)
        return dataclasses.replace(chain, pipeline=shape)

    def run(self, task: TaskSpec, device: Device, *, prefetch: bool, prefetch_next: bool) -> None:
        """Run the job's next training shard task (and the evaluation tasks before it).

        A shard whose next task is of the same shard stays resident on ``device`` (the
        residency cache's rule, :meth:`SpilledJob.run`); the executor evicts it
        (:meth:`evict`) when another task needs the room.
        """
        last = task.index == self.num_tasks - 1
        self._end_pipeline()
        while (real := self.job.next_task()) is not None:
            is_training = real.phase == "train"
            if is_training and real.shard != task.shard:
                raise AssertionError(f"policy task {task} does not match the job's task {real}")
            self._run_real(real, device, prefetch and (prefetch_next or not is_training),
                           keep=True)
            if is_training:
                break
        if last:  # the last one: final evaluation, deferred updates (not a grown array's steps)
            while (real := self.job.next_task()) is not None and real.phase != "train":
                self._run_real(real, device, prefetch, keep=True)
            if real is not None:  # a member joined: the shard kept for the end goes home
                self.job.store.evict()
        self.job.settle(device)

    def run_pipelined(self, decision: PipelineDecision, devices: Sequence[Device]) -> None:
        """Run the policy's pipelined step over ``devices`` (pack p on ``devices[p % D]``).

        Harmony PP, one pack per device or wrap-around. The job's packs stay on the devices
        after the step (each device's first), for a next decision with the same
        packs on the same devices (``decision.load`` False); any other task of the job writes
        them back first. Evaluation before the step (and after the job's last step) runs
        pipelined too.

        Raises:
            ValueError: The decision is not the job's next step.
        """
        job = self.job
        start, step = time.time(), job.members.step
        before = [_copied_bytes(device) for device in devices]
        try:
            pipe = self._pipe
            names = [d.name for d in devices]
            if pipe is None or pipe.cuts != decision.cuts or [
                    d.name for d in pipe.devices] != names:
                self._end_pipeline(record=False)  # within this call's records
                pipe = self._pipe = PipelinedRun(job, devices, decision.cuts)
            self._run_phases(pipe, train=False)
            pipe.step()
            if decision.first_index + decision.num_tasks >= self.num_tasks or job.members.stopped:
                self._run_phases(pipe, train=True)
                self._end_pipeline(record=False)
        finally:  # one record per device: its bytes (the devices run nothing else meanwhile)
            end = time.time()
            for i, device in enumerate(devices):
                (host, p2p), (host_before, p2p_before) = _copied_bytes(device), before[i]
                self._record(device, decision.cuts[i], "pipeline", start, end,
                             host - host_before, step, p2p - p2p_before)

    def _run_phases(self, pipe: PipelinedRun, *, train: bool) -> None:
        """Run the evaluations and deferred updates due before the next training step.

        ``train``: and every training step left too (after a job's last pipelined step).
        """
        while (real := self.job.next_task()) is not None:
            if real.phase == "eval":
                pipe.evaluate()
            elif real.phase == "update":
                pipe.update()
            elif train:
                pipe.step()
            else:
                return

    def _end_pipeline(self, *, record: bool = True) -> None:
        """Write the job's packs back to the host, if it holds any.

        ``record``: a ``"demote"`` task record per pack's device, with its bytes.
        """
        if self._pipe is None:
            return
        pipe, self._pipe = self._pipe, None
        start = time.time()
        before = [_copied_bytes(device) for device in pipe.devices]
        try:
            pipe.unload()
        finally:
            if record:
                end = time.time()
                for lane, (host_before, _) in zip(pipe.lanes, before, strict=True):
                    first = lane.packs[0].shards[0]
                    self._record(lane.device, first, "demote", start, end,
                                 _copied_bytes(lane.device)[0] - host_before,
                                 self.job.members.step)

    def resident_shard(self, device: Device) -> int | None:
        """The shard kept on ``device``: its pack's first while the job's packs are loaded."""
        pipe = self._pipe
        if pipe is not None:
            lane = next((lane for lane in pipe.lanes if lane.device is device), None)
            if lane is not None and lane.current is not None:
                return lane.current.shards[0]
        return self.job.store.resident_shard(device)

    def resident_bytes(self, device: Device) -> int:  # noqa: D102
        return self.job.store.resident_bytes(device)

    def evict(self, device: Device) -> None:
        """Write back the shard kept on ``device``: a ``"demote"`` task record of its bytes."""
        shard = self.job.store.resident_shard(device)
        if shard is None:
            return
        start, swap = time.time(), self.job.boundaries.swap_bytes
        try:
            self.job.store.evict(device)
        finally:  # the timeline accounts for every byte the job moves
            self._record(device, shard, "demote", start, time.time(),
                         self.job.boundaries.swap_bytes - swap, self._step)

    @property
    def pipeline_devices(self) -> list[Device]:
        """The devices holding the job's packs between its pipelined steps (none: empty)."""
        return [] if self._pipe is None else list(self._pipe.devices)

    def _run_real(self, real: ShardTask, device: Device, prefetch_next: bool, *,
                  keep: bool) -> None:
        if prefetch_next:
            self.job.prefetch(self.job.peek_task(), device)
        start, swap = time.time(), self.job.boundaries.swap_bytes
        self._step = real.step
        try:
            self.job.run(real, device, keep=keep)
        finally:  # a failed task held the device too
            kind = real.kind if real.phase == "train" else real.phase
            self._record(device, real.shard, kind, start, time.time(),
                         self.job.boundaries.swap_bytes - swap, real.step)

    @property
    def done(self) -> bool:  # noqa: D102
        return self.job.next_task() is None

    def result(self) -> TrainResult | None:  # noqa: D102
        assert isinstance(self.job, SpilledJob)
        self._end_pipeline()
        return self.job.result()

    def peak_bytes(self, task: TaskSpec) -> int:
        """Planned peak of what ``task`` runs (bytes), from the plans the job really runs.

        The highest :meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes` of
        the real tasks :meth:`run` will run for ``task``: the evaluation tasks before it, the
        training task (its memory plan's peak when it has one), and after the last training
        task the final evaluation and deferred updates.
        """
        last = task.index == self.num_tasks - 1
        peak, ahead = 0, 0
        while (real := self.job.peek_task(ahead)) is not None:
            peak = max(peak, self.job.planned_peak_bytes(real))
            if real.phase == "train" and not last:
                break
            ahead += 1
        return peak

    @property
    def planned_peak_bytes(self) -> int:
        """The peak of its memory plan, else of its partition (bytes, prefetch included)."""
        memory = self.job.memory_plan
        return self.plan.peak_bytes if memory is None else memory.peak_bytes

    def prefetch(self, device: Device, headroom_bytes: int) -> None:
        """Promote the next shard to ``device`` in the background if it fits ``headroom_bytes``."""
        self.job.prefetch(self.job.next_task(), device, headroom_bytes=headroom_bytes)

    def discard_prefetch(self, device: Device) -> None:
        """Free what the job holds on ``device``: its packs (all written back), prefetches."""
        if device in self.pipeline_devices:
            self._end_pipeline()
        self.job.store.discard_prefetch(device)

    def release(self) -> None:  # noqa: D102
        self._end_pipeline()
        self.job.store.release()


def _copied_bytes(device: Device) -> tuple[int, int]:
    """Bytes ``device`` copied so far: host <-> device (promote + demote), and to other devices."""
    stats = device.transfers
    return stats.promote_bytes + stats.demote_bytes, stats.p2p_out_bytes
