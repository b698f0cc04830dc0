"""Training callbacks that record a run and end it after a chosen step (a crash, a kill)."""

from __future__ import annotations

import time

from sweepmaster.runtime.events import StartEvent, StepEvent, TrainCallbacks

__all__ = ["StopAfterStep"]


class StopAfterStep(TrainCallbacks):
    """Records a run's events; raises ``error`` after optimizer step ``stop``.

    The error comes before that step's evaluation and checkpoint. ``starts`` holds the start
    events, ``steps`` and ``evals`` the step numbers seen.

    Args:
        stop: The step after which to raise; ``None`` never raises.
        error: What to raise: an ``Exception`` fails one job, a ``BaseException`` (as Ctrl-C
            or a killed worker) ends a whole array.
        delay_s: Seconds to sleep after each step (a slow run).
    """

    def __init__(self, stop: int | None = None, *, error: type[BaseException] = RuntimeError,
                 delay_s: float = 0.0) -> None:
        self.stop = stop
        self.error = error
        self.delay_s = delay_s
        self.starts: list[StartEvent] = []
        self.steps: list[int] = []
        self.evals: list[int] = []

    def on_start(self, event: StartEvent) -> None:
        self.starts.append(event)

    def on_step(self, event: StepEvent) -> None:
        self.steps.append(event.step)
        if self.delay_s:
            time.sleep(self.delay_s)
        if event.step == self.stop:
            raise self.error(f"{self.error.__name__} after step {event.step}")

    def on_eval(self, event) -> bool:
        self.evals.append(event.step)
        return False
