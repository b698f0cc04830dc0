"""Discrete-event simulation of SHARP: any scheduling policy on devices with cost models.

The simulator plays the executor's part for a
:class:`~sweepmaster.runtime.scheduling.scheduler.Policy` (Hydra, Nagrecha & Kumar, 2022,
https://arxiv.org/abs/2110.08633): free devices ask :meth:`~Policy.next_task`, finished tasks are
reported with :meth:`~Policy.task_done`, and with prefetch each device promotes the shard its
:meth:`~Policy.lookahead` names while it computes. So a simulated makespan comes from the same
scheduling code as a real one. What it is given and what it measures are
:mod:`~sweepmaster.runtime.scheduling.sim_model`; costs measured in a real run,
:mod:`~sweepmaster.runtime.scheduling.durations`.

Cost model (:class:`~sweepmaster.runtime.scheduling.sim_model.CostModel`):
    * compute: :meth:`~sweepmaster.runtime.scheduling.sim_model.CostModel.task_s` seconds;
    * promote: ``(promote_bytes + other_promote_bytes) / bandwidth`` before the task, less
      what the device holds of the shard's ``promote_bytes`` (kept from the job's task before,
      or brought in by a prefetch into a buffer beside the running task that the device's
      next task takes or drops). What the devices hold is the executor's residency cache
      (:class:`~sweepmaster.runtime.scheduling.residency.Residency`, the same rule on the tasks'
      ``peak_bytes``, ``state_bytes`` and ``kept_bytes`` with the policy's ``device_bytes`` as
      capacities);
    * demote: ``demote_bytes / bandwidth`` right after the task; a later promote of that shard
      (on any device) waits for it;
    * write-back: a shard that stays for its job's next task keeps its ``kept_bytes`` on the
      device (its optimizer state too when that task updates it: a job of one shard between
      its steps) and what its tasks changed of them (the last changing task's
      ``write_back_bytes``) goes home once, on the device's link, when it leaves: evicted by
      another task's room, its job's next task on another device or of another shard (then
      right after the task), a pipelined step of its job. So a job of one shard kept across
      its steps moves weights and state once each way, as the executor does;
    * each device has one FIFO host link per direction (PCIe is full duplex);
    * a pipelined step (:meth:`~Policy.next_pipeline`, Harmony PP) takes its devices for
      :func:`~sweepmaster.runtime.scheduling.pipeline.pipeline_step` seconds, the policy's own
      cost model: loading the packs when they are not held, then the flow of the microbatches.
      Its boundary copies go device -> device at ``p2p_bytes_per_s`` (counted in ``p2p_bytes``,
      not in the swap volume), or through the host without p2p. With more packs than devices
      (wrap-around) each device's swaps of its packs are host bytes of the step (the same
      model's, per device). Each device's first pack stays on it while the job's next steps
      run there; when it runs elsewhere (or finishes) they are written back, on the devices'
      links, before any promote of its shards;
    * the activations a memory plan (mu-TWO) swaps are task bytes like the others; their overlap
      with the task's compute is in its seconds, not on the links.

With the chains of :func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`
(:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`), the bytes moved on each device
equal what the executor's devices count
(:class:`~sweepmaster.runtime.devices.device.TransferStats`) when both run the same tasks on the
same devices in the same order with the same shards kept resident. Equal-time events run in a
fixed order (task ends, removals, arrivals, then free devices in index order).

Example:
    >>> from sweepmaster.runtime.scheduling.chains import JobSpec
    >>> from sweepmaster.runtime.scheduling.policies import ShardedLRTF
    >>> jobs = [JobSpec.from_shards(j, 1, [1.0], [1.0], [0], [0]) for j in "abc"]
    >>> simulate(ShardedLRTF(2), jobs).makespan_s
    4.0
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from typing import NamedTuple

from sweepmaster.runtime.scheduling.chains import JobSpec, ShardKey, TaskSpec
from sweepmaster.runtime.scheduling.pipeline import (
    PipelineDecision,
    PipelineShape,
    pipeline_step,
    pipeline_unload,
)
from sweepmaster.runtime.scheduling.residency import Residency
from sweepmaster.runtime.scheduling.scheduler import Policy
from sweepmaster.runtime.scheduling.sim_model import (
    Arrival,
    CostModel,
    GanttEntry,
    Removal,
    SimResult,
)

__all__ = ["simulate"]

_END, _REMOVE, _ARRIVE = 0, 1, 2  # order of equal-time events


class _Done(NamedTuple):
    """Payload of a task-end event: ``demote_bytes`` are copied device -> host at its end."""

    device: int
    task: TaskSpec
    compute_s: float
    end_s: float
    demote_bytes: int


class _PipeDone(NamedTuple):
    """Payload of a pipelined step's end."""

    decision: PipelineDecision


class _Sim:
    """One simulation run's state."""

    def __init__(self, policy: Policy, cost: CostModel) -> None:
        n = policy.num_devices
        self.policy, self.cost = policy, cost
        self.events: list[tuple[float, int, int, object]] = []
        self.order = itertools.count()
        self.truth = Residency(policy.device_bytes)  # what the devices really hold
        # (time the copy is complete, bytes on the device) of each held shard
        self.loaded: dict[tuple[int, ShardKey], tuple[float, int]] = {}
        self.host_ready: dict[ShardKey, float] = {}
        self.up_free = [0.0] * n  # host -> device link
        self.down_free = [0.0] * n  # device -> host link
        self.running: list[ShardKey | None] = [None] * n
        # (shard, time the copy is complete, bytes) prefetched since the device's last task
        self.prefetch: list[tuple[ShardKey, float, int] | None] = [None] * n
        # kept shard -> (its device, bytes it writes back when it leaves, its last task's index)
        self.dirty: dict[ShardKey, tuple[int, int, int]] = {}
        self.device_promote = [0] * n
        self.device_demote = [0] * n
        self.busy_s = [0.0] * n
        self.removed: set[str] = set()
        self.completion: dict[str, float] = {}
        self.gantt: list[GanttEntry] = []
        self.transfers: list[GanttEntry] = []
        self.promote_bytes = self.demote_bytes = self.num_promotes = self.hits = 0
        self.p2p_bytes = 0
        self.end_s = 0.0
        # job -> (its pipeline shape, the decision whose packs its devices still hold)
        self.held: dict[str, tuple[PipelineShape, PipelineDecision]] = {}
        self.pipelined: dict[str, list[PipelineDecision]] = {}
        self.specs: dict[str, JobSpec] = {}

    def push(self, time_s: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (time_s, kind, next(self.order), payload))

    def transfer(self, device: int, key: ShardKey, index: int, earliest_s: float,
                 num_bytes: int, kind: str, shard: bool = True) -> float:
        """Queue a copy of ``key``'s task ``index`` on ``device``'s link; return when it ends.

        ``shard``: a promote that brings the task's shard (counted in ``num_promotes``).
        """
        if kind == "demote":
            start = max(earliest_s, self.down_free[device])
            self.demote_bytes += num_bytes
            self.device_demote[device] += num_bytes
        else:
            start = max(earliest_s, self.up_free[device], self.host_ready.get(key, 0.0))
            self.promote_bytes += num_bytes
            self.device_promote[device] += num_bytes
            self.num_promotes += shard
        end = start + num_bytes / self.cost.bandwidth_bytes_per_s
        if kind == "demote":
            self.down_free[device] = end
        else:
            self.up_free[device] = end
        self.transfers.append(GanttEntry(device, key[0], index, start, end, kind))
        return end

    def write_back(self, key: ShardKey, now: float) -> None:
        """Copy what the kept shard ``key`` changed back to the host as it leaves its device."""
        if key not in self.dirty:
            return
        device, num_bytes, index = self.dirty.pop(key)
        if num_bytes:
            self.host_ready[key] = self.transfer(device, key, index, now, num_bytes, "demote")
            self.end_s = max(self.end_s, self.host_ready[key])

    def unload(self, job_id: str, now: float) -> float:
        """Write back the packs a job's devices hold, if any; return when that ends."""
        if job_id not in self.held:
            return now
        shape, decision = self.held.pop(job_id)
        _, num_bytes = pipeline_unload(shape, decision.cuts,
                                       num_devices=len(decision.devices))
        done = now
        for device, pack, pack_bytes in zip(decision.devices, decision.packs, num_bytes,
                                            strict=True):
            for shard in pack:
                self.truth.discard(device, (job_id, shard))
            start = max(now, self.down_free[device])
            end = start + pack_bytes / self.cost.bandwidth_bytes_per_s
            self.down_free[device] = end
            self.demote_bytes += pack_bytes
            self.device_demote[device] += pack_bytes
            self.transfers.append(GanttEntry(device, job_id, decision.first_index, start, end,
                                             "demote"))
            for shard in pack:
                self.host_ready[(job_id, shard)] = end
            done = max(done, end)
        self.end_s = max(self.end_s, done)
        return done

    def start_pipeline(self, decision: PipelineDecision, now: float) -> None:
        job_id = decision.job_id
        shape = self.specs[job_id].pipeline
        assert shape is not None, "a policy pipelined a job without a pipeline shape"
        if decision.load:
            self.unload(job_id, now)
        for key in [k for k in self.dirty if k[0] == job_id]:  # its kept shards go home first
            self.write_back(key, now)
        cost, bandwidth = self.cost, self.cost.bandwidth_bytes_per_s
        step = pipeline_step(shape, decision.cuts, num_devices=len(decision.devices),
                             p2p=cost.p2p_bytes_per_s is not None,
                             host_bytes_per_s=bandwidth,
                             p2p_bytes_per_s=cost.p2p_bytes_per_s or math.inf)
        ready = now  # the packs are on their devices, each loaded over its own link
        for p, (device, pack) in enumerate(zip(decision.devices, decision.packs, strict=True)):
            up, down = step.device_host_bytes[p]
            if decision.load:
                load = sum(shape.state_bytes[s] for s in pack)
                start = max([now, self.up_free[device],
                             *(self.host_ready.get((job_id, s), 0.0) for s in pack)])
                end = start + load / bandwidth
                self.up_free[device] = end
                self.transfers.append(GanttEntry(device, job_id, decision.first_index, start,
                                                 end, "promote"))
                self.promote_bytes += load
                self.device_promote[device] += load
                self.num_promotes += len(pack)
                ready = max(ready, end)
            self.promote_bytes += up
            self.device_promote[device] += up
            self.demote_bytes += down
            self.device_demote[device] += down
            self.evict(device, self.truth.make_room(device, (job_id, pack[0]), None), now)
            for shard in pack:
                key = (job_id, shard)
                self.truth.keep(device, key, shape.state_bytes[shard])
                self.loaded[(device, key)] = (now, shape.state_bytes[shard])
        self.p2p_bytes += step.p2p_bytes
        end = ready + step.seconds
        for device, pack, shards in zip(decision.devices, decision.packs, decision.lane_shards,
                                        strict=True):
            self.running[device] = (job_id, pack[0])
            self.prefetch[device] = None  # the pack takes the device's memory
            self.busy_s[device] += sum(shape.forward_s[s] + shape.backward_s[s] for s in shards)
            self.gantt.append(GanttEntry(device, job_id, decision.first_index, now, end,
                                         "pipeline"))
        self.held[job_id] = (shape, decision)
        self.pipelined.setdefault(job_id, []).append(decision)
        self.end_s = max(self.end_s, end)
        self.push(end, _END, _PipeDone(decision))

    def end_pipeline(self, decision: PipelineDecision, now: float) -> None:
        for device in decision.devices:
            self.running[device] = None
        finished = self.policy.pipeline_done(decision)
        if decision.job_id in self.removed:
            self.held.pop(decision.job_id, None)
            return
        if finished:
            self.completion[decision.job_id] = self.unload(decision.job_id, now)
            self.truth.drop_job(decision.job_id)

    def start(self, device: int, task: TaskSpec, now: float) -> None:
        key = (task.job_id, task.shard)
        self.unload(task.job_id, now)
        if key in self.dirty and self.dirty[key][0] != device:  # kept elsewhere: home first
            self.write_back(key, now)
        fetched, self.prefetch[device] = self.prefetch[device], None
        held = self.truth.holds(device, key)
        self.evict(device, self.truth.task_starts(device, task), now)
        if fetched is not None and fetched[0] == key:
            _, have_at, have = fetched
        elif held:
            have_at, have = self.loaded[(device, key)]
        else:
            have_at, have = now, 0
        self.hits += fetched is not None and fetched[0] == key
        need = max(0, task.promote_bytes - have)
        if need or task.other_promote_bytes:
            done = self.transfer(device, key, task.index, now, need + task.other_promote_bytes,
                                 "promote", shard=need > 0)
            have_at = max(have_at, done)
        self.loaded[(device, key)] = (have_at, max(have, task.promote_bytes))
        self.running[device] = key
        compute_s = self.cost.task_s(task)
        ready = max(now, have_at)
        end = ready + compute_s
        self.busy_s[device] += compute_s
        self.gantt.append(GanttEntry(device, task.job_id, task.index, ready, end, task.kind))
        self.end_s = max(self.end_s, end)
        # what the shard holds changed (the last changing task's): home when it leaves
        _, before, _ = self.dirty.pop(key, (device, 0, task.index))
        changed = task.write_back_bytes or before
        demote = task.demote_bytes
        if Residency.stays(task, self.following(task)):
            self.dirty[key] = (device, changed, task.index)
        else:
            demote += changed
        free = end
        if not self.cost.prefetch and demote:
            free = self.demote(device, task, end, demote)
        self.push(free, _END, _Done(device, task, compute_s, end, demote))

    def following(self, task: TaskSpec) -> TaskSpec | None:
        """The next task of ``task``'s job (``None``: it is the last, or the job was removed)."""
        spec = self.specs[task.job_id]
        if task.job_id in self.removed or task.index + 1 >= spec.num_tasks:
            return None
        return spec.task(task.index + 1)

    def evict(self, device: int, keys: list[ShardKey], now: float) -> None:
        """Forget what ``device`` held of the evicted ``keys``, writing back what changed."""
        for key in keys:
            self.loaded.pop((device, key), None)
            self.write_back(key, now)

    def demote(self, device: int, task: TaskSpec, end: float, num_bytes: int) -> float:
        key = (task.job_id, task.shard)
        done = self.transfer(device, key, task.index, end, num_bytes, "demote")
        self.host_ready[key] = done
        self.end_s = max(self.end_s, done)
        return done

    def try_prefetch(self, device: int, now: float) -> None:
        task = self.policy.lookahead(device)
        if task is None:
            return
        key = (task.job_id, task.shard)
        if key in self.running or task.job_id in self.held:  # in use, or its packs are out
            return
        held = self.truth.holds(device, key)
        need = task.promote_bytes - (self.loaded[(device, key)][1] if held else 0)
        if need <= 0:
            return
        end = self.transfer(device, key, task.index, now, need, "prefetch")
        self.prefetch[device] = (key, end, task.promote_bytes)  # a buffer beside the task
        self.policy.prefetched(device, task)

    def end(self, device: int, task: TaskSpec, compute_s: float, end: float, now: float,
            demote: int) -> None:
        self.running[device] = None
        finished = self.policy.task_done(task, measured_s=compute_s)
        key = (task.job_id, task.shard)
        kept = self.truth.task_ended(device, task, self.following(task))
        if kept is None:
            self.loaded.pop((device, key), None)
        else:
            self.loaded[(device, key)] = (self.loaded[(device, key)][0], kept)
        if task.job_id in self.removed:
            return
        done = now
        if self.cost.prefetch and demote:
            done = self.demote(device, task, end, demote)
        if finished:
            self.completion[task.job_id] = done
            self.truth.drop_job(task.job_id)

    def run(self) -> None:
        policy, n = self.policy, self.policy.num_devices
        while self.events:
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, kind, _, payload = heapq.heappop(self.events)
                if isinstance(payload, _Done):
                    self.end(payload.device, payload.task, payload.compute_s, payload.end_s, now,
                             payload.demote_bytes)
                elif isinstance(payload, _PipeDone):
                    self.end_pipeline(payload.decision, now)
                elif kind == _REMOVE:
                    assert isinstance(payload, str)
                    if policy.remove_job(payload):
                        self.removed.add(payload)
                        self.truth.drop_job(payload)
                        self.held.pop(payload, None)
                        for key in [k for k in self.dirty if k[0] == payload]:
                            del self.dirty[key]  # its changes are dropped with it
                else:
                    assert isinstance(payload, JobSpec)
                    policy.add_job(payload)
                    self.specs[payload.job_id] = payload
            while (decision := policy.next_pipeline()) is not None:
                self.start_pipeline(decision, now)
            for device in range(n):
                if self.running[device] is None:
                    task = policy.next_task(device)
                    if task is not None:
                        self.start(device, task, now)
            if self.cost.prefetch and self.cost.bandwidth_bytes_per_s < math.inf:
                for device in range(n):
                    if self.prefetch[device] is None and policy.pipelined(device) is None:
                        self.try_prefetch(device, now)



def simulate(
    policy: Policy, jobs: Iterable[JobSpec | Arrival], cost: CostModel | None = None,
    removals: Iterable[Removal] = (),
) -> SimResult:
    """Run ``jobs`` (arriving at 0, or :class:`Arrival` s) under ``policy`` in simulated time.

    ``policy`` is fresh (no jobs yet); its ``num_devices`` and ``device_bytes`` define the
    devices.
    ``cost`` defaults to 16 GB/s links with prefetch; ``removals`` remove jobs before their end.

    Raises:
        ValueError: The policy already has jobs, or a time is negative or not finite.
        RuntimeError: The policy left jobs unfinished with no device busy (a policy bug).
    """
    if policy.job_ids():
        raise ValueError("simulate needs a fresh policy without jobs")
    sim = _Sim(policy, cost if cost is not None else CostModel())
    for item in jobs:
        arrival = item if isinstance(item, Arrival) else Arrival(0.0, item)
        if not 0 <= arrival.time_s < math.inf:
            raise ValueError(f"arrival time must be finite and >= 0, got {arrival.time_s}")
        sim.push(arrival.time_s, _ARRIVE, arrival.job)
    for removal in removals:
        if not 0 <= removal.time_s < math.inf:
            raise ValueError(f"removal time must be finite and >= 0, got {removal.time_s}")
        sim.push(removal.time_s, _REMOVE, removal.job_id)
    sim.run()
    if policy.job_ids():
        raise RuntimeError(f"{type(policy).__name__} left jobs unfinished: {policy.job_ids()}")
    makespan = sim.end_s
    return SimResult(
        makespan_s=makespan, busy_s=tuple(sim.busy_s),
        utilization=tuple(b / makespan if makespan > 0 else 0.0 for b in sim.busy_s),
        swap_bytes=sim.promote_bytes + sim.demote_bytes, promote_bytes=sim.promote_bytes,
        demote_bytes=sim.demote_bytes, device_promote_bytes=tuple(sim.device_promote),
        device_demote_bytes=tuple(sim.device_demote), num_promotes=sim.num_promotes,
        num_prefetch_hits=sim.hits, completion_s=sim.completion, gantt=tuple(sim.gantt),
        transfers=tuple(sim.transfers), p2p_bytes=sim.p2p_bytes,
        num_pipelined_steps=sum(len(d) for d in sim.pipelined.values()),
        pipelined_steps={job: tuple(d) for job, d in sim.pipelined.items()},
    )
