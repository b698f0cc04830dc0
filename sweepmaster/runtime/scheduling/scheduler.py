"""SHARP shard-task scheduling: Sharded-LRTF and the baseline policies (pure Python, no torch).

Hydra (Nagrecha & Kumar, 2022, https://arxiv.org/abs/2110.08633) trains many models that are larger
than a device by *spilling* them into shards and interleaving the shard tasks of many models on
few devices: SHARP (Shard Alternator Parallelism). Whenever a device frees, **Sharded-LRTF** gives
it the next shard task of the ready job with the longest remaining time, so all jobs finish close
together and the makespan is near optimal.

A job is a chain of shard tasks. For a job spilled into S shards one minibatch (optimizer step) is
2S-1 tasks: forward of shards 0..S-2, the last shard's forward, loss and backward at once, then the
backward of shards S-2..0, each followed by its optimizer update while the shard is resident
(Harmony's just-in-time update); with input-batch grouping a task covers all microbatches of the
minibatch. A job that fits on a device is one ``"step"`` task per minibatch.

Every policy has the same interface (:class:`Policy`), so one object drives the simulator
(:mod:`~sweepmaster.runtime.scheduling.simulate`) and the real executor. Devices are the integers
``0..num_devices-1``; the caller maps them to real devices.

Example:
    >>> policy = ShardedLRTF(num_devices=2)
    >>> policy.add_job(JobSpec.from_shards("a", 1, [1.0, 1.0], [2.0, 2.0], [4, 4], [12, 12]))
    >>> task = policy.next_task(0)
    >>> (task.job_id, task.index, task.shard, task.kind)
    ('a', 0, 0, 'forward')
    >>> policy.task_done(task, measured_s=1.0)
    False
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from sweepmaster.runtime.scheduling.pipeline import (
    PipelineDecision,
    PipelineShape,
    choose_packs,
    pipeline_step,
    place,
)

__all__ = [
    "JobSpec",
    "ModelParallel",
    "Policy",
    "RandomPolicy",
    "Residency",
    "RoundRobin",
    "ShardedLRTF",
    "ShardKey",
    "ShortestRemainingFirst",
    "TaskKind",
    "TaskParallelFIFO",
    "TaskSpec",
    "policy_names",
]

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
            device holds the shard already.
        demote_bytes: Bytes the task copies device -> host (what it changed, what it produced).
        other_promote_bytes: Bytes the task copies host -> device whether or not the shard is
            resident: boundary activations and their gradients, token ids, optimizer state,
            a deferred update's inputs (see
            :meth:`~sweepmaster.runtime.planning.partition.JobPlan.task_bytes`).
    """

    job_id: str
    index: int
    shard: int
    kind: TaskKind
    est_seconds: float
    promote_bytes: int
    demote_bytes: int
    other_promote_bytes: int = 0


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
            if [(t.job_id, t.index) for t in variant] != [
                (self.job_id, i) for i in range(len(variant))
            ] or [(t.shard, t.kind, t.est_seconds) for t in variant] != shape * (
                len(variant) // n
            ):
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
            if min(t.est_seconds, t.promote_bytes, t.demote_bytes, t.other_promote_bytes) < 0:
                raise ValueError(f"job {self.job_id!r}: negative seconds or bytes in {t}")
        suffix = list(itertools.accumulate(t.est_seconds for t in reversed(self.step_tasks)))
        object.__setattr__(self, "_suffix_s", (*reversed(suffix), 0.0))
        object.__setattr__(self, "_num_tasks", len(self.step_tasks) * self.num_steps)

    @classmethod
    def from_shards(
        cls,
        job_id: str,
        num_steps: int,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        param_bytes: Sequence[int],
        state_bytes: Sequence[int],
    ) -> JobSpec:
        """The Hydra chain of a job spilled into ``S = len(forward_s)`` shards.

        One minibatch is forward of shards 0..S-2 (promote the parameters, nothing to write
        back), the last shard's forward + backward + update at once, then backward + update of
        shards S-2..0 (promote and write back parameters and optimizer state). With ``S == 1``
        the job fits on a device: one ``"step"`` task per minibatch.

        Args:
            job_id: Unique name of the job.
            num_steps: Minibatches the job runs.
            forward_s: Forward compute seconds of each shard over one minibatch.
            backward_s: Backward compute seconds of each shard (recompute and update included).
            param_bytes: Parameter bytes of each shard (what a forward promotes).
            state_bytes: Parameter + optimizer-state bytes of each shard (what a backward
                promotes and writes back).

        Returns:
            The job.

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
                        t.demote_bytes, t.other_promote_bytes)

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


class Residency:
    """Which shards each device holds: an LRU of ``num_slots`` ``(job_id, shard)`` keys per device.

    A shard has one copy: adding it to a device drops it from every other device (the job's
    state moves with it; demotes are write-through, so the host copy is current and dropping a
    copy costs nothing). One slot models the executor's residency cache, which keeps at most
    one shard per device between tasks. Not thread-safe; a :class:`Policy` guards its own with
    its lock.

    Args:
        num_devices: Devices tracked.
        num_slots: Shards a device holds at once.

    Raises:
        ValueError: ``num_slots < 1``.
    """

    def __init__(self, num_devices: int, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slots: list[OrderedDict[ShardKey, None]] = [
            OrderedDict() for _ in range(num_devices)
        ]
        self._where: dict[ShardKey, int] = {}

    def holds(self, device: int, key: ShardKey) -> bool:
        """Whether ``device`` holds the shard ``key``."""
        return self._where.get(key) == device

    def keys(self, device: int) -> list[ShardKey]:
        """The shards ``device`` holds, least recently used first."""
        return list(self._slots[device])

    def add(
        self, device: int, key: ShardKey, protect: ShardKey | None = None
    ) -> list[ShardKey] | None:
        """Put ``key`` on ``device`` (most recently used), evicting the LRU shard if full.

        Args:
            device: The device.
            key: The shard.
            protect: A shard that must not be evicted (the one running there).

        Returns:
            The evicted shards, or None when no slot could be freed (``key`` is not added).
        """
        slots = self._slots[device]
        if key in slots:
            slots.move_to_end(key)
            return []
        evicted = []
        if len(slots) >= self.num_slots:
            for victim in slots:
                if victim != protect:
                    break
            else:
                return None
            del slots[victim], self._where[victim]
            evicted.append(victim)
        other = self._where.get(key)
        if other is not None:
            del self._slots[other][key]
        slots[key] = None
        self._where[key] = device
        return evicted

    def discard(self, device: int, key: ShardKey) -> None:
        """Forget ``key`` on ``device`` if it is held there."""
        if self._where.get(key) == device:
            del self._slots[device][key], self._where[key]

    def drop_job(self, job_id: str) -> None:
        """Forget every shard of ``job_id`` (the job left)."""
        for slots in self._slots:
            for key in [k for k in slots if k[0] == job_id]:
                del slots[key], self._where[key]


class _Job:
    """A policy's state of one job (guarded by the policy's lock)."""

    __slots__ = ("device", "key_s", "next_index", "next_shard", "num_tasks", "placement", "ratio",
                 "removed", "reserved_for", "seq", "spec", "version")

    def __init__(self, spec: JobSpec, seq: int) -> None:
        self.spec = spec
        self.seq = seq  # arrival order
        self.num_tasks = spec.num_tasks
        self.next_index = 0  # next task to hand out
        self.next_shard = spec.shard_at(0)
        self.ratio: float | None = None  # EWMA of its measured / estimated seconds
        self.device: int | None = None  # where its current task runs
        self.removed = False
        self.version = 0  # invalidates stale heap entries
        self.key_s = 0.0  # remaining seconds when it last became ready (or was re-keyed)
        self.reserved_for: int | None = None  # device whose lookahead named it
        # (devices, cuts) of its last pipelined step while those devices still hold its packs
        self.placement: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def ready(self) -> bool:
        return self.device is None and not self.removed and self.next_index < self.num_tasks

    def remaining_s(self, speed: float) -> float:
        """Estimated seconds of its unfinished tasks, corrected by its measurements.

        A job without measurements is corrected by ``speed``, the policy-wide ratio.
        """
        ratio = self.ratio if self.ratio is not None else speed
        return self.spec.remaining_est_s(self.next_index) * ratio


class Policy(ABC):
    """A SHARP scheduling policy: which job's next shard task a free device runs.

    Contract: a job runs on at most one device at a time and its tasks run in dependency order;
    a device runs one task at a time (call :meth:`task_done` before asking for its next task).
    The one exception is a pipelined step (:meth:`next_pipeline`, Harmony PP): a whole step of
    one job on several devices at once, which occupies them until :meth:`pipeline_done`.
    Every public method takes the one lock and returns quickly, so worker threads of an executor
    may call them concurrently; none blocks waiting for work (:meth:`next_task` returns None).

    Remaining time of a job = estimated seconds of its unfinished tasks (minibatches left x
    seconds per minibatch from the profile) x an EWMA of its measured / estimated task seconds;
    a job that has not run yet takes the EWMA over every job's tasks instead (a cost model that
    is off is off for every job, so a new job must not look shorter than the measured ones).
    Residency is the policy's belief of which shards each device holds (:class:`Residency`),
    updated when it hands out a task and by :meth:`prefetched`; it breaks ties.

    Args:
        num_devices: Devices ``0..num_devices-1``.
        num_slots: Shards a device keeps between tasks (1: the executor's residency cache).
        ewma_alpha: Weight of the newest measurement in the measured / estimated ratio.

    Raises:
        ValueError: ``num_devices < 1``, ``num_slots < 1`` or ``ewma_alpha`` not in (0, 1].
    """

    name: ClassVar[str]

    def __init__(self, num_devices: int, *, num_slots: int = 1, ewma_alpha: float = 0.2) -> None:
        if num_devices < 1 or not 0 < ewma_alpha <= 1:
            raise ValueError(f"need num_devices >= 1 and 0 < ewma_alpha <= 1, "
                             f"got {num_devices}, {ewma_alpha}")
        self.num_devices = num_devices
        self.num_slots = num_slots
        self._alpha = ewma_alpha
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._speed = 1.0  # EWMA of measured / estimated seconds over every job's tasks
        self._num_measured = 0
        self._running: list[TaskSpec | None] = [None] * num_devices
        self._piped: list[PipelineDecision | None] = [None] * num_devices
        self._residency = Residency(num_devices, num_slots)
        self._seq = itertools.count()

    def add_job(self, job: JobSpec) -> None:
        """Schedule a new job (it is ready at once).

        Raises:
            ValueError: A job with this id is scheduled already.
        """
        with self._lock:
            if job.job_id in self._jobs:
                raise ValueError(f"job {job.job_id!r} is already scheduled")
            state = _Job(job, next(self._seq))
            self._jobs[job.job_id] = state
            self._added(state)

    def remove_job(self, job_id: str) -> bool:
        """Drop a job (pruned, failed or cancelled); it gets no further tasks.

        A task of it still running keeps its device busy until :meth:`task_done` is called for
        it.

        Returns:
            Whether the job was scheduled (False for unknown, finished or removed jobs).
        """
        with self._lock:
            state = self._jobs.get(job_id)
            if state is None or state.removed:
                return False
            state.removed = True
            self._forget(state)
            if state.device is None:
                del self._jobs[job_id]
            return True

    def next_task(self, device: int) -> TaskSpec | None:
        """Give the free ``device`` its next task, or None when no job is ready for it.

        Raises:
            ValueError: ``device`` is still running a task.
        """
        with self._lock:
            running = self._running[device] or self._piped[device]
            if running is not None:
                raise ValueError(f"device {device} is still running {running}")
            state = self._pick(device)
            if state is None:
                return None
            assert state.ready(), "a policy picked a job that is not ready"
            state.placement = None  # its packs, if any, go back to the host
            task = state.spec.task(state.next_index)
            state.next_index += 1
            if state.next_index < state.num_tasks:
                state.next_shard = state.spec.shard_at(state.next_index)
            state.version += 1
            state.device = device
            self._running[device] = task
            self._residency.add(device, (task.job_id, task.shard))
            return task

    def task_done(self, task: TaskSpec, measured_s: float | None = None) -> bool:
        """Record that ``task`` ended (or failed); its device is free and its job ready.

        Args:
            task: The task :meth:`next_task` returned.
            measured_s: Its measured compute seconds; refines the job's remaining time.

        Returns:
            Whether that was the job's last task (the job finished and left the policy).

        Raises:
            ValueError: ``task`` is not running, or ``measured_s`` is negative.
        """
        with self._lock:
            state = self._jobs.get(task.job_id)
            device = None if state is None else state.device
            running = None if device is None else self._running[device]
            if state is None or device is None or running is None or running.index != task.index:
                raise ValueError(f"{task} is not running")
            if measured_s is not None:
                if measured_s < 0:
                    raise ValueError(f"measured_s must be >= 0, got {measured_s}")
                if task.est_seconds > 0:
                    self._measured(state, measured_s / task.est_seconds)
            self._running[device] = None
            state.device = None
            if state.removed:
                del self._jobs[task.job_id]
                return False
            if state.next_index >= state.num_tasks:
                del self._jobs[task.job_id]
                self._forget(state)
                return True
            self._became_ready(state)
            return False

    def next_pipeline(self) -> PipelineDecision | None:
        """Run one step of a ready job pipelined over several free devices, or None.

        Harmony's late binding (Li et al., VLDB 2022): when ready jobs are fewer than free
        devices, a policy that pipelines (:class:`ShardedLRTF` with ``pipeline=True``; the
        others never do) may give one job at a step boundary several devices, one pack of its
        shards each (:class:`~sweepmaster.runtime.scheduling.pipeline.PipelineDecision`). Each
        other ready job keeps a free device for itself. The devices are busy until
        :meth:`pipeline_done`; call this before :meth:`next_task` on the free devices.
        """
        with self._lock:
            free = [d for d in range(self.num_devices)
                    if self._running[d] is None and self._piped[d] is None]
            if len(free) < 2:
                return None
            decision = self._pick_pipeline(free)
            if decision is None:
                return None
            state = self._jobs[decision.job_id]
            assert state.ready(), "a policy pipelined a job that is not ready"
            state.next_index += decision.num_tasks
            if state.next_index < state.num_tasks:
                state.next_shard = state.spec.shard_at(state.next_index)
            state.version += 1
            state.device = decision.devices[0]
            state.placement = (decision.devices, decision.cuts)
            for device, pack in zip(decision.devices, decision.packs, strict=True):
                self._piped[device] = decision
                for shard in pack:
                    self._residency.add(device, (decision.job_id, shard))
            return decision

    def pipeline_done(self, decision: PipelineDecision) -> bool:
        """Record that a pipelined step ended (flushed); its devices are free, its job ready.

        Returns:
            Whether that was the job's last step (the job finished and left the policy).

        Raises:
            ValueError: ``decision`` is not running.
        """
        with self._lock:
            state = self._jobs.get(decision.job_id)
            if state is None or any(self._piped[d] is not decision for d in decision.devices):
                raise ValueError(f"{decision} is not running")
            for device in decision.devices:
                self._piped[device] = None
            state.device = None
            if state.removed:
                del self._jobs[decision.job_id]
                return False
            if state.next_index >= state.num_tasks:
                del self._jobs[decision.job_id]
                self._forget(state)
                return True
            self._became_ready(state)
            return False

    def pipelined(self, device: int) -> PipelineDecision | None:
        """The pipelined step ``device`` takes part in, or None."""
        with self._lock:
            return self._piped[device]

    def lookahead(self, device: int) -> TaskSpec | None:
        """The task ``device`` will likely run next, so its shard can be prefetched.

        Hydra's double buffering: while the current task runs, the next one's shard is
        promoted. The guess assumes the device's current job finishes its task as estimated.
        :class:`ShardedLRTF` (by default) reserves the named job for ``device``, so its
        :meth:`next_task` returns that task unless an otherwise idle device took the job;
        the baselines only guess.

        Returns:
            The predicted task, or None when no guess can be made.
        """
        with self._lock:
            running = self._running[device]
            own = None if running is None else self._jobs.get(running.job_id)
            if own is not None and (own.removed or own.next_index >= own.num_tasks):
                own = None
            state = self._lookahead(device, own)
            return None if state is None else state.spec.task(state.next_index)

    def prefetched(self, device: int, task: TaskSpec) -> None:
        """Record that ``task``'s shard was promoted onto ``device`` ahead of time."""
        with self._lock:
            if task.job_id in self._jobs:
                running = self._running[device]
                protect = None if running is None else (running.job_id, running.shard)
                self._residency.add(device, (task.job_id, task.shard), protect)

    def evicted(self, device: int, job_id: str, shard: int) -> None:
        """Record that ``device`` no longer holds the shard (demoted, not kept resident).

        The executor reports what its jobs' residency caches did not keep, so the policy's
        residency (which breaks ties) is what the devices really hold.
        """
        with self._lock:
            self._residency.discard(device, (job_id, shard))

    def remaining_s(self, job_id: str) -> float:
        """Estimated seconds ``job_id`` still needs, its running task (or pipelined step) included.

        Sequential seconds, as on one device: a pipelined step counts as its shard tasks.

        Raises:
            KeyError: The job is not scheduled.
        """
        with self._lock:
            state = self._jobs[job_id]
            first = state.next_index
            if state.device is not None:
                piped = self._piped[state.device]
                first -= piped.num_tasks if piped is not None and piped.job_id == job_id else 1
            ratio = state.ratio if state.ratio is not None else self._speed
            return state.spec.remaining_est_s(first) * ratio

    def job_ids(self) -> list[str]:
        """The scheduled jobs (removed ones with a running task excluded), in arrival order."""
        with self._lock:
            return [j for j, s in self._jobs.items() if not s.removed]

    def running(self, device: int) -> TaskSpec | None:
        """The task ``device`` runs, or None if it is free."""
        with self._lock:
            return self._running[device]

    def is_resident(self, device: int, job_id: str, shard: int) -> bool:
        """Whether the policy believes ``device`` holds that shard."""
        with self._lock:
            return self._residency.holds(device, (job_id, shard))

    def _measured(self, state: _Job, ratio: float) -> None:
        """Fold one task's measured / estimated ``ratio`` into the job's and the policy's EWMA.

        The first measurements count fully (weight ``1 / n`` until it drops below the EWMA's),
        so a cost model that is off by 10x is corrected after one task, not after many.
        """
        self._num_measured += 1
        self._speed += max(self._alpha, 1 / self._num_measured) * (ratio - self._speed)
        if state.ratio is None:
            state.ratio = ratio
        else:
            state.ratio += self._alpha * (ratio - state.ratio)
        self._speed_changed()

    # Hooks, called with the lock held.
    def _speed_changed(self) -> None:  # noqa: B027 (optional hook)
        """The policy-wide measured / estimated ratio changed."""

    def _added(self, state: _Job) -> None:
        """A job arrived (ready)."""
        self._became_ready(state)

    def _forget(self, state: _Job) -> None:
        """A job left (finished or removed)."""
        self._residency.drop_job(state.spec.job_id)
        state.version += 1

    def _became_ready(self, state: _Job) -> None:  # noqa: B027 (optional hook)
        """A job's task ended and it has more."""

    def _pick_pipeline(self, free: list[int]) -> PipelineDecision | None:
        """A ready job to pipeline over some of the ``free`` devices (default: never)."""
        return None

    @abstractmethod
    def _pick(self, device: int) -> _Job | None:
        """The ready job whose next task the free ``device`` runs (taken out of the ready set)."""

    @abstractmethod
    def _lookahead(self, device: int, own: _Job | None) -> _Job | None:
        """The job ``device`` likely runs next once ``own`` (running there) is ready.

        A policy may reserve it for ``device`` (then :meth:`_pick` returns it).
        """

    def _resident_next(self, device: int, state: _Job) -> bool:
        return self._residency.holds(device, (state.spec.job_id, state.next_shard))


class _RemainingTimePolicy(Policy):
    """Longest (or shortest) remaining time first; ties go to a resident next shard.

    Ready jobs sit in a heap keyed by remaining seconds (lazy deletion), so a decision costs
    O(log jobs + num_devices + num_slots). With ``reserve_lookahead`` the job :meth:`lookahead`
    names is reserved for that device: other devices pass it over while they have another ready
    job (an otherwise idle device steals it), so the shard prefetched while the current task
    runs is the one the device runs next. Without it the guess is often wrong on several
    devices (another device takes the job), and the prefetch is wasted.
    """

    _longest: ClassVar[bool]

    def __init__(self, num_devices: int, *, num_slots: int = 1, ewma_alpha: float = 0.2,
                 tie_tolerance_s: float = 0.0, reserve_lookahead: bool = True) -> None:
        super().__init__(num_devices, num_slots=num_slots, ewma_alpha=ewma_alpha)
        self._tie_s = tie_tolerance_s
        self._reserve = reserve_lookahead
        self._heap: list[tuple[float, int, int, _Job]] = []
        self._reserved: list[_Job | None] = [None] * num_devices
        self._keyed_speed = 1.0  # the policy-wide ratio the unmeasured jobs' keys use

    def _became_ready(self, state: _Job) -> None:
        state.version += 1
        state.key_s = state.remaining_s(self._speed)
        key = -state.key_s if self._longest else state.key_s
        heapq.heappush(self._heap, (key, state.seq, state.version, state))

    def _speed_changed(self) -> None:
        """Re-key the waiting jobs that have no measurement once the ratio moved by over 5%."""
        if abs(self._speed - self._keyed_speed) <= 0.05 * self._keyed_speed:
            return
        self._keyed_speed = self._speed
        for state in self._jobs.values():
            if state.ratio is None and state.ready():
                self._became_ready(state)

    def _forget(self, state: _Job) -> None:
        super()._forget(state)
        self._unreserve(state)

    def _unreserve(self, state: _Job) -> None:
        if state.reserved_for is not None:
            self._reserved[state.reserved_for] = None
            state.reserved_for = None

    def _top(self, device: int) -> tuple[_Job | None, _Job | None]:
        """The best ready job free for ``device``, and the best one reserved for another."""
        heap, skipped = self._heap, []
        top = None
        while heap:
            entry = heap[0]
            state = entry[3]
            if entry[2] != state.version:
                heapq.heappop(heap)
            elif state.reserved_for is not None and state.reserved_for != device:
                skipped.append(heapq.heappop(heap))
            else:
                top = state
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return top, skipped[0][3] if skipped else None

    def _choose(self, device: int, cands: list[tuple[float, _Job]]) -> _Job | None:
        """The best of ``cands`` (remaining seconds, job) and the jobs resident on ``device``.

        A tie within the tolerance goes to a job whose next shard is resident on ``device``,
        then to more remaining time, then to the earlier arrival.
        """
        for job_id, shard in self._residency.keys(device):
            other = self._jobs.get(job_id)
            if (other is not None and other.ready() and other.next_shard == shard
                    and other.reserved_for in (None, device)):
                cands.append((other.key_s, other))
        if not cands:
            return None
        sign = 1.0 if self._longest else -1.0
        best_s = max(sign * r for r, _ in cands)
        tol = max(self._tie_s, 1e-9 * abs(best_s))
        best, best_key = None, None
        for r, s in cands:
            if sign * r >= best_s - tol:
                key = (self._resident_next(device, s), sign * r, -s.seq)
                if best_key is None or key > best_key:
                    best, best_key = s, key
        return best

    def _pick(self, device: int) -> _Job | None:
        reserved = self._reserved[device]
        if reserved is not None:
            self._unreserve(reserved)
            if reserved.ready():
                return reserved
        top, other = self._top(device)
        if top is None:  # nothing free for this device: steal another device's reservation
            if other is not None:
                self._unreserve(other)
            return other
        resident = self._residency._where.get((top.spec.job_id, top.next_shard)) == device
        if not resident and self._tied_resident(device, top):
            return self._choose(device, [(top.key_s, top)])
        return top

    def _tied_resident(self, device: int, top: _Job) -> bool:
        """Whether a ready job tied with ``top`` has its next shard on ``device`` (fast path)."""
        jobs, sign = self._jobs, 1.0 if self._longest else -1.0
        floor = sign * top.key_s - max(self._tie_s, 1e-9 * abs(top.key_s))
        for job_id, shard in self._residency._slots[device]:
            other = jobs.get(job_id)
            if (other is not None and other is not top and other.next_shard == shard
                    and other.ready() and sign * other.key_s >= floor
                    and other.reserved_for in (None, device)):
                return True
        return False

    def _lookahead(self, device: int, own: _Job | None) -> _Job | None:
        reserved = self._reserved[device]
        if reserved is not None:
            return reserved
        top, _ = self._top(device)
        cands = [] if top is None else [(top.key_s, top)]
        if own is not None:
            cands.append((own.remaining_s(self._speed), own))
        best = self._choose(device, cands)
        if best is not None and self._reserve:
            best.reserved_for = device
            self._reserved[device] = best
        return best


class ShardedLRTF(_RemainingTimePolicy):
    """Hydra's Sharded-LRTF: a free device runs the ready job with the longest remaining time.

    Hydra (Nagrecha & Kumar, 2022, https://arxiv.org/abs/2110.08633), SHARP with Sharded-LRTF.
    Ties (within ``tie_tolerance_s``, or a relative 1e-9) go to the job whose next shard is
    already resident on the device, which saves a promote; then to the earlier arrival. The job
    :meth:`lookahead` names is reserved for the device (double buffering; see
    ``reserve_lookahead``).

    Example:
        >>> policy = ShardedLRTF(num_devices=1)
        >>> for job_id, step_s in (("short", 1.0), ("long", 5.0)):
        ...     policy.add_job(JobSpec.from_shards(job_id, 1, [step_s], [0.0], [0], [0]))
        >>> policy.next_task(0).job_id
        'long'

    Args:
        num_devices: Devices ``0..num_devices-1``.
        num_slots: Shards a device holds at once.
        ewma_alpha: Weight of the newest measured / estimated ratio.
        tie_tolerance_s: Remaining-time difference in seconds still treated as a tie.
        reserve_lookahead: Reserve the job :meth:`lookahead` names for that device: other
            devices pass it over unless they have nothing else to run. False: the lookahead
            only guesses, and on several devices the prefetched shard is often not the one
            the device runs next.
        pipeline: When ready jobs are fewer than free devices, run whole steps of the
            longest-remaining job that has a
            :class:`~sweepmaster.runtime.scheduling.pipeline.PipelineShape` pipelined over
            several devices (:meth:`next_pipeline`, Harmony PP); as more jobs become ready,
            devices go back to one shard task each. False: never.
    """

    name = "sharded-lrtf"
    _longest = True

    def __init__(self, num_devices: int, *, num_slots: int = 1, ewma_alpha: float = 0.2,
                 tie_tolerance_s: float = 0.0, reserve_lookahead: bool = True,
                 pipeline: bool = False) -> None:
        super().__init__(num_devices, num_slots=num_slots, ewma_alpha=ewma_alpha,
                         tie_tolerance_s=tie_tolerance_s, reserve_lookahead=reserve_lookahead)
        self._pipeline = pipeline

    def _pick_pipeline(self, free: list[int]) -> PipelineDecision | None:
        """Pipeline the longest-remaining ready job that can, when ready jobs < free devices.

        The free devices are shared among the ready jobs, the longest first: it may take
        ``ceil(free / ready)`` of them (the next decision shares what is left among the rest),
        so every other ready job keeps a device. The job must be at a step boundary and have a
        pack layout of at least two packs within that many devices. Its previous devices are
        reused when they are free and still hold its packs (no load), else preferred.
        """
        if not self._pipeline:
            return None
        ready = []
        for state in self._jobs.values():  # running jobs are at most num_devices
            if state.ready():
                ready.append(state)
                if len(ready) >= len(free):
                    return None
        if not ready:
            return None
        ready.sort(key=lambda s: (-s.remaining_s(self._speed), s.seq))
        spare = -(-len(free) // len(ready))
        for state in ready:
            shape, per_step = state.spec.pipeline, len(state.spec.step_tasks)
            if shape is None or state.next_index % per_step:
                continue
            cuts = choose_packs(shape, spare)
            if cuts is None:
                continue
            held, job_id = state.placement, state.spec.job_id
            if held is not None and not all(self._residency.holds(d, (job_id, b - 1))
                                            for d, b in zip(held[0], held[1][1:], strict=True)):
                held = None  # another job ran on one of its devices since: the packs are out
            devices, load = place(free, cuts, held)
            self._unreserve(state)
            for device in devices:
                reserved = self._reserved[device]
                if reserved is not None:
                    self._unreserve(reserved)
            return PipelineDecision(job_id, state.next_index, per_step, devices,
                                    cuts, load, pipeline_step(shape, cuts).seconds)
        return None


class ShortestRemainingFirst(_RemainingTimePolicy):
    """Baseline: a free device runs the ready job with the shortest remaining time.

    Same arguments and tie-break as :class:`ShardedLRTF`.
    """

    name = "shortest-remaining"
    _longest = False


class RandomPolicy(Policy):
    """Baseline: a free device runs the next task of a uniformly random ready job (seeded).

    Args:
        num_devices: Devices ``0..num_devices-1``.
        seed: Seed of the policy's own random generator.
        num_slots: Shards a device holds at once.
        ewma_alpha: Weight of the newest measured / estimated ratio.
    """

    name = "random"

    def __init__(self, num_devices: int, *, seed: int = 0, num_slots: int = 1,
                 ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, num_slots=num_slots, ewma_alpha=ewma_alpha)
        self._rng = random.Random(seed)
        self._ready: list[_Job] = []
        self._pos: dict[str, int] = {}

    def _became_ready(self, state: _Job) -> None:
        self._pos[state.spec.job_id] = len(self._ready)
        self._ready.append(state)

    def _forget(self, state: _Job) -> None:
        super()._forget(state)
        if state.spec.job_id in self._pos:
            self._take(self._pos[state.spec.job_id])

    def _take(self, i: int) -> _Job:
        state, last = self._ready[i], self._ready.pop()
        del self._pos[state.spec.job_id]
        if last is not state:
            self._ready[i] = last
            self._pos[last.spec.job_id] = i
        return state

    def _pick(self, device: int) -> _Job | None:
        return self._take(self._rng.randrange(len(self._ready))) if self._ready else None

    def _lookahead(self, device: int, own: _Job | None) -> _Job | None:
        n = len(self._ready) + (own is not None)
        if n == 0:
            return None
        saved = self._rng.getstate()
        i = self._rng.randrange(n)
        self._rng.setstate(saved)
        return self._ready[i] if i < len(self._ready) else own


class RoundRobin(Policy):
    """Baseline: free devices take one shard task from each ready job in turn (arrival order).

    Args:
        num_devices: Devices ``0..num_devices-1``.
        num_slots: Shards a device holds at once.
        ewma_alpha: Weight of the newest measured / estimated ratio.
    """

    name = "round-robin"

    def __init__(self, num_devices: int, *, num_slots: int = 1, ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, num_slots=num_slots, ewma_alpha=ewma_alpha)
        self._order: list[int] = []  # arrival numbers of ready jobs, sorted
        self._by_seq: dict[int, _Job] = {}
        self._last = -1

    def _became_ready(self, state: _Job) -> None:
        bisect.insort(self._order, state.seq)
        self._by_seq[state.seq] = state

    def _forget(self, state: _Job) -> None:
        super()._forget(state)
        if self._by_seq.pop(state.seq, None) is not None:
            self._order.remove(state.seq)

    def _after_last(self, extra: int | None) -> int | None:
        seqs = self._order if extra is None else sorted([*self._order, extra])
        if not seqs:
            return None
        i = bisect.bisect_right(seqs, self._last)
        return seqs[i if i < len(seqs) else 0]

    def _pick(self, device: int) -> _Job | None:
        seq = self._after_last(None)
        if seq is None:
            return None
        self._order.remove(seq)
        self._last = seq
        return self._by_seq.pop(seq)

    def _lookahead(self, device: int, own: _Job | None) -> _Job | None:
        seq = self._after_last(None if own is None else own.seq)
        if seq is None:
            return None
        return own if own is not None and seq == own.seq else self._by_seq[seq]


class TaskParallelFIFO(Policy):
    """Baseline: task parallelism; each device trains one whole job at a time, first come first.

    A free device without a job takes the earliest-arrived job no device holds and runs only its
    tasks until it finishes or leaves; jobs beyond the device count wait.

    Args:
        num_devices: Devices ``0..num_devices-1``.
        num_slots: Shards a device holds at once.
        ewma_alpha: Weight of the newest measured / estimated ratio.
    """

    name = "task-parallel-fifo"

    def __init__(self, num_devices: int, *, num_slots: int = 1, ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, num_slots=num_slots, ewma_alpha=ewma_alpha)
        self._waiting: dict[str, _Job] = {}  # arrival order
        self._pins: list[_Job | None] = [None] * num_devices

    def _added(self, state: _Job) -> None:
        self._waiting[state.spec.job_id] = state

    def _forget(self, state: _Job) -> None:
        super()._forget(state)
        self._waiting.pop(state.spec.job_id, None)
        self._pins = [None if p is state else p for p in self._pins]

    def _pick(self, device: int) -> _Job | None:
        if self._pins[device] is None and self._waiting:
            self._pins[device] = self._waiting.pop(next(iter(self._waiting)))
        pin = self._pins[device]
        return pin if pin is not None and pin.ready() else None

    def _lookahead(self, device: int, own: _Job | None) -> _Job | None:
        pin = self._pins[device]
        if pin is not None and (pin is own or pin.ready()):
            return pin
        return next(iter(self._waiting.values()), None)


class ModelParallel(Policy):
    """Baseline: model parallelism; one job at a time, its shards pinned across the devices.

    Jobs run one after another in arrival order. Shard ``s`` of the running job always runs on
    device ``s % num_devices``, so consecutive shards sit on different devices as in a pipeline
    and, with ``num_devices * num_slots >= shards``, stay resident. A task covers the whole
    minibatch (input-batch grouping), so there is no micro-batch pipelining: the chain keeps one
    device busy at a time, which is why Hydra rejects plain model parallelism.

    Args:
        num_devices: Devices ``0..num_devices-1``.
        num_slots: Shards a device holds at once.
        ewma_alpha: Weight of the newest measured / estimated ratio.
    """

    name = "model-parallel"

    def __init__(self, num_devices: int, *, num_slots: int = 1, ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, num_slots=num_slots, ewma_alpha=ewma_alpha)
        self._queue: dict[str, _Job] = {}  # arrival order; the first one runs

    def _added(self, state: _Job) -> None:
        self._queue[state.spec.job_id] = state

    def _forget(self, state: _Job) -> None:
        super()._forget(state)
        self._queue.pop(state.spec.job_id, None)

    def _placed_on(self, device: int, state: _Job) -> bool:
        return state.spec.shard_at(state.next_index) % self.num_devices == device

    def _pick(self, device: int) -> _Job | None:
        first = next(iter(self._queue.values()), None)
        if first is not None and first.ready() and self._placed_on(device, first):
            return first
        return None

    def _lookahead(self, device: int, own: _Job | None) -> _Job | None:
        for state in self._queue.values():
            if state.next_index < state.num_tasks:  # not finishing with its running task
                return state if self._placed_on(device, state) else None
        return None


def policy_names() -> dict[str, type[Policy]]:
    """Every policy class by its ``name``."""
    classes: list[type[Policy]] = [ShardedLRTF, TaskParallelFIFO, RoundRobin, RandomPolicy,
                                   ShortestRemainingFirst, ModelParallel]
    return {c.name: c for c in classes}

