"""The executor's task records, and a real run's scheduling replayed in simulated time.

:class:`Timeline` collects the records of a real run. Which task a real executor runs next
depends on when its worker threads finish, so a test never asserts the interleaving of a real
run. It asserts what the policy decides from its inputs instead: the chains the executor gave it
and the seconds each task really took, replayed by the simulator (deterministic).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

from sweepmaster.runtime import TaskRecord
from sweepmaster.runtime.scheduling.chains import JobSpec
from sweepmaster.runtime.scheduling.durations import recorded_durations
from sweepmaster.runtime.scheduling.scheduler import Policy
from sweepmaster.runtime.scheduling.sim_model import CostModel, SimResult
from sweepmaster.runtime.scheduling.simulate import simulate

__all__ = [
    "Timeline", "assert_never_overlaps", "assert_one_task_at_a_time", "hand_out_order",
    "num_runs", "recorded_durations", "replay",
]


class Timeline:
    """Collects the executor's task records (called from worker threads)."""

    def __init__(self) -> None:
        self.records: list[TaskRecord] = []
        self.lock = threading.Lock()

    def __call__(self, record: TaskRecord) -> None:
        with self.lock:
            self.records.append(record)

    def by(self, field: str) -> dict[str, list[TaskRecord]]:
        """The records grouped by the value of their ``field`` (``job``, ``device``...)."""
        groups: dict[str, list[TaskRecord]] = defaultdict(list)
        for record in self.records:
            groups[getattr(record, field)].append(record)
        return groups


def assert_never_overlaps(records: list[TaskRecord]) -> None:
    """No record starts before the one before it (by start) ended."""
    ordered = sorted(records, key=lambda r: r.start_s)
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert before.end_s <= after.start_s, (before, after)


def replay(policy: Policy, chains: Sequence[JobSpec],
           durations: dict[tuple[str, int], float] | None = None,
           bandwidth_bytes_per_s: float = math.inf) -> SimResult:
    """Simulate ``chains`` under ``policy`` with the recorded ``durations`` (or the estimates)."""
    compute = None if durations is None else (lambda t: durations[(t.job_id, t.index)])
    cost = CostModel(bandwidth_bytes_per_s=bandwidth_bytes_per_s, compute_s=compute)
    return simulate(policy, chains, cost)


def hand_out_order(result: SimResult) -> list[tuple[int, str, int]]:
    """(device, job, task index) of every task in the order the policy handed them out."""
    return [(g.device, g.job_id, g.task_index) for g in result.gantt]


def num_runs(jobs: Iterable[str]) -> dict[str, int]:
    """Unbroken runs of each job's tasks in ``jobs``: job ids in the order one device ran them.

    A job whose tasks ran as one contiguous block has 1; a job interleaved with others, more.
    """
    runs: dict[str, int] = {}
    previous = None
    for job in jobs:
        if job != previous:
            runs[job] = runs.get(job, 0) + 1
        previous = job
    return runs


def assert_one_task_at_a_time(result: SimResult) -> None:
    """A device runs one task at a time; a job runs its tasks one at a time, in chain order."""
    by_device: dict[int, list[tuple[float, float]]] = {}
    by_job: dict[str, list[tuple[int, float, float]]] = {}
    for g in result.gantt:
        by_device.setdefault(g.device, []).append((g.start_s, g.end_s))
        by_job.setdefault(g.job_id, []).append((g.task_index, g.start_s, g.end_s))
    for spans in by_device.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    for tasks in by_job.values():
        assert [t[0] for t in tasks] == list(range(len(tasks)))
        assert all(a[2] <= b[1] for a, b in zip(tasks, tasks[1:], strict=False))
