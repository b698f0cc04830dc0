"""Optuna study manager: storage, sampler, pruner, and the ask side of a sweep.

A sweep is one Optuna study named like the sweep, on the sweep's storage URL. Relaunching the
same sweep loads the study (``load_if_exists``): trials that finished are never run again, a grid
ends when every cell has finished, and trials that were interrupted (Ctrl-C, a crash) are queued
again with their parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.samplers import BaseSampler, GridSampler
from optuna.trial import FrozenTrial, Trial, TrialState

from sweepmaster.config import PRUNER_CLASSES, SAMPLER_CLASSES, SweepConfig
from sweepmaster.errors import ConfigError, StorageError
from sweepmaster.store.engine import first_line, masked_url

__all__ = [
    "AskTellGridSampler",
    "INTERRUPTED_ATTR",
    "FAIL_REASON_ATTR",
    "build_pruner",
    "build_sampler",
    "count_finished",
    "fail_trial",
    "next_trial",
    "open_study",
    "requeue_interrupted",
]

#: System attribute set on trials stopped from outside (Ctrl-C, a lost worker): they run again.
INTERRUPTED_ATTR = "sweepmaster:interrupted"
#: System attribute holding a failed trial's reason, one line.
FAIL_REASON_ATTR = "fail_reason"

_FINISHED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


class AskTellGridSampler(GridSampler):
    """Optuna's ``GridSampler`` for the ask-and-tell loop of a sweep.

    ``GridSampler.after_trial`` calls ``study.stop()`` once the grid is exhausted, which Optuna
    only allows inside ``study.optimize``; told from a sweep, the last cell would raise. The
    sweep loop asks :meth:`is_exhausted` itself (:func:`next_trial`), so this does nothing there.
    """

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        """Do nothing: :func:`next_trial` ends the sweep when the grid is exhausted."""


def build_sampler(config: SweepConfig) -> BaseSampler:
    """Build the Optuna sampler named by ``study.sampler``, seeded with ``study.seed``.

    ``grid`` uses :meth:`SweepConfig.grid_space` as its search space; constants (``value:``) are
    not sampled.

    Raises:
        ConfigError: A grid was asked for over a space it cannot enumerate.
    """
    sampler = config.study.sampler
    kwargs: dict[str, Any] = dict(sampler.kwargs())
    cls = SAMPLER_CLASSES[sampler.type]
    if sampler.type == "grid":
        return AskTellGridSampler(config.grid_space(), seed=config.study.seed, **kwargs)
    if config.study.seed is not None:
        kwargs.setdefault("seed", config.study.seed)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(config.source, "study.sampler", str(exc)) from exc


def build_pruner(config: SweepConfig) -> optuna.pruners.BasePruner:
    """Build the Optuna pruner named by ``study.pruner`` (``none`` is ``NopPruner``).

    Raises:
        ConfigError: Optuna rejects the pruner's arguments.
    """
    pruner = config.study.pruner
    try:
        return PRUNER_CLASSES[pruner.type](**pruner.kwargs())
    except (TypeError, ValueError) as exc:
        raise ConfigError(config.source, "study.pruner", str(exc)) from exc


def open_study(config: SweepConfig, storage_url: str) -> optuna.Study:
    """Create the sweep's study on ``storage_url``, or load it if it exists.

    Args:
        config: The sweep; the study is named ``config.name``.
        storage_url: SQLAlchemy URL of Optuna's RDB storage.

    Returns:
        The study, with the configured sampler and pruner.

    Raises:
        StorageError: The storage is unreachable, or the existing study has another direction.
    """
    engine_kwargs: dict[str, Any] = {}
    if storage_url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 30}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    shown = masked_url(storage_url)
    try:
        storage = optuna.storages.RDBStorage(storage_url, engine_kwargs=engine_kwargs)
    except Exception as exc:  # sqlalchemy / driver errors of every kind
        raise StorageError(f"cannot open Optuna storage {shown}: {first_line(exc)}") from exc
    optuna.logging.set_verbosity(logging.WARNING)
    try:
        return optuna.create_study(
            storage=storage,
            study_name=config.name,
            direction=config.study.direction,
            sampler=build_sampler(config),
            pruner=build_pruner(config),
            load_if_exists=True,
        )
    except ValueError as exc:
        raise StorageError(
            f"study {config.name!r} in {shown} does not match the sweep: {first_line(exc)}"
        ) from exc


def count_finished(study: optuna.Study) -> int:
    """Return the number of COMPLETE and PRUNED trials: those a relaunch never runs again."""
    return len(study.get_trials(deepcopy=False, states=_FINISHED_STATES))


def requeue_interrupted(study: optuna.Study) -> int:
    """Queue again every interrupted trial whose parameters have not run since.

    A trial marked with :data:`INTERRUPTED_ATTR` (Ctrl-C, a lost worker) is enqueued with its
    parameters unless a COMPLETE, PRUNED, RUNNING or WAITING trial already has them.

    Returns:
        The number of trials enqueued.
    """
    trials = study.get_trials(deepcopy=False)
    taken = [
        t.params
        for t in trials
        if t.state in (*_FINISHED_STATES, TrialState.RUNNING, TrialState.WAITING)
    ]
    num_enqueued = 0
    for t in trials:
        if t.state != TrialState.FAIL or not t.system_attrs.get(INTERRUPTED_ATTR):
            continue
        if t.params in taken:
            continue
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        taken.append(t.params)
        num_enqueued += 1
    return num_enqueued


def next_trial(study: optuna.Study, config: SweepConfig, n_trials: int) -> Trial | None:
    """Ask Optuna for the sweep's next trial, or ``None`` when the sweep is done.

    The sweep is done when ``n_trials`` trials have finished (COMPLETE or PRUNED; failed ones
    do not count), or, for a grid, when every cell has finished and nothing is queued.

    Args:
        study: The sweep's study.
        config: The sweep; its search space is asked for all at once.
        n_trials: Finished trials the sweep wants in total.
    """
    if count_finished(study) >= n_trials:
        return None
    num_waiting = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    sampler = study.sampler
    if num_waiting == 0 and isinstance(sampler, GridSampler) and sampler.is_exhausted(study):
        return None
    return study.ask(fixed_distributions=config.search_space())


def fail_trial(study: optuna.Study, trial: Trial | FrozenTrial, reason: str, *,
               interrupted: bool = False) -> None:
    """Tell Optuna a trial failed, recording its one-line ``reason``.

    Args:
        study: The sweep's study.
        trial: The running trial.
        reason: Why it failed, shown by ``sweepmaster status``.
        interrupted: The trial was stopped from outside and should run again on relaunch.
    """
    storage = study._storage
    storage.set_trial_system_attr(trial._trial_id, FAIL_REASON_ATTR, reason)
    if interrupted:
        storage.set_trial_system_attr(trial._trial_id, INTERRUPTED_ATTR, True)
    study.tell(trial.number, state=TrialState.FAIL)
