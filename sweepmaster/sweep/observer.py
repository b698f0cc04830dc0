"""What a sweep reports while it runs, for a display: :class:`SweepObserver`."""

from __future__ import annotations

from typing import Any

from sweepmaster.runtime.events import EvalEvent, StepEvent, TaskRecord

__all__ = ["SweepObserver"]


class SweepObserver:
    """Receives a sweep's progress for display; every method is a no-op (subclass to show it).

    Trials train concurrently: the trial and task methods are called from the executor's worker
    threads, so an observer must be thread-safe and quick.
    """

    def message(self, text: str) -> None:
        """A one-line status message (data preparation, resume information)."""

    def sweep_started(self, name: str, n_trials: int, n_finished: int) -> None:
        """The study is open: ``n_finished`` of ``n_trials`` trials are already done."""

    def trial_started(self, number: int, params: dict[str, Any], total_steps: int,
                      device: str, num_shards: int = 1) -> None:
        """Trial ``number`` starts training on ``device`` (alone or in a fused array).

        A trial spilled into ``num_shards > 1`` shards moves between the devices task by task;
        ``device`` is where its first task runs.
        """

    def trial_step(self, number: int, event: StepEvent) -> None:
        """Trial ``number`` finished an optimizer step."""

    def trial_evaluated(self, number: int, event: EvalEvent) -> None:
        """Trial ``number`` finished an evaluation."""

    def trial_finished(self, number: int, state: str, objective: float | None,
                       reason: str | None) -> None:
        """Trial ``number`` ended COMPLETE, PRUNED or FAIL."""

    def task_finished(self, record: TaskRecord) -> None:
        """A device finished a task (called from the executor's worker threads)."""
