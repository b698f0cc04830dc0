"""The task model of a spilled job: shard tasks, the task sequence, planned seconds and peaks.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device as a chain of **shard tasks**: per optimizer step, ``forward`` of shards ``0..S-2`` and
``backward`` (with Harmony's just-in-time update) of ``S-1..0``, then evaluation or deferred
update tasks (:func:`after_step_phase`, the one rule for every K). :class:`TaskChain` is the
sequence of a job's tasks a scheduler reads (:meth:`TaskChain.next_task`,
:meth:`TaskChain.peek_task`, :meth:`TaskChain.take_tasks`) with the plan's estimated seconds
and peaks (:meth:`TaskChain.planned_peak_bytes`, the one estimate prefetch decisions read); the
job running them is :class:`~sweepmaster.runtime.training.chain.ShardChain`.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import HostBoundaries
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.planned import PlannedPasses
from sweepmaster.runtime.training.replay import JobRng

__all__ = ["ShardTask", "StateSlot", "TaskChain", "TaskKind", "TaskPhase", "TensorKey",
           "after_step_phase"]

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


class TaskChain(ABC):
    """A spilled job's task sequence: Hydra's tasks of its steps and what follows each step.

    Subclasses say what follows a step (:attr:`num_steps`, :meth:`_evaluates_after`,
    :meth:`_settles_after`: the task sequence is :meth:`_chain`'s with
    :func:`after_step_phase`) and whether the job stopped early (:attr:`stopped`).

    It holds the job's host boundaries (:attr:`boundaries`) and its planned passes
    (:attr:`passes`), built from the job's token ids, layers, dropout mode and loss.

    Args:
        plan: The job plan (shards, microbatch sizes, seconds, peaks); its device's type
            (``cpu`` or ``cuda``) is where the job's tasks run.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation.

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).

    Attributes:
        boundaries: The host side of the job's shard boundaries and its counted copies.
        passes: The job's planned passes (mu-TWO) and its recorded losses.
    """

    #: Dimension of the rows in token ids and host boundaries: 0 for one member's
    #: ``(B, ...)``, 1 for a fused array's ``(K, B, ...)``.
    row_dim = 0

    def __init__(self, plan: JobPlan, batch_size: int,
                 memory_plan: MemoryPlan | None = None) -> None:
        self.plan = plan
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
        self.boundaries = HostBoundaries(plan, batch_size, row_dim=self.row_dim,
                                         labels=self._labels, targets=self.step_targets)
        self.passes = PlannedPasses(plan, self.boundaries, memory_plan,
                                    layer_calls=self._layer_calls, pass_mode=self._pass_mode,
                                    lm_loss=self._lm_loss)
        self.memory_plan = memory_plan
        self._future = deque[ShardTask]()
        self._first_seq = 0  # ``seq`` of the first task of the current task sequence
        self._num_issued = 0  # tasks the sequences have given so far
        self._tasks = self._task_sequence()

    # ------------------------------------------------------------------ what a job provides

    @abstractmethod
    def _labels(self) -> torch.Tensor:
        """The step's token ids on the host, the whole minibatch (``(B, T)``, ``(K, B, T)``)."""

    def step_targets(self) -> torch.Tensor | None:
        """The step's loss labels on the host, as the token ids; ``None``: the ids are.

        With a loss mask (:attr:`~sweepmaster.workload.spec.TrainSpec.train_mask`): the ids
        with :data:`~sweepmaster.workload.spec.IGNORED_TARGET` where a token does not count.
        """
        return None

    @abstractmethod
    def _layer_calls(self, shard: int, rows: slice,
                     device: Device) -> tuple[list[Layer], list[list[torch.Tensor]]]:
        """The shard's layers on microbatch ``rows`` and, per layer, its resident tensors.

        Each layer is a callable of its input; the resident tensors (parameters and buffers on
        the device) are what its saved tensors may name instead of copying them.
        """

    @abstractmethod
    def _pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
                   site: int = 0, rng: JobRng | None = None,
                   ) -> contextlib.AbstractContextManager[Any]:
        """The dispatch mode of a shard pass (dropout record / replay from ``site``).

        Entered, it gives an object whose ``site`` counts the shard's random ops so far.
        ``rng``: the dropout stream
        (:meth:`~sweepmaster.runtime.training.compute.ShardCompute.dropout_stream`), else the
        job's.
        """

    @abstractmethod
    def _lm_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each member's causal-LM loss: 0-dim for one member, ``(K,)`` for a fused array.

        ``logits``: ``(b, T, V)``, ``ids``: ``(b, T)`` (a fused array: ``(K, ...)`` both).
        """

    # ------------------------------------------------------------------ the parts' numbers

    @property
    def swap_bytes(self) -> int:
        """Bytes moved between host and device so far (the boundaries' counter)."""
        return self.boundaries.swap_bytes

    @swap_bytes.setter
    def swap_bytes(self, value: int) -> None:
        self.boundaries.swap_bytes = value

    @property
    def counter_lock(self) -> threading.RLock:
        """Guards the byte counters and host bookkeeping (the boundaries' lock)."""
        return self.boundaries.counter_lock

    @property
    def num_recompute_fallbacks(self) -> int:
        """Backward tasks that recomputed their shard instead of running the memory plan."""
        return self.passes.num_recompute_fallbacks

    @property
    def plan_mismatches(self) -> int:
        """Layer passes that saved other activations than profiled."""
        return self.passes.plan_mismatches

    @property
    def activation_swap_bytes(self) -> int:
        """Bytes of saved activations a memory plan moved between host and device so far."""
        return self.passes.activation_swap_bytes

    def to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on ``device``, counted in :attr:`swap_bytes` (any thread)."""
        return self.boundaries.to_device(device, host)

    def to_host(self, device: Device, tensor: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of ``tensor`` (into ``out`` if given), counted in :attr:`swap_bytes`."""
        return self.boundaries.to_host(device, tensor, out)

    def microbatches(self, shard: int, num_rows: int | None = None) -> list[slice]:
        """Row slices of ``shard``'s microbatches over a minibatch (or ``num_rows`` rows)."""
        return self.boundaries.microbatches(shard, num_rows)

    def eval_chunks(self, shard: int, num_rows: int) -> list[slice]:
        """Plain's evaluation batches of ``batch_size`` rows, in ``shard``'s microbatches."""
        return self.boundaries.eval_chunks(shard, num_rows)

    def rows_of(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """``rows`` of ``tensor`` along :attr:`row_dim` (a view)."""
        return self.boundaries.rows_of(tensor, rows)

    # ------------------------------------------------------------------ the task sequence

    @property
    @abstractmethod
    def step(self) -> int:
        """Optimizer steps the job finished (a fused array's: in this run)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The job's name (a fused array's: its first member's)."""

    @property
    @abstractmethod
    def clips(self) -> bool:
        """Whether some member clips its gradients (``grad_clip``): updates wait for the norm."""

    @property
    @abstractmethod
    def stopped(self) -> bool:
        """Whether the job stopped before its task sequence ends (pruned, every member left)."""

    def next_task(self) -> ShardTask | None:
        """The next task to run, or ``None`` when the job is finished or :attr:`stopped`."""
        return None if self.stopped else self.peek_task(0)

    def peek_task(self, ahead: int = 1) -> ShardTask | None:
        """The task ``ahead`` positions after the next one (assuming nothing ends early)."""
        while len(self._future) <= ahead:
            task = next(self._tasks, None)
            if task is None:
                return None
            self._num_issued = task.seq + 1
            self._future.append(task)
        return self._future[ahead]

    def take_tasks(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the chain at once, to be run together.

        A pipelined step (:mod:`~sweepmaster.runtime.training.pipelined`) runs a whole step's
        tasks over several devices at once.

        Raises:
            ValueError: The job has fewer tasks left, or it stopped.
        """
        tasks = [self.peek_task(i) for i in range(num_tasks)] if not self.stopped else [None]
        if any(task is None for task in tasks):
            raise ValueError(f"the job has fewer than {num_tasks} tasks left")
        for _ in range(num_tasks):
            self._future.popleft()
        return [task for task in tasks if task is not None]

    def _step_due(self, task: ShardTask) -> bool:
        """Whether ``task`` is its step's first (it draws the minibatch and the dropout)."""
        first: TaskKind = "forward" if len(self.plan.shards) > 1 else "backward"
        return task.phase == "train" and task.kind == first and task.shard == 0

    def planned_peak_bytes(self, task: ShardTask) -> int:
        """Planned device peak of ``task`` (bytes): the one estimate prefetch decisions read.

        A training task the memory plan covers peaks at the memory plan's estimate (its kept
        and swapped activations, and in a backward task the early fetch of the next backward's
        first activations); any other training or update task at the job plan's (Hydra's full
        recompute): both :meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_peak_bytes`.
        An evaluation task peaks at
        :meth:`~sweepmaster.runtime.planning.plans.JobPlan.eval_peak_bytes`.
        A task whose shard stayed resident with its optimizer state (:meth:`_state_stays`)
        holds the state through its compute, not only through its update: its bytes are added.
        """
        shard = self.plan.shards[task.shard]
        state = shard.optimizer_bytes if self.state_on_device(task.shard) else 0
        if task.phase == "eval":
            return state + self.plan.eval_peak_bytes(task.shard)
        activations = None
        if self.memory_plan is not None and task.phase == "train":
            activations = self.memory_plan.shards
        return state + self.plan.task_peak_bytes(task.kind, task.shard, activations)

    @abstractmethod
    def state_on_device(self, shard: int) -> bool:
        """Whether the shard's optimizer state is on a device (it counts in its task's peak)."""

    def _task_sequence(self) -> Iterator[ShardTask]:
        """Every task of the job in order (ending a job early only truncates it).

        Hydra's tasks of steps :attr:`step` to :attr:`num_steps`; what follows each step is
        :func:`after_step_phase`'s, from :meth:`_evaluates_after` and :meth:`_settles_after`
        (before the first step: only an evaluation).
        """
        first = self.step
        defers = self.clips and len(self.plan.shards) > 1

        def after(step: int) -> TaskPhase | None:
            return after_step_phase(evaluates=self._evaluates_after(step), defers=defers,
                                    settles=step != first and self._settles_after(step))

        yield from self._chain(self.name, first, self.num_steps, after)

    @property
    @abstractmethod
    def num_steps(self) -> int:
        """The step the job trains to (a fused array's: in this run)."""

    @property
    def remaining_seconds(self) -> float:
        """Estimated seconds of the job's remaining training steps (the Sharded-LRTF key).

        Steps from :attr:`step` to :attr:`num_steps` (a fused array's: until its last member
        ends), each of the memory plan's step seconds, or the job plan's without one.
        """
        step_s = self.plan.step_s if self.memory_plan is None else self.memory_plan.step_s
        return (self.num_steps - self.step) * step_s

    @abstractmethod
    def _evaluates_after(self, step: int) -> bool:
        """Whether some member evaluates after ``step`` (at the sequence's first: before it)."""

    @abstractmethod
    def _settles_after(self, step: int) -> bool:
        """Whether some member ends or writes a checkpoint after ``step``."""

    def _rechain(self) -> None:
        """Make the task sequence again from the next task on (what follows has changed).

        A fused array a member joined has more steps, or an evaluation before its next step.
        Call it between tasks with nothing prefetched; the new sequence's tasks go on from the
        next ``seq``.
        """
        self._first_seq = self._future[0].seq if self._future else self._num_issued
        self._future.clear()
        self._tasks = self._task_sequence()

    def _chain(self, job_id: str, first: int, stop: int,
               after: Callable[[int], TaskPhase | None]) -> Iterator[ShardTask]:
        """Hydra's tasks of steps ``first..stop-1``, each step followed by ``after(step + 1)``.

        ``after(first)`` says what runs before the first step (an evaluation at step 0). The
        first task's ``seq`` is the next one the job has not issued (see :meth:`_rechain`).
        """
        num_shards = len(self.plan.shards)
        seq = self._first_seq
        self.passes.job_id = job_id

        def task(step: int, shard: int, kind: TaskKind, phase: TaskPhase) -> ShardTask:
            nonlocal seq
            seq += 1
            plan = self.plan.shards[shard]
            seconds = plan.forward_s if kind == "forward" else plan.backward_s
            if self.memory_plan is not None and phase == "train":
                planned = self.memory_plan.shards[shard]
                seconds = planned.forward_s if kind == "forward" else planned.backward_s
            return ShardTask(job_id, seq - 1, step, shard, kind, phase, seconds,
                             plan.param_bytes)

        def following(step: int) -> Iterator[ShardTask]:
            phase = after(step)
            if phase == "eval":
                yield from (task(step, i, "forward", "eval") for i in range(num_shards))
            elif phase == "update":
                yield from (task(step, i, "backward", "update") for i in range(1, num_shards))

        yield from following(first)
        for step in range(first, stop):
            yield from (task(step, i, "forward", "train") for i in range(num_shards - 1))
            yield from (task(step, i, "backward", "train") for i in range(num_shards - 1, -1, -1))
            yield from following(step + 1)
