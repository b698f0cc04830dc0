"""The SHARP policy interface (pure Python, no torch).

Hydra (Nagrecha & Kumar, 2022, https://arxiv.org/abs/2110.08633) interleaves the shard tasks of
many spilled models (:mod:`~sweepmaster.runtime.scheduling.chains`) on few devices: SHARP. Every
policy (:mod:`~sweepmaster.runtime.scheduling.policies`) implements :class:`Policy`, so one object
drives the simulator (:mod:`~sweepmaster.runtime.scheduling.simulate`) and the real executor.
A policy keeps its belief of which shards each device holds by the residency cache's rule
(:class:`~sweepmaster.runtime.scheduling.residency.Residency`). Devices are the integers
``0..num_devices-1``; the caller maps them to real devices.

Example:
    >>> from sweepmaster.runtime.scheduling.chains import JobSpec
    >>> from sweepmaster.runtime.scheduling.policies import ShardedLRTF
    >>> policy = ShardedLRTF(num_devices=2)
    >>> policy.add_job(JobSpec.from_shards("a", 1, [1.0, 1.0], [2.0, 2.0], [4, 4], [12, 12]))
    >>> task = policy.next_task(0)
    >>> (task.job_id, task.index, task.shard, task.kind)
    ('a', 0, 0, 'forward')
    >>> policy.task_done(task, measured_s=1.0)
    False
"""
from __future__ import annotations

import itertools
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.scheduling.pipeline import PipelineDecision
from sweepmaster.runtime.scheduling.residency import Residency

__all__ = ["DeviceBytes", "Policy"]

#: Per device (or one for all) the bytes its tasks and kept shards share; ``None``: unbounded.
DeviceBytes = Sequence[float] | float | None


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

    def remaining_s(self, speed: float, first: int | None = None) -> float:
        """Estimated seconds of its tasks from ``first`` (default: its next), corrected.

        The correction is its measured ratio, else ``speed``, the policy-wide ratio.
        """
        ratio = self.ratio if self.ratio is not None else speed
        return self.spec.remaining_est_s(self.next_index if first is None else first) * ratio


class Policy(ABC):
    """A SHARP scheduling policy: which job's next shard task a free device runs.

    Contract: a job runs on at most one device at a time and its tasks run in dependency order;
    a device runs one task at a time (call :meth:`task_done` before asking for its next task).
    The one exception is a pipelined step (:meth:`next_pipeline`, Harmony PP): a whole step of
    one job on several devices at once, which occupies them until :meth:`pipeline_done`.
    Every public method takes the one lock and returns quickly, so worker threads of an executor
    may call them concurrently; none blocks waiting for work (:meth:`next_task` returns None).

    Remaining time of a job = estimated seconds of its unfinished tasks x an EWMA of its measured
    / estimated task seconds; a job that has not run yet takes the EWMA over every job's tasks
    (a cost model that is off is off for every job). Residency, the policy's belief of which
    shards each device holds (:class:`~sweepmaster.runtime.scheduling.residency.Residency`, the
    executor's rule on the tasks' planned peaks and shard bytes), breaks ties.

    Args:
        num_devices: Devices ``0..num_devices-1``.
        device_bytes: Per device (or one for all), the bytes its tasks and kept shards share
            (the device budget); ``None``: unbounded.
        ewma_alpha: Weight of the newest measurement in the measured / estimated ratio.

    Raises:
        ValueError: ``num_devices < 1``, ``device_bytes`` not one positive size per device, or
            ``ewma_alpha`` not in (0, 1].
    """

    name: ClassVar[str]

    def __init__(self, num_devices: int, *, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2) -> None:
        if num_devices < 1 or not 0 < ewma_alpha <= 1:
            raise ValueError(f"need num_devices >= 1 and 0 < ewma_alpha <= 1, "
                             f"got {num_devices}, {ewma_alpha}")
        if device_bytes is None or isinstance(device_bytes, int | float):
            device_bytes = [math.inf if device_bytes is None else device_bytes] * num_devices
        if len(device_bytes) != num_devices:
            raise ValueError(f"need one size per device, got {len(device_bytes)} for "
                             f"{num_devices} devices")
        self.num_devices = num_devices
        #: Per device, the bytes its tasks and kept shards share (the residency's capacity).
        self.device_bytes = tuple(device_bytes)
        self._alpha = ewma_alpha
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._speed = 1.0  # EWMA of measured / estimated seconds over every job's tasks
        self._num_measured = 0
        self._running: list[TaskSpec | None] = [None] * num_devices
        self._piped: list[PipelineDecision | None] = [None] * num_devices
        self._residency = Residency(self.device_bytes)
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

        A task of it still running keeps its device busy until :meth:`task_done`. Returns
        whether the job was scheduled (False for unknown, finished or removed jobs).
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

    def extend_job(self, job: JobSpec) -> None:
        """Give a scheduled job a longer chain: the same tasks so far, more after them.

        A fused array a member joined trains for more steps than its chain said (refill); its
        tasks handed out so far keep their indices, and the new ones are scheduled like any.

        Raises:
            ValueError: The job is not scheduled, or the chain is not longer.
        """
        with self._lock:
            state = self._jobs.get(job.job_id)
            if state is None or state.removed:
                raise ValueError(f"job {job.job_id!r} is not scheduled")
            if job.num_tasks <= state.num_tasks:
                raise ValueError(f"job {job.job_id!r} has {state.num_tasks} tasks; a chain of "
                                 f"{job.num_tasks} does not extend it")
            state.spec, state.num_tasks = job, job.num_tasks
            state.next_shard = job.shard_at(state.next_index)
            if state.ready():
                self._became_ready(state)

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
            self._advance(state, 1, device)
            self._running[device] = task
            self._residency.task_starts(device, task)
            return task

    def task_done(self, task: TaskSpec, measured_s: float | None = None) -> bool:
        """Record that ``task`` ended (or failed); its device is free and its job ready.

        Args:
            task: The task :meth:`next_task` returned.
            measured_s: Its measured compute seconds; refines the job's remaining time.

        Returns:
            Whether that was the job's last task (it finished and left the policy).

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
            following = (state.spec.task(state.next_index)  # a removed job has none
                         if not state.removed and state.next_index < state.num_tasks else None)
            self._residency.task_ended(device, task, following)
            return self._release(state)

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
            self._advance(state, decision.num_tasks, decision.devices[0])
            state.placement = (decision.devices, decision.cuts)
            shape = state.spec.pipeline
            for device, pack in zip(decision.devices, decision.packs, strict=True):
                self._piped[device] = decision
                self._residency.make_room(device, (decision.job_id, pack[0]), None)
                for shard in pack:
                    num_bytes = 0 if shape is None else shape.state_bytes[shard]
                    self._residency.keep(device, (decision.job_id, shard), num_bytes)
            return decision

    def pipeline_done(self, decision: PipelineDecision) -> bool:
        """Record that a pipelined step ended (flushed); its devices are free, its job ready.

        Returns whether that was the job's last step, as :meth:`task_done`.

        Raises:
            ValueError: ``decision`` is not running.
        """
        with self._lock:
            state = self._jobs.get(decision.job_id)
            if state is None or any(self._piped[d] is not decision for d in decision.devices):
                raise ValueError(f"{decision} is not running")
            for device in decision.devices:
                self._piped[device] = None
            return self._release(state)

    def pipelined(self, device: int) -> PipelineDecision | None:
        """The pipelined step ``device`` takes part in, or None."""
        with self._lock:
            return self._piped[device]

    def lookahead(self, device: int) -> TaskSpec | None:
        """The task ``device`` will likely run next, so its shard can be prefetched.

        Hydra's double buffering: while the current task runs, the next one's shard is
        promoted. :class:`ShardedLRTF` (by default) reserves the named job for ``device``, so
        its :meth:`next_task` returns that task unless an otherwise idle device took the job;
        the baselines only guess. None when no guess can be made.
        """
        with self._lock:
            running = self._running[device]
            own = None if running is None else self._jobs.get(running.job_id)
            if own is not None and (own.removed or own.next_index >= own.num_tasks):
                own = None
            state = self._lookahead(device, own)
            return None if state is None else state.spec.task(state.next_index)

    def prefetched(self, device: int, task: TaskSpec) -> None:
        """Record that ``task``'s shard was promoted onto ``device`` ahead of time.

        The policy then believes the device holds it (it breaks ties toward that task); the
        task's :meth:`next_task` makes room for it as for any.
        """
        with self._lock:
            if task.job_id in self._jobs:
                self._residency.keep(device, (task.job_id, task.shard), task.promote_bytes)

    def evicted(self, device: int, job_id: str, shard: int) -> None:
        """Record that ``device`` no longer holds the shard (demoted, not kept resident).

        The executor reports what its residency cache did not keep or evicted, so the policy's
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
            return state.remaining_s(self._speed, first)

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

    def _advance(self, state: _Job, num_tasks: int, device: int) -> None:
        """Hand out the job's next ``num_tasks`` tasks; it runs on ``device``."""
        state.next_index += num_tasks
        if state.next_index < state.num_tasks:
            state.next_shard = state.spec.shard_at(state.next_index)
        state.version += 1
        state.device = device

    def _release(self, state: _Job) -> bool:
        """The job's running task (or step) ended: drop it if removed or done, else ready it."""
        state.device = None
        if state.removed or state.next_index >= state.num_tasks:
            del self._jobs[state.spec.job_id]
            if state.removed:
                return False
            self._forget(state)
            return True
        self._became_ready(state)
        return False

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
