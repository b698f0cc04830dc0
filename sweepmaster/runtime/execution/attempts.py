"""A job's progress receiver across its attempts, so that a re-planned job's events reach it once.

A job that runs out of device memory before its first step ends is re-planned and restarted from
its spec (:mod:`~sweepmaster.runtime.execution.replan`); the new attempt keeps the old one's
:class:`AttemptCallbacks`, which drop what the restart repeats.
"""

from __future__ import annotations

from sweepmaster.runtime.events import (
    EvalEvent,
    ReplanEvent,
    StartEvent,
    StepEvent,
    TrainCallbacks,
)

__all__ = ["AttemptCallbacks"]


class AttemptCallbacks(TrainCallbacks):
    """A job's progress receiver across its attempts: each event once, and the steps counted.

    A job re-planned after it ran out of memory in its first step restarts from its spec, so the
    new attempt sends its start and its first evaluation (step 0, or the step it resumed from)
    again: they reach ``callbacks`` once. A repeated start is dropped; a repeated evaluation
    returns what the first one answered. Steps are never repeated (no restart follows one).

    Args:
        callbacks: The receiver (``None``: none).

    Attributes:
        callbacks: The receiver.
        num_steps: Optimizer steps the job has ended (``on_step`` calls).
    """

    def __init__(self, callbacks: TrainCallbacks | None) -> None:
        self.callbacks = callbacks if callbacks is not None else TrainCallbacks()
        self.num_steps = 0
        self._started = False
        self._first_evals: dict[int, bool] = {}  # step -> answer, before the first step

    @classmethod
    def of(cls, callbacks: TrainCallbacks | None) -> AttemptCallbacks:
        """``callbacks`` as :class:`AttemptCallbacks` (those of an earlier attempt carry over)."""
        return callbacks if isinstance(callbacks, AttemptCallbacks) else cls(callbacks)

    def on_start(self, event: StartEvent) -> None:  # noqa: D102
        if not self._started:
            self._started = True
            self.callbacks.on_start(event)

    def on_step(self, event: StepEvent) -> None:  # noqa: D102
        self.num_steps += 1
        self.callbacks.on_step(event)

    def on_eval(self, event: EvalEvent) -> bool:  # noqa: D102
        if self.num_steps:
            return self.callbacks.on_eval(event)
        if event.step not in self._first_evals:
            self._first_evals[event.step] = bool(self.callbacks.on_eval(event))
        return self._first_evals[event.step]

    def on_replan(self, event: ReplanEvent) -> None:  # noqa: D102
        self.callbacks.on_replan(event)
