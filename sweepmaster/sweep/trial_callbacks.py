"""A trial's runtime events, reported to the store, to Optuna and to the terminal.

:class:`TrialCallbacks` receives the executor's events of one trial
(:class:`~sweepmaster.runtime.events.TrainCallbacks`): its start (a resumed trial continues its
series of intermediate values, :func:`~sweepmaster.sweep.resume.continue_series`), each step and
re-plan, each evaluation, reported to Optuna and answered with the pruner's decision. One per
trial, made by :class:`~sweepmaster.sweep.launch.Launch`.
"""

from __future__ import annotations

import math
import threading

from optuna.trial import Trial

from sweepmaster import study as study_manager
from sweepmaster.runtime.events import (
    EvalEvent,
    ReplanEvent,
    StartEvent,
    StepEvent,
    TrainCallbacks,
)
from sweepmaster.runtime.execution.state import JobCancelledError
from sweepmaster.store.progress import ProgressRecorder
from sweepmaster.sweep.observer import SweepObserver
from sweepmaster.sweep.resume import continue_series

__all__ = ["TrialCallbacks", "reported_value"]


def reported_value(event: EvalEvent, metric: str, last_train_loss: float) -> float | None:
    """What an evaluation reports to Optuna as the trial's intermediate ``metric`` value.

    Args:
        event: The evaluation.
        metric: ``study.metric``: ``"eval_loss"``, ``"eval_perplexity"`` or ``"train_loss"``.
        last_train_loss: The loss of the trial's latest training step (for ``"train_loss"``).

    Returns:
        The value, or ``None`` where nothing is reported: the evaluation before any training
        step (step 0) or a value that is not finite.
    """
    value = {"eval_loss": event.eval_loss, "eval_perplexity": event.eval_perplexity,
             "train_loss": last_train_loss}[metric]
    if event.step == 0 or not math.isfinite(value):
        return None
    return value


class TrialCallbacks(TrainCallbacks):
    """Wires one trial's runtime events to the store, Optuna and the observer.

    After :meth:`stop` (the trial was marked failed) every event raises
    :class:`~sweepmaster.runtime.JobCancelledError`, so its job (or, in a fused array, the
    member) ends at its next step and writes nothing more.
    """

    def __init__(self, trial: Trial, recorder: ProgressRecorder, observer: SweepObserver,
                 metric: str) -> None:
        self.trial = trial
        self.recorder = recorder
        self.observer = observer
        self.metric = metric
        self.last_train_loss = math.nan
        self.stopped = threading.Event()
        self.num_shards = 1
        self.first_step = self.last_step = 0  # the trial's own steps: at its start, the latest

    def stop(self) -> None:
        """Drop every later event and end the job at its next one."""
        self.stopped.set()

    def _check(self) -> None:
        if self.stopped.is_set():
            raise JobCancelledError(f"trial {self.trial.number} was stopped")

    def on_start(self, event: StartEvent) -> None:
        """Record the trial's start (a resumed one continues its series from its step)."""
        self._check()
        self.first_step = self.last_step = event.resumed_from_step
        continue_series(self.trial, event.resumed_from_step)  # its history before the resume
        self.recorder.trial_started(self.trial.number, self.trial._trial_id, event.total_steps,
                                    event.device, step=event.resumed_from_step)
        if event.resumed_from_step:
            self.observer.message(f"trial {self.trial.number} resumes from the checkpoint of "
                                  f"step {event.resumed_from_step}")
        self.observer.trial_started(self.trial.number, self.trial.params, event.total_steps,
                                    event.device, self.num_shards)

    def on_step(self, event: StepEvent) -> None:
        """Record a training step's loss, throughput and learning rate."""
        self._check()
        self.last_train_loss = event.train_loss
        self.last_step = event.step
        self.recorder.step(self.trial.number, event.step, event.total_steps, event.train_loss,
                           event.tokens_per_s, event.lr)
        self.observer.trial_step(self.trial.number, event)

    def on_replan(self, event: ReplanEvent) -> None:
        """Note the job's new shard count and say why it was re-planned."""
        self._check()
        self.num_shards = event.num_shards
        self.observer.message(event.message)

    def on_eval(self, event: EvalEvent) -> bool:
        """Record an evaluation, report the metric to Optuna; ``True``: the trial is pruned."""
        self._check()
        self.recorder.evaluated(self.trial.number, event.step, event.eval_loss,
                                event.eval_perplexity)
        self.observer.trial_evaluated(self.trial.number, event)
        value = reported_value(event, self.metric, self.last_train_loss)
        if value is None:
            return False
        study_manager.report(self.trial, value, event.step)
        return study_manager.should_prune(self.trial)
