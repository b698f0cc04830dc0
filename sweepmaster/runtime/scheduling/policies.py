"""The scheduling policies: SHARP's Sharded-LRTF and the baselines (pure Python, no torch).

Each implements :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`: :class:`ShardedLRTF`
(Hydra's SHARP, optionally pipelining as Harmony), and for comparisons
:class:`ShortestRemainingFirst`, :class:`RandomPolicy`, :class:`RoundRobin`,
:class:`TaskParallelFIFO` (each job to one device until it ends) and :class:`ModelParallel` (one
job at a time over every device).
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from typing import ClassVar

from sweepmaster.runtime.scheduling.pipeline import (
    PipelineDecision,
    choose_packs,
    pipeline_step,
    place,
)
from sweepmaster.runtime.scheduling.scheduler import DeviceBytes, Policy, _Job

__all__ = [
    "ModelParallel", "RandomPolicy", "RoundRobin", "ShardedLRTF", "ShortestRemainingFirst",
    "TaskParallelFIFO", "policy_names",
]


class _RemainingTimePolicy(Policy):
    """Longest (or shortest) remaining time first; ties go to a resident next shard.

    Ready jobs sit in a heap keyed by remaining seconds (lazy deletion), so a decision costs
    O(log jobs + num_devices + shards a device keeps). With ``reserve_lookahead`` the job
    :meth:`lookahead` names is reserved for that device: other devices pass it over while they
    have another ready job (an otherwise idle device steals it), so the shard prefetched while
    the current task runs is the one the device runs next. Without it the guess is often wrong
    on several devices (another device takes the job), and the prefetch is wasted.
    """

    _longest: ClassVar[bool]

    def __init__(self, num_devices: int, *, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2, tie_tolerance_s: float = 0.0,
                 reserve_lookahead: bool = True) -> None:
        super().__init__(num_devices, device_bytes=device_bytes, ewma_alpha=ewma_alpha)
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
        if self._resident_next(device, top):
            return top
        return self._choose(device, [(top.key_s, top)])  # or a tied job resident here

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
        num_devices: As :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`, like
            ``device_bytes`` and ``ewma_alpha``.
        tie_tolerance_s: Remaining-time difference in seconds still treated as a tie.
        reserve_lookahead: Reserve the job :meth:`lookahead` names for that device: other
            devices pass it over unless they have nothing else to run. False: the lookahead
            only guesses (on several devices, often wrongly).
        pipeline: When ready jobs are fewer than free devices, run whole steps of the
            longest-remaining job that has a
            :class:`~sweepmaster.runtime.scheduling.pipeline.PipelineShape` pipelined over
            several devices (:meth:`next_pipeline`, Harmony PP) where that step is predicted
            no longer than its step as shard tasks. False: never.
        host_bytes_per_s: Host <-> device bandwidth of each device's link (bytes/s) at which
            a pipelined step is predicted (its swaps and loads); inf: instant.
        p2p_bytes_per_s: Device -> device bandwidth of a pipelined step's crossings
            (bytes/s); None: no p2p, crossings go through the host.

    Raises:
        ValueError: As :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`, or a
            bandwidth that is not positive.
    """

    name = "sharded-lrtf"
    _longest = True

    def __init__(self, num_devices: int, *, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2, tie_tolerance_s: float = 0.0,
                 reserve_lookahead: bool = True, pipeline: bool = False,
                 host_bytes_per_s: float = math.inf,
                 p2p_bytes_per_s: float | None = math.inf) -> None:
        super().__init__(num_devices, device_bytes=device_bytes, ewma_alpha=ewma_alpha,
                         tie_tolerance_s=tie_tolerance_s, reserve_lookahead=reserve_lookahead)
        if not host_bytes_per_s > 0 or not (p2p_bytes_per_s is None or p2p_bytes_per_s > 0):
            raise ValueError(f"bandwidths must be positive, got host {host_bytes_per_s}, "
                             f"p2p {p2p_bytes_per_s}")
        self._pipeline = pipeline
        self._host_bytes_per_s = host_bytes_per_s
        self._p2p_bytes_per_s = p2p_bytes_per_s

    def _pick_pipeline(self, free: list[int]) -> PipelineDecision | None:
        """Pipeline the longest-remaining ready job that can, when ready jobs < free devices.

        The free devices are shared among the ready jobs, the longest first: it may take
        ``ceil(free / ready)`` of them (the next decision shares what is left among the rest),
        so every other ready job keeps a device. The job must be at a step boundary, and of
        the layouts that fit its share (each pack layout of at most that many packs, one pack
        per device, and the wrap-around layout planned for exactly that many) it takes the one
        whose step :func:`pipeline_step` predicts shortest at the policy's bandwidths, and only
        when that is no longer than its step as shard tasks on one device (its step's tasks'
        estimated seconds; a tie pipelines; :func:`choose_packs`). Both sides' compute is
        scaled by the job's measured / estimated ratio, as its remaining time is; copies are
        not. Else the next job is tried. Its previous devices are reused when they are free
        and still hold its packs (no load), else preferred.
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
            p2p_bytes_per_s = self._p2p_bytes_per_s
            cuts = choose_packs(shape, spare,
                                step_s=sum(t.est_seconds for t in state.spec.step_tasks),
                                speed=state.ratio if state.ratio is not None else self._speed,
                                p2p=p2p_bytes_per_s is not None,
                                host_bytes_per_s=self._host_bytes_per_s,
                                p2p_bytes_per_s=p2p_bytes_per_s or math.inf)
            if cuts is None:
                continue
            held, job_id = state.placement, state.spec.job_id
            if held is not None and not all(self._residency.holds(d, (job_id, b - 1))
                                            for d, b in zip(held[0], held[1][1:], strict=False)):
                held = None  # another job ran on one of its devices since: the packs are out
            devices, load = place(free, cuts, held, spare)
            self._unreserve(state)
            for device in devices:
                reserved = self._reserved[device]
                if reserved is not None:
                    self._unreserve(reserved)
            return PipelineDecision(job_id, state.next_index, per_step, devices,
                                    cuts, load,
                                    pipeline_step(shape, cuts, num_devices=len(devices)).seconds)
        return None


class ShortestRemainingFirst(_RemainingTimePolicy):
    """Baseline: a free device runs the ready job with the shortest remaining time.

    Same arguments and tie-break as :class:`ShardedLRTF`.
    """

    name = "shortest-remaining"
    _longest = False


class RandomPolicy(Policy):
    """Baseline: a free device runs the next task of a uniformly random ready job.

    Arguments as :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`, plus ``seed``, the
    seed of the policy's own random generator.
    """

    name = "random"

    def __init__(self, num_devices: int, *, seed: int = 0, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, device_bytes=device_bytes, ewma_alpha=ewma_alpha)
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

    Arguments as :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`.
    """

    name = "round-robin"

    def __init__(self, num_devices: int, *, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, device_bytes=device_bytes, ewma_alpha=ewma_alpha)
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
    tasks until it finishes or leaves; jobs beyond the device count wait. Arguments as
    :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`.
    """

    name = "task-parallel-fifo"

    def __init__(self, num_devices: int, *, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, device_bytes=device_bytes, ewma_alpha=ewma_alpha)
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
    (a shard stays resident only as the residency cache's rule says: its job's next task is of
    the same shard). A task covers the whole
    minibatch (input-batch grouping), so there is no micro-batch pipelining: the chain keeps one
    device busy at a time, which is why Hydra rejects plain model parallelism. Arguments as
    :class:`~sweepmaster.runtime.scheduling.scheduler.Policy`.
    """

    name = "model-parallel"

    def __init__(self, num_devices: int, *, device_bytes: DeviceBytes = None,
                 ewma_alpha: float = 0.2) -> None:
        super().__init__(num_devices, device_bytes=device_bytes, ewma_alpha=ewma_alpha)
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
