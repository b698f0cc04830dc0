"""Discrete-event simulator: hand-computed makespans, transfers, prefetch, arrivals, removals."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import defaultdict

import pytest

from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.scheduling.durations import recorded_durations
from sweepmaster.runtime.scheduling.policies import (
    ModelParallel,
    RoundRobin,
    ShardedLRTF,
    TaskParallelFIFO,
    policy_names,
)
from sweepmaster.runtime.scheduling.sim_model import Arrival, CostModel, Removal, SimResult
from sweepmaster.runtime.scheduling.simulate import simulate
from tests.kit.policies import each_policy

FREE = CostModel(bandwidth_bytes_per_s=math.inf)


def job(job_id: str, *shard_s: float, num_steps: int = 1) -> JobSpec:
    """A job whose shards' forward + backward together take ``shard_s`` (1/3 forward)."""
    n = len(shard_s)
    return JobSpec.from_shards(job_id, num_steps, [s / 3 for s in shard_s],
                               [2 * s / 3 for s in shard_s], [4] * n, [12] * n)


def single(job_id: str, seconds: float) -> JobSpec:
    return JobSpec.from_shards(job_id, 1, [seconds], [0.0], [0], [0])


def check_timeline(result: SimResult, jobs: dict[str, JobSpec], removed=frozenset()):
    per_device, per_job = defaultdict(list), defaultdict(list)
    for g in result.gantt:
        per_device[g.device].append((g.start_s, g.end_s))
        per_job[g.job_id].append((g.task_index, g.start_s, g.end_s))
    for bars in per_device.values():  # one task per device at a time
        bars.sort()
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(bars, bars[1:], strict=False))
    for job_id, bars in per_job.items():  # a job's tasks in order, never overlapping
        assert [i for i, _, _ in bars] == list(range(len(bars)))
        assert all(a[2] <= b[1] + 1e-12 for a, b in zip(bars, bars[1:], strict=False))
        if job_id not in removed:
            assert len(bars) == jobs[job_id].num_tasks
    assert sum(result.busy_s) == pytest.approx(sum(g.end_s - g.start_s for g in result.gantt))


def test_three_single_task_jobs_on_two_devices():
    result = simulate(ShardedLRTF(2), [single("a", 3.0), single("b", 2.0), single("c", 1.0)],
                      FREE)
    assert result.makespan_s == 3.0
    assert [(g.device, g.job_id, g.start_s, g.end_s) for g in result.gantt] == [
        (0, "a", 0.0, 3.0), (1, "b", 0.0, 2.0), (1, "c", 2.0, 3.0)]
    assert result.utilization == (1.0, 1.0)
    assert result.completion_s == {"a": 3.0, "b": 2.0, "c": 3.0}


def test_fifo_task_parallel_makespan_by_hand():
    # FIFO pins a (two 1 s steps) to device 0 and b (4 s) to device 1; c (2.5 s) waits for
    # device 0: 2 + 2.5 = 4.5. LRTF runs b and c first, then a's steps on device 1 from 2.5: 4.5.
    jobs = [JobSpec.from_shards("a", 2, [0.5], [0.5], [0], [0]), single("b", 4.0),
            single("c", 2.5)]
    assert simulate(TaskParallelFIFO(2), jobs, FREE).makespan_s == 4.5
    assert simulate(ShardedLRTF(2), jobs, FREE).makespan_s == 4.5
    jobs[2] = single("c", 2.0)
    assert simulate(TaskParallelFIFO(2), jobs, FREE).makespan_s == 4.0


def test_spilled_job_with_transfers_serial_and_prefetched():
    # Tasks: forward shard 0 (1 s, promote 2 B), last shard 1 (3 s, 4 B in and out),
    # backward shard 0 (2 s; 4 B in, not resident: the job's task after the forward was
    # another shard's; 4 B out).
    spilled = JobSpec.from_shards("a", 1, [1.0, 1.0], [2.0, 2.0], [2, 2], [4, 4])
    serial = simulate(ShardedLRTF(1), [spilled], CostModel(1.0, prefetch=False))
    # promote 0-2, fwd 2-3, promote 3-7, last 7-10, demote 10-14, promote 14-18, bwd 18-20,
    # demote 20-24
    assert serial.makespan_s == 24.0
    assert [(g.start_s, g.end_s) for g in serial.gantt] == [(2.0, 3.0), (7.0, 10.0), (18.0, 20.0)]
    assert (serial.promote_bytes, serial.demote_bytes, serial.num_promotes) == (10, 8, 3)
    assert serial.swap_bytes == 18
    overlapped = simulate(ShardedLRTF(1), [spilled], CostModel(1.0, prefetch=True))
    # promote 0-2, fwd 2-3 | prefetch shard 1 2-6, last 6-9 | prefetch shard 0 6-10,
    # bwd 10-12 | demotes 9-13 and 13-17
    assert overlapped.makespan_s == 17.0
    assert [(g.start_s, g.end_s) for g in overlapped.gantt] == [(2.0, 3.0), (6.0, 9.0),
                                                                (10.0, 12.0)]
    assert overlapped.num_prefetch_hits == 2 and overlapped.swap_bytes == 18
    assert [g.kind for g in overlapped.transfers] == ["promote", "prefetch", "prefetch",
                                                      "demote", "demote"]


def test_resident_unspilled_job_promotes_once():
    result = simulate(ShardedLRTF(1), [job("a", 3.0, num_steps=4)], CostModel(12.0))
    assert result.num_promotes == 1 and result.promote_bytes == 12
    assert result.demote_bytes == 4 * 12  # write-through after every step
    assert result.makespan_s == pytest.approx(1.0 + 4 * 3.0 + 1.0)


@pytest.mark.parametrize(("device_bytes", "peak_bytes", "num_promotes"),
                         [(24, 10, 10), (20, 10, 12), (None, 10, 10), (100, None, 12)])
def test_jobs_keep_shards_beside_each_other_while_the_bytes_fit(
    device_bytes, peak_bytes, num_promotes
):
    # a and b interleave (round-robin) on one device: a.f0 b.f0 a.b1 b.b1 a.b0 b.b0 a.f0 ...
    # Each keeps its shard 0 (12 B: its backward's promote) from its backward to its next
    # forward. A task of 10 B peak needs 11.5 B with the margin: beside the other's 12 B it
    # fits 24 B, not 20 B; a task of unknown peak takes the device.
    jobs = [JobSpec(j.job_id, tuple(dataclasses.replace(t, peak_bytes=peak_bytes)
                                    for t in j.step_tasks), j.num_steps)
            for j in (job("a", 1.0, 1.0, num_steps=2), job("b", 1.0, 1.0, num_steps=2))]
    result = simulate(RoundRobin(1, device_bytes=device_bytes), jobs, FREE)
    assert result.num_promotes == num_promotes  # of 12 tasks
    assert result.demote_bytes == 2 * 2 * (12 + 12)  # written through: the same either way


def test_model_parallel_keeps_shard_0_resident_across_steps():
    # Shard 0's backward, then the next step's forward of shard 0, on device 0: the one pair of
    # consecutive tasks of one shard in the chain, so the only shard kept between steps.
    def promotes(num_steps: int) -> int:
        spec = job("a", 1.0, 1.0, 1.0, 1.0, num_steps=num_steps)
        return simulate(ModelParallel(2), [spec], CostModel(1e3)).num_promotes

    assert promotes(3) == 3 * promotes(1) - 2


def test_arrivals_and_removals():
    jobs = [Arrival(0.0, single("a", 2.0)), Arrival(5.0, single("b", 1.0))]
    result = simulate(ShardedLRTF(1), jobs, FREE)
    assert result.makespan_s == 6.0 and result.utilization == (0.5,)
    long = JobSpec.from_shards("long", 10, [1.0], [0.0], [0], [0])
    result = simulate(ShardedLRTF(2), [long, single("b", 1.0)], FREE,
                      removals=[Removal(2.5, "long")])
    assert result.makespan_s == 3.0  # its third task (2-3) still ends
    assert "long" not in result.completion_s
    check_timeline(result, {"long": long, "b": single("b", 1.0)}, removed={"long"})


def test_online_refinement_follows_the_measured_times():
    # "slow" is estimated at 2 s per task but takes 6 s. After its first task LRTF knows it
    # needs 12 s more (not 4 s) and keeps it ahead of fast's remaining 4.5 s. (No prefetch: a
    # lookahead would commit to the next job before the measurement arrives.)
    slow = JobSpec.from_shards("slow", 3, [2.0], [0.0], [0], [0])
    fast = JobSpec.from_shards("fast", 2, [4.5], [0.0], [0], [0])
    cost = CostModel(math.inf, prefetch=False,
                     compute_s=lambda t: 3 * t.est_seconds if t.job_id == "slow"
                     else t.est_seconds)
    policy = ShardedLRTF(1, ewma_alpha=1.0)
    result = simulate(policy, [fast, slow], cost)
    assert [g.job_id for g in result.gantt] == ["fast", "slow", "slow", "slow", "fast"]


@each_policy()
def test_random_instances_keep_every_invariant_and_are_deterministic(cls):
    for seed in range(4):
        rng = random.Random(seed)
        specs = {f"j{j}": job(f"j{j}", *[rng.uniform(0.2, 2) for _ in range(rng.randint(1, 4))],
                              num_steps=rng.randint(1, 3)) for j in range(rng.randint(1, 7))}
        arrivals = [Arrival(rng.choice([0.0, 0.0, rng.uniform(0, 5)]), s) for s in specs.values()]
        cost = CostModel(rng.choice([math.inf, 20.0, 5.0]), prefetch=rng.random() < 0.5)
        num_devices = rng.randint(1, 4)
        result = simulate(cls(num_devices), arrivals, cost)
        check_timeline(result, specs)
        assert set(result.completion_s) == set(specs)
        ends = [g.end_s for g in result.gantt]
        ends += [t.end_s for t in result.transfers if t.kind == "demote"]
        assert result.makespan_s == max(ends) >= max(result.completion_s.values())
        assert result == simulate(cls(num_devices), arrivals, cost)
        for arrival in arrivals:
            first = min(g.start_s for g in result.gantt if g.job_id == arrival.job.job_id)
            assert first >= arrival.time_s


def test_simulate_needs_a_fresh_policy_and_valid_times():
    policy = ShardedLRTF(1)
    policy.add_job(single("a", 1.0))
    with pytest.raises(ValueError, match="fresh"):
        simulate(policy, [])
    with pytest.raises(ValueError, match="arrival"):
        simulate(ShardedLRTF(1), [Arrival(-1.0, single("a", 1.0))])
    assert simulate(ShardedLRTF(1), []).makespan_s == 0.0


def test_reserved_lookahead_makes_prefetches_hit_on_several_devices():
    jobs = [JobSpec.from_shards(f"j{i}", 3, [1.0] * 3, [2.0] * 3, [4] * 3, [12] * 3)
            for i in range(4)]
    reserved = simulate(ShardedLRTF(2), jobs, CostModel(8.0))
    guessed = simulate(ShardedLRTF(2, reserve_lookahead=False), jobs, CostModel(8.0))
    assert reserved.num_prefetch_hits >= 0.8 * len(reserved.gantt)
    assert guessed.num_prefetch_hits < reserved.num_prefetch_hits
    assert reserved.makespan_s < guessed.makespan_s
    assert reserved.num_promotes < guessed.num_promotes


def test_other_bytes_move_whatever_is_resident_and_are_counted_per_device():
    # One shard, three steps: the first moves 5 B besides the shard, the others 1 B; the last
    # writes back 7 B. The shard (4 B) is promoted once and stays resident.
    def step(other: int, demote: int) -> tuple[TaskSpec, ...]:
        return (TaskSpec("a", 0, 0, "step", 1.0, 4, demote, other),)

    spec = JobSpec("a", step(1, 2), 3, head_tasks=step(5, 2), last_tasks=step(1, 7))
    assert [t.other_promote_bytes for t in spec.tasks()] == [5, 1, 1]
    assert [t.demote_bytes for t in spec.tasks()] == [2, 2, 7]
    two = JobSpec("b", (TaskSpec("b", 0, 0, "step", 1.0, 4, 3, 2),))
    result = simulate(ShardedLRTF(2), [spec, two], FREE)
    assert result.device_promote_bytes == (4 + 5 + 1 + 1, 4 + 2)
    assert result.device_demote_bytes == (2 + 2 + 7, 3)
    assert result.num_promotes == 2  # the shards; the other bytes are not shard copies
    with pytest.raises(ValueError, match="differ in more than bytes"):
        JobSpec("a", step(1, 2), 3, head_tasks=(TaskSpec("a", 0, 1, "step", 1.0, 4, 2, 5),))
    with pytest.raises(ValueError, match="last step is one of the head"):
        JobSpec("a", step(1, 2), 1, head_tasks=step(5, 2), last_tasks=step(1, 7))


@pytest.mark.parametrize(("device_bytes", "promoted", "demoted", "num_promotes"),
                         [(None, 5 + 2 + 1 + 1, 1 + 8 + 4, 2),
                          (20, 5 + 2 + 13 + 1, 12 + 1 + 12, 3)])
def test_a_kept_shard_writes_back_once_when_it_leaves(device_bytes, promoted, demoted,
                                                      num_promotes):
    # Job a of one shard, three steps (1 B of ids each): the first promotes its weights (4 B)
    # and keeps them with the optimizer state it made (8 B); the next find both (state_bytes)
    # and keep them; the last sends the state home and does not stay. What the steps changed
    # (weights and state) goes home once: at a's end, or when b's step (peak 10 B, 11.5 B with
    # the margin) evicts them from a 20 B device, after which a's next step promotes both.
    kept = {"kept_bytes": 12, "write_back_bytes": 12}
    first = TaskSpec("a", 0, 0, "step", 1.0, 4, 0, 1, 5, **kept)
    steady = TaskSpec("a", 0, 0, "step", 1.0, 12, 0, 1, 5, state_bytes=8, **kept)
    last = TaskSpec("a", 0, 0, "step", 1.0, 12, 8, 1, 5, kept_bytes=4, write_back_bytes=4,
                    state_bytes=8)
    a = JobSpec("a", (steady,), 3, head_tasks=(first,), last_tasks=(last,))
    b = JobSpec("b", (TaskSpec("b", 0, 0, "step", 1.0, 2, 1, 0, 10),))
    result = simulate(RoundRobin(1, device_bytes=device_bytes), [a, b], FREE)
    assert [(g.job_id, g.task_index) for g in result.gantt] == [("a", 0), ("b", 0), ("a", 1),
                                                                ("a", 2)]
    assert (result.promote_bytes, result.demote_bytes) == (promoted, demoted)
    assert result.num_promotes == num_promotes


def test_speed_scales_the_estimates_and_must_be_positive():
    jobs = [JobSpec.from_shards("a", 2, [1.0, 1.0], [2.0, 2.0], [0, 0], [0, 0])]
    assert simulate(ShardedLRTF(1), jobs, FREE).makespan_s == 12.0  # 2 x (1 + 3 + 2)
    slow = CostModel(bandwidth_bytes_per_s=math.inf, speed=2.5)
    result = simulate(ShardedLRTF(1), jobs, slow)
    assert result.makespan_s == 30.0 and result.busy_s == (30.0,)
    for speed in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="speed"):
            CostModel(speed=speed)


# ---------------------------------------------------------------- against a real executor run


def recording(cls: type, num_jobs: int):
    """A ``cls`` policy that records what a real executor asks and tells it.

    It hands out nothing until ``num_jobs`` jobs arrived (so the first decision sees them all,
    as the simulator's arrivals at time 0 do), then records each task it hands out and each
    task's measured seconds; ``chains`` are the jobs exactly as the executor gave them.
    """

    class Recording(cls):
        def __init__(self, num_devices: int) -> None:
            super().__init__(num_devices)
            self.chains: list[JobSpec] = []
            self.order: list[tuple[int, str, int]] = []
            self.measured: dict[tuple[str, int], float] = {}

        def add_job(self, job: JobSpec) -> None:
            super().add_job(job)
            self.chains.append(job)

        def next_task(self, device: int) -> TaskSpec | None:
            if len(self.chains) < num_jobs:
                return None
            task = super().next_task(device)
            if task is not None:
                self.order.append((device, task.job_id, task.index))
            return task

        def task_done(self, task: TaskSpec, measured_s: float | None = None) -> bool:
            assert measured_s is not None
            self.measured[(task.job_id, task.index)] = measured_s
            return super().task_done(task, measured_s)

    return Recording


@pytest.mark.parametrize("name", ["sharded-lrtf", "shortest-remaining", "round-robin"])
def test_replaying_a_real_run_with_its_measured_seconds_decides_its_order(name, one_thread):
    # One device: which task runs next depends only on what the policy is told (chains,
    # measured seconds, in the same sequence: next task, lookahead, task done), not on thread
    # timing, so the simulator, given the seconds the executor measured, hands out the tasks
    # in exactly the real order.

    from sweepmaster.runtime import ShardExecutor, TaskRecord
    from tests.kit.spill import tiny_spec

    specs = [tiny_spec("adamw", name="a", seed=1, max_steps=3),
             tiny_spec("sgd", name="b", seed=2, max_steps=2),
             tiny_spec("adamw", name="c", seed=3, max_steps=4, eval_data=None)]
    policy = recording(policy_names()[name], len(specs))(1)
    records: list[TaskRecord] = []
    with ShardExecutor("cpu:1x500000", policy=policy, on_task=records.append) as executor:
        assert all(executor.plan(spec).spill for spec in specs)
        for future in [executor.submit(spec) for spec in specs]:
            future.result()
    chains = policy.chains
    assert len(policy.order) == sum(chain.num_tasks for chain in chains)
    cost = CostModel(1e9, compute_s=lambda t: policy.measured[(t.job_id, t.index)])
    result = simulate(policy_names()[name](1), chains, cost)
    assert [(g.device, g.job_id, g.task_index) for g in result.gantt] == policy.order
    assert result.busy_s == (pytest.approx(sum(policy.measured.values())),)
    # the task records give every policy task its seconds (evaluations within the next task)
    durations = recorded_durations(records, chains)
    assert durations.keys() == policy.measured.keys()
    assert all(seconds >= 0 for seconds in durations.values())
