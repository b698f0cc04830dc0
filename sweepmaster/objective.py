"""The Python API's executor: :class:`Executor` for use inside an Optuna objective.

It is the runtime's executor (``sweepmaster.runtime.Executor``) plus the Optuna wiring the
runtime must not know: ``fit(spec, trial)`` reports each evaluation as an intermediate value,
asks the trial's pruner, and raises ``optuna.TrialPruned`` when the pruner says so.

Example:
    .. code-block:: python

        import optuna
        import sweepmaster

        executor = sweepmaster.Executor(devices="auto")

        def objective(trial):
            spec = sweepmaster.TrainSpec(
                model=GPT2Config(n_layer=2, n_embd=64, n_head=2),
                train_data=train_blocks, eval_data=valid_blocks,
                optimizer=sweepmaster.OptimizerSpec(lr=trial.suggest_float("lr", 1e-4, 1e-2,
                                                                           log=True)),
                batch_size=8, max_steps=100, eval_every=20,
            )
            return executor.fit(spec, trial).objective

        optuna.create_study().optimize(objective, n_trials=6)
"""

from __future__ import annotations

import math

import optuna

from sweepmaster.runtime import Executor as RuntimeExecutor
from sweepmaster.runtime.events import EvalEvent, StepEvent, TrainCallbacks
from sweepmaster.workload import TrainResult, TrainSpec

__all__ = ["Executor"]


class _OptunaReporter(TrainCallbacks):
    """Reports evaluations to an Optuna trial and asks its pruner; forwards to user callbacks."""

    def __init__(self, trial: optuna.Trial, metric: str, inner: TrainCallbacks | None) -> None:
        self.trial = trial
        self.metric = metric
        self.inner = inner or TrainCallbacks()
        self.last_train_loss = math.nan

    def on_start(self, event):  # type: ignore[no-untyped-def]  # signature from the base
        self.inner.on_start(event)

    def on_step(self, event: StepEvent) -> None:
        self.last_train_loss = event.train_loss
        self.inner.on_step(event)

    def on_eval(self, event: EvalEvent) -> bool:
        stop = self.inner.on_eval(event)
        value = {"eval_loss": event.eval_loss, "eval_perplexity": event.eval_perplexity,
                 "train_loss": self.last_train_loss}[self.metric]
        if event.step == 0 or not math.isfinite(value):
            return stop
        self.trial.report(value, event.step)
        return stop or self.trial.should_prune()


class Executor(RuntimeExecutor):
    """Trains :class:`TrainSpec` jobs on devices; usable from Optuna objectives.

    Thread-safe: ``study.optimize(objective, n_jobs=K)`` may call :meth:`fit` from K threads;
    the K jobs share the devices under the executor's SHARP policy (Sharded-LRTF by default):
    a job that fits holds one device while it trains, jobs that spill share the devices shard
    task by shard task. Takes the arguments of :class:`sweepmaster.runtime.Executor`, e.g.
    ``Executor(devices="cpu:2x256MiB")``.
    """

    def fit(self, spec: TrainSpec, trial: optuna.Trial | None = None,  # type: ignore[override]
            callbacks: TrainCallbacks | None = None) -> TrainResult:
        """Train one job to the end (or until pruned).

        Args:
            spec: What to train.
            trial: An Optuna trial: each evaluation's ``spec.metric`` is reported with
                ``trial.report(value, step)`` and ``trial.should_prune()`` is honoured.
            callbacks: More progress callbacks (e.g. your own logging).

        Returns:
            The trained weights (on the host), the metric history and the objective.

        Raises:
            optuna.TrialPruned: ``trial``'s pruner stopped the job.
            torch.OutOfMemoryError: The job does not fit its device.
            FloatingPointError: The training loss became non-finite.
        """
        if trial is None:
            return super().fit(spec, callbacks)
        result = super().fit(spec, _OptunaReporter(trial, spec.metric, callbacks))
        if result.pruned:
            raise optuna.TrialPruned(f"pruned at step {result.steps}")
        return result
