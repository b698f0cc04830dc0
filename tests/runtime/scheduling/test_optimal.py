"""The MILP reference: hand-computed optima, and optimum <= every policy on random instances."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest

from sweepmaster.runtime.scheduling.chains import JobSpec
from sweepmaster.runtime.scheduling.optimal import OptimalSchedule, optimal_makespan
from sweepmaster.runtime.scheduling.policies import policy_names
from sweepmaster.runtime.scheduling.sim_model import Arrival, CostModel
from sweepmaster.runtime.scheduling.simulate import simulate
from tests.kit.policies import chain

FREE = CostModel(bandwidth_bytes_per_s=math.inf)  # no transfers: no lookahead either
LOOKAHEAD = CostModel(bandwidth_bytes_per_s=1e30)  # ~free transfers, lookahead reservations


def check_feasible(schedule: OptimalSchedule, arrivals: list[Arrival], num_devices: int) -> None:
    by_job, by_device = defaultdict(list), defaultdict(list)
    for pl in schedule.placements:
        assert 0 <= pl.device < num_devices
        by_job[pl.job_id].append(pl)
        by_device[pl.device].append((pl.start_s, pl.end_s))
    for a in arrivals:
        bars = sorted(by_job[a.job.job_id], key=lambda pl: pl.task_index)
        assert [pl.task_index for pl in bars] == list(range(a.job.num_tasks))
        assert bars[0].start_s >= a.time_s - 1e-6
        for pl in bars:
            assert pl.end_s - pl.start_s == pytest.approx(a.job.task(pl.task_index).est_seconds)
        assert all(x.end_s <= y.start_s + 1e-6 for x, y in zip(bars, bars[1:], strict=False))
    for bars in by_device.values():
        bars.sort()
        assert all(x[1] <= y[0] + 1e-6 for x, y in zip(bars, bars[1:], strict=False))
    assert max(pl.end_s for pl in schedule.placements) == pytest.approx(schedule.makespan_s)
    assert schedule.lower_bound_s <= schedule.makespan_s + 1e-9


def test_hand_computed_optima():
    three = [chain("a", 3.0), chain("b", 2.0), chain("c", 1.0)]
    assert optimal_makespan(three, 2).makespan_s == pytest.approx(3.0)
    # A chain of 2 + 2 bounds it below at 4; b and c fit beside it.
    assert optimal_makespan([chain("a", 2.0, 2.0), chain("b", 1.0), chain("c", 3.0)],
                            2).makespan_s == pytest.approx(4.0)
    # 2, 2, 2, 3, 3 on 2 devices: {3, 3} and {2, 2, 2} -> 6 (greedy LPT gives 7).
    five = [chain(j, s) for j, s in zip("abcde", (3.0, 3.0, 2.0, 2.0, 2.0), strict=True)]
    result = optimal_makespan(five, 2)
    assert result.optimal and result.makespan_s == pytest.approx(6.0)
    assert simulate(policy_names()["sharded-lrtf"](2), five, FREE).makespan_s == 7.0
    arrivals = [Arrival(0.0, chain("a", 2.0)), Arrival(5.0, chain("b", 1.0))]
    late = optimal_makespan(arrivals, 1)
    assert late.makespan_s == pytest.approx(6.0)
    check_feasible(late, arrivals, 1)


@pytest.mark.parametrize("seed", range(12))
def test_optimum_bounds_every_policy_on_random_small_instances(seed):
    rng = random.Random(seed)
    num_devices = rng.choice([2, 3])
    arrivals = []
    for j in range(rng.randint(2, 5)):
        shards = rng.choice([1, 2])
        spec = JobSpec.from_shards(f"j{j}", rng.choice([1, 2]) if shards == 1 else 1,
                                   [round(rng.uniform(0.5, 2), 2) for _ in range(shards)],
                                   [round(rng.uniform(0.5, 3), 2) for _ in range(shards)],
                                   [1] * shards, [3] * shards)
        arrivals.append(Arrival(rng.choice([0.0, 0.0, round(rng.uniform(0, 2), 2)]), spec))
    best = optimal_makespan(arrivals, num_devices, time_limit_s=30)
    assert best.optimal
    check_feasible(best, arrivals, num_devices)
    for name, cls in policy_names().items():
        for cost in (FREE, LOOKAHEAD):
            makespan = simulate(cls(num_devices), arrivals, cost).makespan_s
            assert best.makespan_s <= makespan * (1 + 1e-6), name


def test_refuses_instances_that_are_too_large():
    with pytest.raises(ValueError, match="tasks"):
        optimal_makespan([chain("a", *[1.0] * 10)], 2, max_tasks=8)
    with pytest.raises(ValueError, match="unique"):
        optimal_makespan([chain("a", 1.0), chain("a", 1.0)], 2)
