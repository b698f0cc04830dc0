"""The one trainer of spilled jobs: small parts, driven task by task.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device as a chain of **shard tasks** (:mod:`~sweepmaster.runtime.training.tasks`).
:class:`ShardTrainer` runs them (:meth:`ShardTrainer.run`: promote, compute, keep or demote,
then the bookkeeping the task ends) for any job, whatever it trains: what differs between one
member (:class:`~sweepmaster.runtime.training.spill.SpilledJob`, the module run directly) and K
stacked members (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`, ``vmap``)
is only its members part. The trainer holds its parts, each with a narrow interface, and gives
each what it needs as constructor arguments:

* ``members`` (:class:`~sweepmaster.runtime.training.shard_members.ShardMembers`): the
  members' tensors, layers, losses, optimizers, dropout, records and training states;
* ``boundaries`` (:class:`~sweepmaster.runtime.training.boundaries.HostBoundaries`):
  microbatches, boundary activations and gradients in host buffers of the whole minibatch,
  every copy counted in ``swap_bytes``;
* ``passes`` (:class:`~sweepmaster.runtime.training.planned.PlannedPasses`): with a memory plan
  (mu-TWO), the planned forward and backward passes of a shard, and the recorded losses;
* ``tasks`` (:class:`~sweepmaster.runtime.training.tasks.TaskChain`): the task sequence a
  scheduler reads, with the plan's estimated seconds and peaks;
* ``store`` (:class:`~sweepmaster.runtime.training.shard_store.ShardStore`): the flat shards'
  promote and demote (the mover), Hydra's prefetch, the shard kept resident;
* ``compute`` (:class:`~sweepmaster.runtime.training.compute.ShardCompute`): the per-shard
  algorithm (microbatch loops, tied gradients, just-in-time update, ``grad_clip``), and the
  per-shard interface a pipeline drives;
* ``bookkeeping`` (:class:`~sweepmaster.runtime.training.bookkeeping.TrialBookkeeping`): the
  members' records (events, evaluations, checkpoints, results).

A pipelined run (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP)
drives the same parts (:class:`~sweepmaster.runtime.training.pipeline_job.PipelinedJob`).

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.bookkeeping import TrialBookkeeping
from sweepmaster.runtime.training.boundaries import HostBoundaries
from sweepmaster.runtime.training.compute import ShardCompute
from sweepmaster.runtime.training.planned import PlannedPasses
from sweepmaster.runtime.training.shard_members import ShardMembers
from sweepmaster.runtime.training.shard_store import ShardStore
from sweepmaster.runtime.training.tasks import (
    ShardTask,
    StepRange,
    TaskChain,
    TaskPhase,
    after_step_phase,
)
from sweepmaster.workload.spec import TrainResult

__all__ = ["ShardTrainer"]


class ShardTrainer:
    """A spilled job: its parts, and its shard tasks run one at a time (any thread).

    Not thread-safe: one task at a time; a pipelined run calls the parts from one thread per
    device under the boundaries' ``counter_lock``.

    Args:
        plan: The job plan (shards, microbatch sizes, seconds, peaks); its device's type
            (``cpu`` or ``cuda``) is where the tasks run.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation.
        members: The members it trains (one module, or K stacked members); they are given the
            trainer (``bind``) once its parts exist.

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).

    Attributes:
        members: The members part.
        boundaries: The host side of the job's shard boundaries and its counted copies.
        passes: The job's planned passes (mu-TWO) and its recorded losses.
        tasks: The job's task sequence.
        store: Where the job's shards live: promote, demote, prefetch, keep.
        compute: The per-shard algorithm and the per-shard interface a pipeline drives.
        bookkeeping: The members' records: start, steps, evaluations, checkpoints, results.
    """

    def __init__(self, plan: JobPlan, batch_size: int, memory_plan: MemoryPlan | None,
                 members: ShardMembers) -> None:
        self.plan = plan
        self.memory_plan = memory_plan
        self.members = members
        self.boundaries = HostBoundaries(plan, batch_size, row_dim=members.row_dim,
                                         labels=members.labels, targets=members.step_targets)
        self.passes = PlannedPasses(plan, self.boundaries, memory_plan,
                                    layer_calls=members.layer_calls, pass_mode=members.pass_mode,
                                    lm_loss=members.lm_loss)
        self.tasks = TaskChain(plan, memory_plan, self._step_range)
        self.store = ShardStore(plan, memory_plan, tensors=members, boundaries=self.boundaries,
                                passes=self.passes, tasks=self.tasks,
                                prefetch_within_step=members.prefetches_within_step)
        self.compute = ShardCompute(plan, memory_plan, members=members,
                                    boundaries=self.boundaries, passes=self.passes,
                                    store=self.store)
        self.bookkeeping = TrialBookkeeping(members, tasks=self.tasks, store=self.store,
                                            boundaries=self.boundaries, compute=self.compute)
        self.store.fresh_state |= members.fresh_shards
        self.bookkeeping.saved_step = members.step
        members.bind(self)

    # ------------------------------------------------------------------ the task sequence

    def next_task(self) -> ShardTask | None:
        """The next task to run, or ``None`` when the job is finished or its members stopped."""
        return None if self.members.stopped else self.tasks.peek(0)

    def peek_task(self, ahead: int = 1) -> ShardTask | None:
        """The task ``ahead`` positions after the next one (assuming nothing ends early)."""
        return self.tasks.peek(ahead)

    def take_tasks(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the chain at once, to be run together.

        A pipelined step (:mod:`~sweepmaster.runtime.training.pipelined`) runs a whole step's
        tasks over several devices at once.

        Raises:
            ValueError: The job has fewer tasks left, or it stopped.
        """
        if self.members.stopped:
            raise ValueError(f"the job has fewer than {num_tasks} tasks left")
        return self.tasks.take(num_tasks)

    def planned_peak_bytes(self, task: ShardTask) -> int:
        """Planned device peak of ``task`` (bytes): the one estimate prefetch decisions read.

        :meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes`, with the
        shard's optimizer state when it stayed on the device.
        """
        return self.tasks.planned_peak_bytes(task, self.store.state_on_device(task.shard))

    @property
    def remaining_seconds(self) -> float:
        """Estimated seconds of the job's remaining training steps (the Sharded-LRTF key).

        The members' steps from ``step`` to ``num_steps`` (a fused array's: until its last
        member ends), each of the memory plan's step seconds, or the job plan's without one.
        """
        return (self.members.num_steps - self.members.step) * self.tasks.step_s

    def prefetch(self, task: ShardTask | None, device: Device, *,
                 headroom_bytes: int | None = None) -> None:
        """Start promoting ``task``'s shard to ``device`` in the background (Hydra).

        See :meth:`~sweepmaster.runtime.training.shard_store.ShardStore.prefetch`: ``task``
        after the job's next task, or the next task itself within ``headroom_bytes``.
        """
        self.store.prefetch(task, self.next_task(), device, deferred=self.compute.deferred,
                            headroom_bytes=headroom_bytes)

    def rechain(self) -> None:
        """Make the task sequence again from the next task on (what follows has changed).

        Call it between tasks with nothing prefetched.
        """
        assert not self.store.prefetching, "prefetched copies of the old sequence's tasks"
        self.tasks.rechain()

    def _step_range(self) -> StepRange:
        """The members' steps from their ``step`` on, and what follows each step.

        What follows a step is :func:`after_step_phase`'s; before the first step: only an
        evaluation.
        """
        members = self.members
        first, name = members.step, members.name
        defers = members.clips and len(self.plan.shards) > 1

        def after(step: int) -> TaskPhase | None:
            return after_step_phase(evaluates=members.evaluates_after(step), defers=defers,
                                    settles=step != first and members.settles_after(step))

        self.passes.job_id = name
        return StepRange(name, first, members.num_steps, after)

    # ------------------------------------------------------------------ running tasks

    def start_step(self, device: Device) -> None:
        """Start a training step: its seconds, its minibatch (plain's order), its dropout."""
        self.bookkeeping.start_step()
        self.members.start_step(device)

    def run(self, task: ShardTask, device: Device, *, keep: bool = False) -> None:
        """Run the next task on ``device``: promote, compute (and update), demote.

        With ``keep``, a shard whose next task is of the same shard stays resident on
        ``device`` instead of being demoted, until the store's ``evict`` (the executor passes
        it always: its residency cache evicts the shard when another task needs the room):
        that task then promotes nothing, and what changed is written back only when the shard
        is evicted (its next task runs on another device, another job runs here, a checkpoint,
        a member leaving, the result). Pass it only when the job's next task will likely run
        on ``device`` and the shard fits beside what else is there (its next task's planned
        peak counts it anyway).

        After an exception the job holds no device memory (its state is back on the host) but
        cannot go on: the task that failed was partly done (a fused array: every member fails).

        Raises:
            ValueError: ``task`` is not the next task.
            torch.OutOfMemoryError: The device ran out of memory.
            FloatingPointError: The train loss of a step is not finite (one member's: a fused
                array's member fails alone, nothing is raised).
        """
        if task != self.next_task():
            raise ValueError(f"job {self.members.name!r}: task {task} is not the next task")
        self.tasks.pop()
        bookkeeping, store, compute = self.bookkeeping, self.store, self.compute
        if not bookkeeping.started:
            bookkeeping.start(device, task)
            if self.members.stopped:  # every member of a fused array had finished already
                return
        if task.step == self.members.step and self.tasks.step_due(task):
            self.start_step(device)
        meter = device.meter
        if meter is not None:
            meter.reset_peak()
        swap_start = self.boundaries.swap_bytes
        try:
            with self.members.task_mode(device):
                try:
                    store.promote(task, device)
                    with self.members.compute_mode(device):
                        if compute.deferred(task.shard):  # an ``update`` task does only this
                            compute.apply_deferred(task.shard, device)
                        if task.phase == "eval":
                            compute.eval_shard(task.shard, device)
                        elif task.phase == "train" and task.kind == "forward":
                            compute.forward_shard(task.shard, device)
                        elif task.phase == "train":
                            compute.backward_shard(task.shard, device)
                except BaseException:
                    store.demote(task.shard, device)
                    raise
                following = self.peek_task(0)
                if keep and following is not None and following.shard == task.shard:
                    if following.kind != "backward" or not store.state_stays(task.shard):
                        store.demote_state(task.shard, device)  # home before the next task
                    store.keep(task.shard, device)
                else:
                    store.demote(task.shard, device)
        except BaseException:
            store.release()
            raise
        if meter is not None:
            bookkeeping.peak_device_bytes = max(bookkeeping.peak_device_bytes, meter.peak_bytes)
        if task.phase == "train":
            bookkeeping.task_swap += self.boundaries.swap_bytes - swap_start
            if task.kind == "backward" and task.shard == 0:
                bookkeeping.end_step(device)
        if task.phase == "eval" and task.shard == len(self.plan.shards) - 1:
            bookkeeping.finish_eval()
        bookkeeping.end_tasks(task, device)

    def settle(self, device: Device) -> None:
        """Hand on what has nothing left to train once :meth:`next_task` is ``None``.

        A fused array's members that resumed at their last step leave with their results.
        """
        if self.next_task() is None:
            self.members.settle(device)

    def result(self) -> TrainResult:
        """The result of a job of one member, once :meth:`next_task` is ``None``.

        See ``train_plain``; its device and counters are the job's.

        Raises:
            OSError: Its weights could not be saved to ``checkpoint_dir``.
        """
        assert self.next_task() is None, "the job still has tasks"
        assert len(self.members.runs) == 1, "a fused array's members end on their own"
        self.bookkeeping.finish_run(0)
        result = self.members.runs[0].result
        assert result is not None
        return result

    def run_to_end(self, device: Device, *, prefetch: bool = True) -> None:
        """Run every task in order on ``device``, the job alone there, then :meth:`settle`.

        Args:
            device: Where the tasks run.
            prefetch: Double-buffer: promote the next shard while the current one computes.

        Raises:
            torch.OutOfMemoryError: A task did not fit the device.
            FloatingPointError: See :meth:`run`.
        """
        while (task := self.next_task()) is not None:
            if prefetch:
                self.prefetch(self.peek_task(), device)
            self.run(task, device)
        self.settle(device)

    def run_step(self, device: Device, *, keep: bool = False) -> None:
        """Run the tasks of the job's next optimizer step on ``device``, in order.

        The tasks before the step's last (``backward`` of shard 0) and that task: a step's
        forward and backward tasks, after whatever the sequence has before them (an
        evaluation). With ``keep``, a shard whose next task is of the same shard stays resident
        as the executor keeps it (:meth:`run`; one stacked or whole shard, S = 1, stays on
        ``device`` between steps until the store's ``evict`` or ``release``). Nothing is
        prefetched: the fusion measurement (:func:`~sweepmaster.runtime.planning.\
fusion_degree.measure_fusion`) times these steps of jobs that fit their device.

        Raises:
            ValueError: The job has no step left (or it stopped).
            torch.OutOfMemoryError: A task did not fit the device.
            FloatingPointError: See :meth:`run`.
        """
        while (task := self.next_task()) is not None:
            self.run(task, device, keep=keep)
            if task.phase == "train" and task.kind == "backward" and task.shard == 0:
                return
        raise ValueError(f"job {self.members.name!r} has no step left")
