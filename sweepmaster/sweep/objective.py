"""The Python API's executor: :class:`Executor` for use inside an Optuna objective.

It is the runtime's executor (:class:`~sweepmaster.runtime.executor.ShardExecutor`) plus the Optuna
wiring the runtime must not know: ``fit(spec, trial)`` reports each evaluation as an intermediate
value, asks the trial's pruner, and raises ``optuna.TrialPruned`` when the pruner says so.

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

Several trials of one architecture train as one fused array with :meth:`Executor.submit_fused`
and Optuna's ask-and-tell interface (see the README's Python API section).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence
from typing import Any

import optuna

from sweepmaster.runtime import ShardExecutor
from sweepmaster.runtime.events import EvalEvent, ReplanEvent, StepEvent, TrainCallbacks
from sweepmaster.runtime.execution.fused_jobs import VacancyHook
from sweepmaster.sweep.trial_callbacks import reported_value
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
        value = reported_value(event, self.metric, self.last_train_loss)
        if value is None:
            return stop
        self.trial.report(value, event.step)
        return stop or self.trial.should_prune()

    def on_replan(self, event: ReplanEvent) -> None:
        self.inner.on_replan(event)


class Executor(ShardExecutor):
    """Trains :class:`TrainSpec` jobs on devices; usable from Optuna objectives.

    Thread-safe: ``study.optimize(objective, n_jobs=K)`` may call :meth:`fit` from K threads;
    the K jobs share the devices under the executor's SHARP policy (Sharded-LRTF by default):
    a job that fits holds one device while it trains, jobs that spill share the devices shard
    task by shard task. Takes the arguments of
    :class:`~sweepmaster.runtime.executor.ShardExecutor`, e.g.
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
            TypeError: ``trial`` is not an Optuna trial (callbacks go in ``callbacks=``).
            torch.OutOfMemoryError: The job does not fit its device (after its first step, or
                not even re-planned with less memory).
            FloatingPointError: The training loss became non-finite.
        """
        _check_trials([trial] if trial is not None else [])
        if trial is None:
            return super().fit(spec, callbacks)
        result = super().fit(spec, _OptunaReporter(trial, spec.metric, callbacks))
        if result.pruned:
            raise optuna.TrialPruned(f"pruned at step {result.steps}")
        return result

    def submit_fused(
        self,
        specs: Sequence[TrainSpec],
        callbacks: Sequence[TrainCallbacks | None] | None = None,
        *,
        name: str | None = None,
        trials: Sequence[optuna.Trial] | None = None,
        on_vacancy: VacancyHook | None = None,
    ) -> list[concurrent.futures.Future[TrainResult]]:
        """Train K same-architecture trials as one fused array; one future per trial.

        As ``ShardExecutor.submit_fused`` (each future resolves when its member
        finishes, is pruned or fails, independently of the others), plus ``trials``: member
        k's evaluations are reported to ``trials[k]`` and its pruner is honoured (a pruned
        member leaves the array; its result has ``pruned=True``: tell the study
        ``TrialState.PRUNED``). ``on_vacancy`` refills the array (see the runtime's).

        Example:
            .. code-block:: python

                trials = [study.ask() for _ in range(4)]
                specs = [make_spec(trial) for trial in trials]   # one architecture
                futures = executor.submit_fused(specs, trials=trials)
                for trial, future in zip(trials, futures):
                    result = future.result()
                    if result.pruned:
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    else:
                        study.tell(trial, result.objective)

        Raises:
            ValueError: As the runtime's (members that cannot fuse, spill, or do not fit), or
                ``trials`` of another length than ``specs``.
            TypeError: As the runtime's (``specs`` is one spec), or ``trials`` holds something
                that is not an Optuna trial.
        """
        if isinstance(specs, TrainSpec):  # the runtime says what to do instead
            return super().submit_fused(specs, callbacks, name=name, on_vacancy=on_vacancy)
        _check_trials(trials or [])
        members: list[TrainCallbacks | None] = (
            list(callbacks) if callbacks is not None else [None] * len(specs))
        if trials is not None:
            if len(trials) != len(specs):
                raise ValueError(f"{len(specs)} specs but {len(trials)} trials")
            members = [_OptunaReporter(trial, spec.metric, inner)
                       for trial, spec, inner in zip(trials, specs, members, strict=False)]
        return super().submit_fused(specs, members, name=name, on_vacancy=on_vacancy)


def _check_trials(trials: Sequence[Any]) -> None:
    """Refuse what is not an Optuna trial where a trial is expected (before anything trains).

    Raises:
        TypeError: An item is not an ``optuna.trial.BaseTrial``.
    """
    for trial in trials:
        if not isinstance(trial, optuna.trial.BaseTrial):
            raise TypeError(f"trial must be an Optuna trial (from study.optimize or study.ask), "
                            f"got {type(trial).__name__}; progress callbacks go in callbacks=")
