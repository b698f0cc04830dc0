"""The task model of a spilled job: shard tasks, the task sequence, planned seconds and peaks.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device as a chain of **shard tasks**: per optimizer step, ``forward`` of shards ``0..S-2`` and
``backward`` (with Harmony's just-in-time update) of ``S-1..0``, then evaluation or deferred
update tasks (:func:`after_step_phase`, the one rule for every K). :class:`TaskChain` is the
part of a job that holds the sequence of its tasks a scheduler reads (:meth:`TaskChain.peek`,
:meth:`TaskChain.take`) with the plan's estimated seconds and peaks
(:meth:`TaskChain.planned_peak_bytes`, the one estimate prefetch decisions read); the job reads
its steps (:class:`StepRange`) when a sequence is made.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan

__all__ = ["ShardTask", "StateSlot", "StepRange", "TaskChain", "TaskKind", "TaskPhase",
           "TensorKey", "after_step_phase"]

TaskKind = Literal["forward", "backward"]
TaskPhase = Literal["train", "eval", "update"]
#: Names one tensor a shard promotes (a parameter, frozen parameter or buffer) to the job: a
#: fused array's canonical name, or one member's ``id(tensor)``.
TensorKey = int | str
#: Where one optimizer state tensor lives: ``(container, key)``, the tensor being
#: ``container[key]`` (a parameter's state in ``torch.optim``'s or the fused optimizer's).
StateSlot = tuple[MutableMapping[str, Any], str]


def after_step_phase(*, evaluates: bool, defers: bool, settles: bool) -> TaskPhase | None:
    """What follows a training step in a spilled job's task chain (one rule for every K).

    Args:
        evaluates: Some member evaluates after the step.
        defers: Clipped updates are deferred (``grad_clip`` and more than one shard).
        settles: Some member ends or writes a checkpoint after the step: its weights must be
            whole by then.

    Returns:
        ``"eval"``: evaluation tasks of every shard (they apply deferred updates as they
        promote); ``"update"``: ``update`` tasks of shards ``1..S-1``; ``None``: nothing.
    """
    if evaluates:
        return "eval"
    return "update" if defers and settles else None


@dataclass(frozen=True)
class ShardTask:
    """One shard task of one job: the unit a scheduler places on a device.

    Attributes:
        job_id: The job's name (``TrainSpec.name``; a fused array's first member's).
        seq: Position in the job's task sequence (tasks run in ``seq`` order).
        step: Optimizer steps the job had finished when the task was issued.
        shard: The shard index.
        kind: ``"forward"`` or ``"backward"`` (evaluation is forward; a final deferred update
            is backward).
        phase: ``"train"``, ``"eval"`` or ``"update"``.
        est_seconds: Estimated run time (from the plan).
        promote_bytes: Parameter bytes promoted at the start (from the plan).
    """

    job_id: str
    seq: int
    step: int
    shard: int
    kind: TaskKind
    phase: TaskPhase
    est_seconds: float
    promote_bytes: int


@dataclass(frozen=True)
class StepRange:
    """The steps a task sequence covers, read from the job when the sequence is made.

    Attributes:
        job_id: The job's name (the tasks' ``job_id``).
        first: The step the sequence starts at (the job's finished steps).
        stop: The step it trains to (exclusive).
        after: What follows step ``s`` (:func:`after_step_phase`), ``after(first)``: what runs
            before the first step.
    """

    job_id: str
    first: int
    stop: int
    after: Callable[[int], TaskPhase | None]


class TaskChain:
    """A job's task sequence: Hydra's tasks of its steps and what follows each step.

    Not thread-safe: the job's one task at a time.

    Args:
        plan: The job plan (shards, seconds, peaks).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation (its seconds and peaks are the plan's).
        steps: The job's steps, called when a sequence is made (at the first :meth:`peek`,
            and after :meth:`rechain`).
    """

    def __init__(self, plan: JobPlan, memory_plan: MemoryPlan | None,
                 steps: Callable[[], StepRange]) -> None:
        self.plan = plan
        self.memory_plan = memory_plan
        self._steps = steps
        self._future = deque[ShardTask]()
        self._first_seq = 0  # ``seq`` of the first task of the current task sequence
        self._num_issued = 0  # tasks the sequences have given so far
        self._tasks = self._task_sequence()

    def peek(self, ahead: int = 0) -> ShardTask | None:
        """The task ``ahead`` positions after the next one (``None``: the sequence ends)."""
        while len(self._future) <= ahead:
            task = next(self._tasks, None)
            if task is None:
                return None
            self._num_issued = task.seq + 1
            self._future.append(task)
        return self._future[ahead]

    def pop(self) -> ShardTask:
        """Take the next task off the sequence (it runs now); :meth:`peek` it first."""
        return self._future.popleft()

    def take(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the sequence at once, to be run together.

        Raises:
            ValueError: The sequence has fewer tasks left.
        """
        tasks = [self.peek(i) for i in range(num_tasks)]
        if any(task is None for task in tasks):
            raise ValueError(f"the job has fewer than {num_tasks} tasks left")
        for _ in range(num_tasks):
            self._future.popleft()
        return [task for task in tasks if task is not None]

    def step_due(self, task: ShardTask) -> bool:
        """Whether ``task`` is its step's first (it draws the minibatch and the dropout)."""
        first: TaskKind = "forward" if len(self.plan.shards) > 1 else "backward"
        return task.phase == "train" and task.kind == first and task.shard == 0

    def planned_peak_bytes(self, task: ShardTask, state_on_device: bool) -> int:
        """Planned device peak of ``task`` (bytes): the one estimate prefetch decisions read.

        A training task the memory plan covers peaks at the memory plan's estimate (its kept
        and swapped activations, and in a backward task the early fetch of the next backward's
        first activations); any other training or update task at the job plan's (Hydra's full
        recompute): both :meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_peak_bytes`.
        An evaluation task peaks at
        :meth:`~sweepmaster.runtime.planning.plans.JobPlan.eval_peak_bytes`.
        With ``state_on_device`` (the shard stayed resident with its optimizer state), the task
        holds the state through its compute, not only through its update: its bytes are added.
        """
        shard = self.plan.shards[task.shard]
        state = shard.optimizer_bytes if state_on_device else 0
        if task.phase == "eval":
            return state + self.plan.eval_peak_bytes(task.shard)
        activations = None
        if self.memory_plan is not None and task.phase == "train":
            activations = self.memory_plan.shards
        return state + self.plan.task_peak_bytes(task.kind, task.shard, activations)

    @property
    def step_s(self) -> float:
        """Estimated seconds of one training step: the memory plan's, else the job plan's."""
        return self.plan.step_s if self.memory_plan is None else self.memory_plan.step_s

    def rechain(self) -> None:
        """Make the task sequence again from the next task on (what follows has changed).

        A fused array a member joined has more steps, or an evaluation before its next step.
        Call it between tasks; the new sequence's tasks go on from the next ``seq``.
        """
        self._first_seq = self._future[0].seq if self._future else self._num_issued
        self._future.clear()
        self._tasks = self._task_sequence()

    def _task_sequence(self) -> Iterator[ShardTask]:
        """Hydra's tasks of the job's steps, each step followed by what ``after`` says.

        The steps are read from the job when the first task is asked for. The first task's
        ``seq`` is the next one the job has not issued (see :meth:`rechain`).
        """
        steps = self._steps()
        num_shards = len(self.plan.shards)
        seq = self._first_seq

        def task(step: int, shard: int, kind: TaskKind, phase: TaskPhase) -> ShardTask:
            nonlocal seq
            seq += 1
            plan = self.plan.shards[shard]
            seconds = plan.forward_s if kind == "forward" else plan.backward_s
            if self.memory_plan is not None and phase == "train":
                planned = self.memory_plan.shards[shard]
                seconds = planned.forward_s if kind == "forward" else planned.backward_s
            return ShardTask(steps.job_id, seq - 1, step, shard, kind, phase, seconds,
                             plan.param_bytes)

        def following(step: int) -> Iterator[ShardTask]:
            phase = steps.after(step)
            if phase == "eval":
                yield from (task(step, i, "forward", "eval") for i in range(num_shards))
            elif phase == "update":
                yield from (task(step, i, "backward", "update") for i in range(1, num_shards))

        yield from following(steps.first)
        for step in range(steps.first, steps.stop):
            yield from (task(step, i, "forward", "train") for i in range(num_shards - 1))
            yield from (task(step, i, "backward", "train") for i in range(num_shards - 1, -1, -1))
            yield from following(step + 1)
