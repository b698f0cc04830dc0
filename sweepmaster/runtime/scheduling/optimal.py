"""Exact minimum makespan of small SHARP instances: a MILP solved by HiGHS.

The reference Sharded-LRTF (Hydra, Nagrecha & Kumar, 2022, https://arxiv.org/abs/2110.08633) is
measured against, for up to about 6 jobs, a few shards and 2-3 devices; solved by HiGHS
(:func:`scipy.optimize.milp`). Compute only: identical devices, each job a chain of tasks that
run one after another on any device, the first not before the job's arrival, task ``t`` taking
its ``est_seconds`` ``p_t``; transfers are not modelled (compare with simulations at
``CostModel(bandwidth_bytes_per_s=math.inf)``, whose model is exactly this one).

Formulation (disjunctive, big-M with ``H`` = the Sharded-LRTF makespan, a feasible upper bound)::

    min C
    sum_m x[t,m] = 1                      x[t,m] = 1: task t runs on device m
    S[t+1] >= S[t] + p[t]                 chain of each job (also serializes a job's tasks)
    S[first of j] >= r[j],  C >= S[last] + p[last]
    b[t,u] + b[u,t] >= x[t,m] + x[u,m] - 1   for every device m   (same device: one goes first)
    S[u] >= S[t] + p[t] - H (1 - b[t,u])   b[t,u] = 1: t before u on their device
    x[t,m] = 0 for m > k, t the k-th task   (devices are identical: symmetry breaking)

Pairs ``(t, u)`` of different jobs whose time windows in ``[0, H]`` cannot overlap get no
disjunction.

Example:
    >>> from sweepmaster.runtime.scheduling.chains import JobSpec
    >>> jobs = [JobSpec.from_shards(j, 1, [s], [0.0], [0], [0]) for j, s in zip("abc", (3, 2, 1))]
    >>> optimal_makespan(jobs, num_devices=2).makespan_s
    3.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from sweepmaster.runtime.scheduling.chains import JobSpec
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.scheduling.sim_model import Arrival, CostModel
from sweepmaster.runtime.scheduling.simulate import simulate

__all__ = ["OptimalSchedule", "Placement", "optimal_makespan"]


@dataclass(frozen=True)
class Placement:
    """Where and when one task runs in a schedule (seconds from the start)."""

    job_id: str
    task_index: int
    device: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class OptimalSchedule:
    """The solver's answer.

    Attributes:
        makespan_s: Makespan of the best schedule found, seconds.
        lower_bound_s: Proven lower bound on the minimum makespan, seconds.
        optimal: Whether ``makespan_s`` is proven minimal (within a relative 1e-6).
        placements: The schedule, one entry per task.
    """

    makespan_s: float
    lower_bound_s: float
    optimal: bool
    placements: tuple[Placement, ...]


def optimal_makespan(
    jobs: Iterable[JobSpec | Arrival],
    num_devices: int,
    *,
    time_limit_s: float = 60.0,
    max_tasks: int = 64,
) -> OptimalSchedule:
    """Minimum makespan of ``jobs`` on ``num_devices`` identical devices, compute only.

    ``jobs`` arrive at time 0 or are :class:`~sweepmaster.runtime.scheduling.sim_model.Arrival` s.
    Past ``time_limit_s`` (solver wall clock) the best schedule found is returned with
    ``optimal=False``; instances of more than ``max_tasks`` tasks are refused (the MILP grows
    quadratically).

    Raises:
        ValueError: ``num_devices < 1``, no jobs, duplicate job ids, or more than ``max_tasks``
            tasks.
    """
    arrivals = [a if isinstance(a, Arrival) else Arrival(0.0, a) for a in jobs]
    if len({a.job.job_id for a in arrivals}) != len(arrivals):
        raise ValueError("job ids must be unique")
    tasks = [(a.job.job_id, t.index, t.est_seconds, a.time_s) for a in arrivals
             for t in a.job.tasks()]
    if num_devices < 1 or not tasks or len(tasks) > max_tasks:
        raise ValueError(f"need num_devices >= 1 and 1..{max_tasks} tasks, "
                         f"got {num_devices} devices and {len(tasks)} tasks")
    heuristic = simulate(ShardedLRTF(num_devices), arrivals,
                         CostModel(bandwidth_bytes_per_s=math.inf))
    horizon = heuristic.makespan_s
    fallback = tuple(Placement(g.job_id, g.task_index, g.device, g.start_s, g.end_s)
                     for g in heuristic.gantt)

    n, m = len(tasks), num_devices
    p = np.array([t[2] for t in tasks])
    earliest = np.zeros(n)  # earliest start and latest end of each task in [0, horizon]
    latest = np.zeros(n)
    chains: list[list[int]] = []
    for a in arrivals:
        first = next(i for i, t in enumerate(tasks) if t[0] == a.job.job_id)
        chain = list(range(first, first + a.job.num_tasks))
        chains.append(chain)
        earliest[chain] = a.time_s + np.concatenate(([0.0], np.cumsum(p[chain])[:-1]))
        latest[chain] = horizon - np.concatenate((np.cumsum(p[chain][::-1])[::-1][1:], [0.0]))
    job_of = np.array([k for k, c in enumerate(chains) for _ in c])
    pairs = [(t, u) for t in range(n) for u in range(t + 1, n)
             if job_of[t] != job_of[u] and earliest[t] < latest[u] and earliest[u] < latest[t]]

    # Variable layout: S (n) | x (n*m) | b (2 per pair) | C.
    x0, b0 = n, n + n * m
    c_var = b0 + 2 * len(pairs)
    num_vars = c_var + 1
    rows: list[tuple[dict[int, float], float, float]] = []
    for t in range(n):
        rows.append(({x0 + t * m + d: 1.0 for d in range(m)}, 1.0, 1.0))
    for chain in chains:
        for t, u in itertools.pairwise(chain):
            rows.append(({u: 1.0, t: -1.0}, p[t], np.inf))
        rows.append(({c_var: 1.0, chain[-1]: -1.0}, p[chain[-1]], np.inf))
    for k, (t, u) in enumerate(pairs):
        btu, but = b0 + 2 * k, b0 + 2 * k + 1
        for d in range(m):
            rows.append(({btu: 1.0, but: 1.0, x0 + t * m + d: -1.0, x0 + u * m + d: -1.0},
                         -1.0, np.inf))
        rows.append(({u: 1.0, t: -1.0, btu: -horizon}, p[t] - horizon, np.inf))
        rows.append(({t: 1.0, u: -1.0, but: -horizon}, p[u] - horizon, np.inf))
    for d in range(m):  # C >= the load of each device (tightens the bound once x is branched on)
        rows.append(({c_var: 1.0, **{x0 + t * m + d: -p[t] for t in range(n)}}, 0.0, np.inf))
    coo = [(r, col, v) for r, (coefs, _, _) in enumerate(rows) for col, v in coefs.items()]
    matrix = coo_matrix(([v for _, _, v in coo], ([r for r, _, _ in coo], [c for _, c, _ in coo])),
                        shape=(len(rows), num_vars))

    lower = np.zeros(num_vars)
    upper = np.ones(num_vars)
    lower[:n], upper[:n] = earliest, latest - p
    for k in range(n):  # symmetry breaking: the k-th task uses one of the first k+1 devices
        upper[x0 + k * m + min(k + 1, m): x0 + (k + 1) * m] = 0.0
    total = float(p.sum())
    min_release = min(a.time_s for a in arrivals)
    bound = max(float(max(earliest + p)), min_release + total / m)
    lower[c_var], upper[c_var] = bound, horizon
    upper[:n] = np.maximum(upper[:n], lower[:n])
    integrality = np.ones(num_vars)
    integrality[:n] = integrality[c_var] = 0
    cost = np.zeros(num_vars)
    cost[c_var] = 1.0

    res = milp(cost, integrality=integrality, bounds=Bounds(lower, upper),
               constraints=LinearConstraint(matrix, [r[1] for r in rows], [r[2] for r in rows]),
               options={"time_limit": time_limit_s, "mip_rel_gap": 1e-6})
    dual = getattr(res, "mip_dual_bound", None)
    lower_bound = max(bound, float(dual)) if dual is not None and np.isfinite(dual) else bound
    if res.x is None or res.fun is None or res.fun >= horizon - 1e-9:
        # HiGHS found nothing better than the heuristic (or nothing at all within the limit).
        proven = res.status == 0
        return OptimalSchedule(horizon, horizon if proven else lower_bound, proven, fallback)
    starts = res.x[:n]
    placements = tuple(
        Placement(tasks[t][0], tasks[t][1], int(np.argmax(res.x[x0 + t * m: x0 + (t + 1) * m])),
                  float(starts[t]), float(starts[t] + p[t]))
        for t in range(n))
    makespan = max(pl.end_s for pl in placements)
    return OptimalSchedule(makespan, min(lower_bound, makespan), res.status == 0, placements)
