"""A job as a scheduling policy sees it: a chain of shard tasks (pure Python, no torch).

Hydra's SHARP (Nagrecha & Kumar, 2022, https://arxiv.org/abs/2110.08633) schedules *shard tasks*:
a job spilled into S shards is ``2S - 1`` tasks per minibatch (forward of shards ``0..S-2``, the
last shard's forward, loss and backward, then backward of ``S-2..0``, each with its just-in-time
update); a job that fits on a device is one ``"step"`` task per minibatch. :class:`JobSpec`
stores the chain compactly (a head, one steady step repeated, a last step); the executor builds
it from plans (:func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sweepmaster.runtime.scheduling.pipeline import PipelineShape

__all__ = ["JobSpec", "ShardKey", "TaskKind", "TaskSpec"]


TaskKind = Literal["forward", "backward", "step"]
ShardKey = tuple[str, int]  # (job_id, shard)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One shard task: forward or backward of one shard of one job over one minibatch.

    Attributes:
        job_id: The job the task belongs to.
        index: Position in the job's chain, 0-based over all minibatches; task ``i + 1`` may
            start only after task ``i`` has ended.
        shard: The shard whose state must be on the device while the task runs.
        kind: ``"forward"`` (forward of the shard; its state is unchanged), ``"backward"``
            (backward of the shard and its just-in-time optimizer update; for the last shard it
            includes the forward and the loss) or ``"step"`` (forward, backward and update of a
            job that fits on the device).
        est_seconds: Estimated compute seconds, from the profile.
        promote_bytes: Bytes of the shard copied host -> device before the task unless the
            device holds the shard already (its parameters, and the optimizer state the
            job's task before kept with them).
        demote_bytes: Bytes the task copies device -> host at its end whether or not its
            shard stays resident (what it produced, what it changed of other state).
        other_promote_bytes: Bytes the task copies host -> device whether or not the shard is
            resident (:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`).
        peak_bytes: Planned device peak of the task (bytes, its shard included); ``None``:
            unknown, the task takes the whole device. The residency cache makes room for it
            (:meth:`~sweepmaster.runtime.scheduling.residency.Residency.make_room`).
        kept_bytes: Bytes the shard keeps on the device after the task when it stays
            resident for its job's next task (``Residency.stays``): its parameters, and its
            optimizer state when that task updates it too (a job of one shard between its
            steps); ``None``: ``promote_bytes``.
        write_back_bytes: Bytes of what the shard keeps that the task changed: copied
            device -> host when the shard leaves the device (evicted, its job's next task of
            another shard or on another device, the job's end), right after the task when it
            does not stay. Each task that changes a kept shard changes what its job's earlier
            tasks changed (an update changes all of the shard's parameters and keeps or sends
            home its state), so the shard writes back the last such task's bytes, once.
        state_bytes: The optimizer state among ``promote_bytes`` (kept with the shard by the
            job's task before): while the device holds the shard, it sits beside the whole
            task, beyond ``peak_bytes``
            (:meth:`~sweepmaster.runtime.scheduling.residency.Residency.task_starts`).
    """

    job_id: str
    index: int
    shard: int
    kind: TaskKind
    est_seconds: float
    promote_bytes: int
    demote_bytes: int
    other_promote_bytes: int = 0
    peak_bytes: int | None = None
    kept_bytes: int | None = None
    write_back_bytes: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class JobSpec:
    """A job: ``num_steps`` repetitions of one minibatch's chain of shard tasks.

    Any chain of tasks is a job with ``num_steps=1``. Tasks are built on demand, so a job of
    many steps costs memory for one step only.

    Args:
        job_id: Unique name of the job.
        step_tasks: The tasks of one minibatch in dependency order; ``step_tasks[p].index`` must
            be ``p`` and ``job_id`` the job's.
        num_steps: Minibatches (optimizer steps) the job runs.
        head_tasks: The tasks of the first minibatches where they move other bytes than
            ``step_tasks`` (whole minibatches in order, indices from 0; same shards, kinds and
            seconds as ``step_tasks``); empty: the same.
        last_tasks: The last minibatch's tasks likewise (indices from 0), when it is not one
            of the head's.
        pipeline: How a step of the job runs pipelined over several devices (Harmony PP);
            None: it never pipelines. A policy built with ``pipeline=True`` may then run whole
            steps of it over several devices (:meth:`Policy.next_pipeline`).

    Raises:
        ValueError: No tasks, ``num_steps < 1``, a task of another job, indices out of order,
            negative seconds or bytes, head / last tasks that differ in more than bytes or
            overlap, or a pipeline shape whose shards are not the step's (``2 S - 1`` tasks).
    """

    job_id: str
    step_tasks: tuple[TaskSpec, ...]
    num_steps: int = 1
    head_tasks: tuple[TaskSpec, ...] = ()
    last_tasks: tuple[TaskSpec, ...] = ()
    pipeline: PipelineShape | None = None
    _suffix_s: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _num_tasks: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.step_tasks or self.num_steps < 1:
            raise ValueError(f"job {self.job_id!r} needs at least one task and one step")
        for p, t in enumerate(self.step_tasks):
            if t.job_id != self.job_id or t.index != p:
                raise ValueError(f"job {self.job_id!r}: task {p} is {t}; expected index {p}")
        n = len(self.step_tasks)
        shape = [(t.shard, t.kind, t.est_seconds) for t in self.step_tasks]
        for variant in (self.head_tasks, self.last_tasks):
            ids = [(t.job_id, t.index) for t in variant]
            kinds = [(t.shard, t.kind, t.est_seconds) for t in variant]
            expected = [(self.job_id, i) for i in range(len(ids))], shape * (len(ids) // n)
            if (ids, kinds) != expected:
                raise ValueError(f"job {self.job_id!r}: head / last tasks differ in more "
                                 "than bytes from the step's tasks")
        if self.last_tasks and len(self.head_tasks) // n >= self.num_steps:
            raise ValueError(f"job {self.job_id!r}: the last step is one of the head's")
        if len(self.head_tasks) // n > self.num_steps:
            raise ValueError(f"job {self.job_id!r}: more head steps than steps")
        if self.pipeline is not None and (
                2 * self.pipeline.num_shards - 1 != n
                or {t.shard for t in self.step_tasks} != set(range(self.pipeline.num_shards))):
            raise ValueError(f"job {self.job_id!r}: its pipeline shape has "
                             f"{self.pipeline.num_shards} shards, its step {n} tasks")
        for t in (*self.step_tasks, *self.head_tasks, *self.last_tasks):
            if min(t.est_seconds, t.promote_bytes, t.demote_bytes, t.other_promote_bytes,
                   t.kept_bytes or 0, t.write_back_bytes, t.state_bytes) < 0:
                raise ValueError(f"job {self.job_id!r}: negative seconds or bytes in {t}")
        suffix = list(itertools.accumulate(t.est_seconds for t in reversed(self.step_tasks)))
        object.__setattr__(self, "_suffix_s", (*reversed(suffix), 0.0))
        object.__setattr__(self, "_num_tasks", len(self.step_tasks) * self.num_steps)

    @classmethod
    def from_shards(
        cls, job_id: str, num_steps: int, forward_s: Sequence[float], backward_s: Sequence[float],
        param_bytes: Sequence[int], state_bytes: Sequence[int],
    ) -> JobSpec:
        """The Hydra chain of a job spilled into ``S = len(forward_s)`` shards.

        A forward promotes ``param_bytes`` of its shard and writes nothing back; a backward
        (the last shard's: forward, backward and update at once) promotes and writes back
        ``state_bytes`` (parameters and optimizer state). ``forward_s`` and ``backward_s`` are
        compute seconds of each shard over one minibatch (recompute and update included). With
        ``S == 1`` the job fits on a device: one ``"step"`` task per minibatch.

        Raises:
            ValueError: The four sequences differ in length or are empty.
        """
        num_shards = len(forward_s)
        if num_shards == 0 or {len(backward_s), len(param_bytes), len(state_bytes)} != {
            num_shards
        }:
            raise ValueError(f"job {job_id!r}: need one time and size per shard for every list")
        last = num_shards - 1
        plan: list[tuple[int, TaskKind, float, int, int]] = [
            (s, "forward", forward_s[s], param_bytes[s], 0) for s in range(last)
        ]
        plan.append((last, "step" if last == 0 else "backward",
                     forward_s[last] + backward_s[last], state_bytes[last], state_bytes[last]))
        plan += [(s, "backward", backward_s[s], state_bytes[s], state_bytes[s])
                 for s in range(last - 1, -1, -1)]
        tasks = tuple(TaskSpec(job_id, p, s, kind, float(sec), int(up), int(down))
                      for p, (s, kind, sec, up, down) in enumerate(plan))
        return cls(job_id, tasks, num_steps)

    @property
    def num_tasks(self) -> int:
        """Tasks over all minibatches."""
        return self._num_tasks

    def task(self, index: int) -> TaskSpec:
        """The task at ``index`` (``0 <= index < num_tasks``)."""
        step, p = divmod(index, len(self.step_tasks))
        if index < len(self.head_tasks):
            return self.head_tasks[index]
        if step == 0:
            return self.step_tasks[p]
        t = self.step_tasks[p]
        if step == self.num_steps - 1 and self.last_tasks:
            t = self.last_tasks[p]
        return TaskSpec(self.job_id, index, t.shard, t.kind, t.est_seconds, t.promote_bytes,
                        t.demote_bytes, t.other_promote_bytes, t.peak_bytes, t.kept_bytes,
                        t.write_back_bytes, t.state_bytes)

    def tasks(self) -> Iterator[TaskSpec]:
        """All tasks in dependency order."""
        return (self.task(i) for i in range(self.num_tasks))

    def shard_at(self, index: int) -> int:
        """The shard of task ``index``."""
        return self.step_tasks[index % len(self.step_tasks)].shard

    def remaining_est_s(self, index: int) -> float:
        """Estimated compute seconds of tasks ``index..num_tasks-1``."""
        if index >= self._num_tasks:
            return 0.0
        step, p = divmod(index, len(self.step_tasks))
        return self._suffix_s[p] + (self.num_steps - step - 1) * self._suffix_s[0]
