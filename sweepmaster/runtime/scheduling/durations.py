"""Seconds of a real run's policy tasks, from its task records: a simulation's measured costs.

:func:`recorded_durations` matches the executor's task records
(:class:`~sweepmaster.runtime.events.TaskRecord`) to the chains it gave its policy, so
a simulation (:func:`~sweepmaster.runtime.scheduling.simulate.simulate`) can replay the run
(``CostModel.compute_s``) or learn its speed (``CostModel.speed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from sweepmaster.runtime.scheduling.chains import JobSpec

__all__ = ["TimedTask", "recorded_durations"]

#: Kinds of the real tasks that are policy tasks (one each); any other real task (an evaluation
#: pass, a deferred update) runs within the policy task that follows it.
_TRAINING_KINDS = ("forward", "backward", "step", "train")


class TimedTask(Protocol):
    """What :func:`recorded_durations` reads of a real task's record (``TaskRecord``)."""

    @property
    def job(self) -> str: ...  # noqa: D102

    @property
    def kind(self) -> str: ...  # noqa: D102

    @property
    def start_s(self) -> float: ...  # noqa: D102

    @property
    def end_s(self) -> float: ...  # noqa: D102


def recorded_durations(
    records: Iterable[TimedTask], chains: Sequence[JobSpec]
) -> dict[tuple[str, int], float]:
    """Seconds of each policy task ``(job, index)`` of ``chains`` from a real run's task records.

    A job's training records (kinds ``forward``, ``backward``, ``step``, ``train``) match its
    chain's tasks in order; an evaluation or deferred update runs within the policy task that
    follows it (the last one after the last). Use them as ``CostModel.compute_s`` to replay the
    run, or to measure ``CostModel.speed``.

    ``records`` are the executor's task records of the run (any order, e.g. its ``on_task``'s
    :class:`~sweepmaster.runtime.events.TaskRecord` s), ``chains`` the chains it gave
    the policy (:func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`).

    Raises:
        ValueError: A job's training records are not as many as its chain's tasks.
    """
    by_job: dict[str, list[TimedTask]] = {}
    for record in sorted(records, key=lambda r: r.start_s):
        by_job.setdefault(record.job, []).append(record)
    durations: dict[tuple[str, int], float] = {}
    for chain in chains:
        index, extra = 0, 0.0
        for record in by_job.get(chain.job_id, []):
            seconds = record.end_s - record.start_s
            if record.kind in _TRAINING_KINDS:
                durations[(chain.job_id, index)] = seconds + extra
                index, extra = index + 1, 0.0
            else:
                extra += seconds
        if index != chain.num_tasks:
            raise ValueError(f"job {chain.job_id!r}: {index} training records for "
                             f"{chain.num_tasks} tasks")
        durations[(chain.job_id, index - 1)] += extra
    return durations
