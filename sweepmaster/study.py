"""Optuna study manager: storage, sampler, pruner, and the ask/tell side of a sweep.

A sweep is one Optuna study named like the sweep, on the sweep's storage URL. Relaunching the
same sweep loads the study (``load_if_exists``): trials that finished are never run again, a grid
ends when every cell has finished, and trials that were interrupted (Ctrl-C, a crash) are queued
again with their parameters.

Every call into Optuna's storage made here is retried through a short database outage
(:func:`~sweepmaster.store.retry.run_with_retry`; a persistent one raises
:class:`~sweepmaster.errors.StorageError`) where repeating it is safe: :func:`report` and
:func:`set_user_attr` are upserts, :func:`tell` and :func:`fail_trial` skip a trial an earlier
attempt already finished, :func:`next_trial` re-reads the parameters an earlier attempt stored
before suggesting the rest, and :func:`requeue_interrupted` re-reads the queue before every
attempt. Only a trial whose creation committed while its connection was lost can be left
behind, RUNNING and without parameters, as with any Optuna client.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, GridSampler
from optuna.trial import FrozenTrial, Trial, TrialState
from sqlalchemy.engine import make_url

from sweepmaster.errors import ConfigError, StorageError
from sweepmaster.store.engine import (
    first_line,
    guard_statements,
    masked_url,
    postgres_connect_args,
)
from sweepmaster.store.locks import schema_lock
from sweepmaster.store.retry import RetryPolicy, run_with_retry

if TYPE_CHECKING:
    from sweepmaster.config.schema import SweepConfig

_log = logging.getLogger(__name__)

__all__ = [
    "AskTellGridSampler",
    "PRUNER_CLASSES",
    "SAMPLER_CLASSES",
    "INTERRUPTED_ATTR",
    "FAIL_REASON_ATTR",
    "TRIAL_HEARTBEAT_ATTR",
    "build_pruner",
    "build_sampler",
    "check_storage_writable",
    "close_study",
    "count_finished",
    "fail_trial",
    "next_trial",
    "open_study",
    "report",
    "requeue_interrupted",
    "set_user_attr",
    "should_prune",
    "tell",
]

#: Study system attribute: the ``resources.trial_heartbeat`` every process of the sweep uses.
TRIAL_HEARTBEAT_ATTR = "sweepmaster:trial_heartbeat"
#: System attribute set on trials stopped from outside (Ctrl-C, a lost worker): they run again.
INTERRUPTED_ATTR = "sweepmaster:interrupted"
#: System attribute holding a failed trial's reason, one line.
FAIL_REASON_ATTR = "fail_reason"

_FINISHED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)

#: ``study.sampler.type`` -> the Optuna sampler class: the one list of samplers. The sweep
#: file's schema takes these names, and the keywords its constructor takes (checked against its
#: signature, :func:`~sweepmaster.config.search_space.check_optuna_kwargs`); adding a sampler
#: is one entry here.
SAMPLER_CLASSES: dict[str, type[BaseSampler]] = {
    "grid": optuna.samplers.GridSampler, "tpe": optuna.samplers.TPESampler,
    "random": optuna.samplers.RandomSampler, "cmaes": optuna.samplers.CmaEsSampler,
    "gp": optuna.samplers.GPSampler, "qmc": optuna.samplers.QMCSampler,
}
#: ``study.pruner.type`` -> the Optuna pruner class, as :data:`SAMPLER_CLASSES`.
PRUNER_CLASSES: dict[str, type[optuna.pruners.BasePruner]] = {
    "none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
    "hyperband": optuna.pruners.HyperbandPruner,
    "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
}


class AskTellGridSampler(GridSampler):
    """Optuna's ``GridSampler`` for the ask-and-tell loop of a sweep.

    ``GridSampler.after_trial`` calls ``study.stop()`` once the grid is exhausted, which Optuna
    only allows inside ``study.optimize``; told from a sweep, the last cell would raise. The
    sweep loop asks :meth:`is_exhausted` itself (:func:`next_trial`), so this does nothing there.
    """

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        """Do nothing: :func:`next_trial` ends the sweep when the grid is exhausted."""

    def num_unstarted(self, study: optuna.Study) -> int:
        """Cells no trial has started: neither finished nor running.

        Unlike :meth:`is_exhausted`, a cell another running trial trains counts as taken, so a
        sweep running several trials at once never asks for a cell twice.
        """
        taken = {
            t.system_attrs["grid_id"]
            for t in study._storage.get_all_trials(study._study_id, deepcopy=False)
            if "grid_id" in t.system_attrs
            and (t.state.is_finished() or t.state == TrialState.RUNNING)
            and self._same_search_space(t.system_attrs["search_space"])
        }
        return len(set(range(len(self._all_grids))) - taken)


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


def check_storage_writable(storage_url: str) -> None:
    """Refuse, before opening it, a SQLite database this process cannot write.

    SQLite opens a file it cannot write read-only without a word, and in WAL mode then makes
    ``-wal`` and ``-shm`` files beside it that stay after the write fails; a launch writes, so
    a read-only file (its mode, or a ``mode=ro`` / ``immutable`` URI) or a directory that
    cannot take those files is refused first, leaving nothing behind. Other databases are
    checked by connecting.

    Raises:
        StorageError: ``"cannot write storage <url>: <why>"``.
    """
    import os
    from pathlib import Path

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(storage_url)
    except ArgumentError:
        return  # the engine's own message says so
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return
    shown = masked_url(storage_url)
    query = parsed.query
    if query.get("mode") == "ro" or query.get("immutable") == "1" \
            or "mode=ro" in database or "immutable=1" in database:
        raise StorageError(f"cannot write storage {shown}: it is opened read-only (mode=ro or "
                           "immutable); a launch records its trials there")
    path = Path(database.removeprefix("file:").split("?", 1)[0])
    problem = None
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        problem = f"the database file {path} is read-only for this process"
    elif path.parent.is_dir() and not os.access(path.parent, os.W_OK | os.X_OK):
        problem = (f"its directory {path.parent} is read-only for this process (SQLite makes "
                   "its -wal and -shm files beside the database)")
    if problem is not None:
        raise StorageError(f"cannot write storage {shown}: {problem}; a launch records its "
                           "trials there (status and the dashboard only read)")


def open_study(config: SweepConfig, storage_url: str) -> tuple[optuna.Study, SweepConfig]:
    """Create the sweep's study on ``storage_url``, or load it if it exists.

    Every process of one sweep must use the same trial heartbeat: Optuna fails a RUNNING trial
    whose last heartbeat is older than the *checking* process's grace period, so a joining
    process with a shorter grace period than another's heartbeat interval would fail live
    trials. The first process records its ``resources.trial_heartbeat`` on the study (system
    attribute :data:`TRIAL_HEARTBEAT_ATTR`); every later one adopts the recorded interval and
    grace period. ``max_retry`` is each launch's own (``--set
    resources.trial_heartbeat.max_retry=10`` applies to the launch that says so).

    Args:
        config: The sweep; the study is named ``config.name``.
        storage_url: SQLAlchemy URL of Optuna's RDB storage.

    Returns:
        The study, with the configured sampler and pruner, on a storage with Optuna's trial
        heartbeat (:mod:`sweepmaster.sweep.resume`); and ``config`` with the sweep's recorded
        ``resources.trial_heartbeat`` (a copy where it differed).

    Raises:
        StorageError: The storage is unreachable, or the existing study has another direction.
    """
    shown = masked_url(storage_url)
    study = _create_or_load(config, storage_url)
    storage = study._storage
    study_id = study._study_id
    recorded = run_with_retry(lambda: storage.get_study_system_attrs(study_id),
                              "read the study's attributes").get(TRIAL_HEARTBEAT_ATTR)
    mine = config.resources.trial_heartbeat.model_dump()
    if recorded is None:
        run_with_retry(lambda: storage.set_study_system_attr(study_id, TRIAL_HEARTBEAT_ATTR, mine),
                       "record the study's trial heartbeat")
        return study, config
    if isinstance(recorded, dict):  # max_retry: only the checking process's, each launch's own
        recorded = {**recorded, "max_retry": mine["max_retry"]}
    if recorded == mine:
        return study, config
    try:
        adopted = type(config.resources.trial_heartbeat).model_validate(recorded)
    except ValueError as exc:
        raise StorageError(f"study {config.name!r} in {shown} records an invalid trial heartbeat "
                           f"{recorded!r}: {first_line(exc)}") from exc
    _log.warning("sweep %r: using the trial heartbeat interval and grace period it was created "
                 "with (%s), not this file's resources.trial_heartbeat (%s)", config.name,
                 recorded, mine)
    resources = config.resources.model_copy(update={"trial_heartbeat": adopted})
    config = config.model_copy(update={"resources": resources})
    return _create_or_load(config, storage_url), config


def _create_or_load(config: SweepConfig, storage_url: str) -> optuna.Study:
    engine_kwargs: dict[str, Any] = {}
    if storage_url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 30}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
        url = make_url(storage_url)
        if url.get_backend_name() == "postgresql":  # never waits forever on a silent network
            engine_kwargs["connect_args"] = postgres_connect_args(url)
    shown = masked_url(storage_url)
    with schema_lock(storage_url):  # Optuna creates its tables here: one process at a time
        return _create_or_load_locked(config, storage_url, engine_kwargs, shown)


def _create_or_load_locked(config: SweepConfig, storage_url: str, engine_kwargs: dict[str, Any],
                           shown: str) -> optuna.Study:
    from sweepmaster.sweep.resume import heartbeat_storage_kwargs  # the crash-retry callback

    try:
        with warnings.catch_warnings():  # the heartbeat arguments are experimental in Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(
                storage_url, engine_kwargs=engine_kwargs,
                **heartbeat_storage_kwargs(config.resources.trial_heartbeat))
    except Exception as exc:  # sqlalchemy / driver errors of every kind
        raise StorageError(f"cannot open Optuna storage {shown}: {first_line(exc)}") from exc
    guard_statements(storage.engine)
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


def close_study(study: optuna.Study) -> None:
    """Close the pooled database connections of ``study``'s storage (an RDB storage's).

    The study stays usable: connections are opened again when needed. Closing the last
    connection of a SQLite database in WAL mode merges its ``-wal`` file into the database and
    removes it, so the database file alone holds every trial (e.g. when copied elsewhere).
    """
    storage = study._storage
    backend = getattr(storage, "_backend", storage)  # Optuna caches an RDB storage's reads
    if isinstance(backend, optuna.storages.RDBStorage):
        backend.engine.dispose()


def count_finished(study: optuna.Study, retry: RetryPolicy | None = None) -> int:
    """Return the number of COMPLETE and PRUNED trials: those a relaunch never runs again."""
    return run_with_retry(
        lambda: len(study.get_trials(deepcopy=False, states=_FINISHED_STATES)),
        "read the trials of the study", retry)


def requeue_interrupted(study: optuna.Study, retry: RetryPolicy | None = None) -> int:
    """Queue again every interrupted trial whose parameters have not run since.

    A trial marked with :data:`INTERRUPTED_ATTR` (Ctrl-C, a lost worker) is enqueued with its
    parameters unless a COMPLETE, PRUNED, RUNNING or WAITING trial already has them.

    Returns:
        The number of trials enqueued (by the last attempt, when the database was retried).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """

    def requeue() -> int:
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

    return run_with_retry(requeue, "queue interrupted trials again", retry)


def next_trial(study: optuna.Study, config: SweepConfig, n_trials: int,
               num_running: int = 0, retry: RetryPolicy | None = None) -> Trial | None:
    """Ask Optuna for the sweep's next trial, or ``None`` when no more should start now.

    None comes when ``n_trials`` trials have finished (COMPLETE or PRUNED; failed ones do not
    count) or will have once the ``num_running`` trials this launch trains finish, or, for a
    grid, when every cell has finished or is running and nothing is queued.

    Args:
        study: The sweep's study.
        config: The sweep; its search space is asked for all at once.
        n_trials: Finished trials the sweep wants in total.
        num_running: Trials this launch is training now.
        retry: How long to retry through a database outage (default from the environment).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    if count_finished(study, retry) + num_running >= n_trials:
        return None

    def exhausted() -> bool:
        if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return False
        sampler = study.sampler
        if isinstance(sampler, AskTellGridSampler):
            return sampler.num_unstarted(study) == 0
        return isinstance(sampler, GridSampler) and sampler.is_exhausted(study)

    if run_with_retry(exhausted, "read the trials of the study", retry):
        return None
    trial = _ask(study, retry)
    space = config.search_space()
    attempts = 0

    def suggest() -> Trial:
        nonlocal attempts
        attempts += 1
        # After a failed attempt, a fresh Trial reads what that attempt already stored; only
        # the parameters still missing are sampled.
        target = trial if attempts == 1 else optuna.Trial(study, trial._trial_id)
        for name, distribution in space.items():
            _suggest(target, name, distribution)
        return target

    return run_with_retry(suggest, f"store the parameters of trial {trial.number}", retry)


def _ask(study: optuna.Study, retry: RetryPolicy | None) -> Trial:
    """``Study.ask()`` step by step, so that a retry never creates a second trial.

    Retrying ``study.ask()`` as a whole would leave a RUNNING trial behind whenever the
    connection dropped after the trial was created but before it was read back. Here the trial
    is claimed from the queue or created in one retried step and read back in another.
    """
    study._thread_local.cached_all_trials = None  # as Study.ask: samplers see every trial
    storage, study_id = study._storage, study._study_id

    def claim_or_create() -> int:
        for waiting in storage.get_all_trials(study_id, deepcopy=False,
                                              states=(TrialState.WAITING,)):
            try:
                if storage.set_trial_state_values(waiting._trial_id, TrialState.RUNNING):
                    return waiting._trial_id
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker ran it meanwhile
        return storage.create_new_trial(study_id)

    trial_id = run_with_retry(claim_or_create, "ask Optuna for a trial", retry)
    return run_with_retry(lambda: optuna.Trial(study, trial_id), "read the new trial", retry)


def _suggest(trial: Trial, name: str, distribution: BaseDistribution) -> Any:
    """Suggest one parameter through Optuna's public ``suggest_*`` API."""
    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    if isinstance(distribution, IntDistribution):
        return trial.suggest_int(name, distribution.low, distribution.high,
                                 step=distribution.step, log=distribution.log)
    assert isinstance(distribution, FloatDistribution), distribution
    return trial.suggest_float(name, distribution.low, distribution.high,
                               step=distribution.step, log=distribution.log)


def report(trial: Trial, value: float, step: int, retry: RetryPolicy | None = None) -> None:
    """``trial.report(value, step)``, retried (an upsert of the step's intermediate value).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    run_with_retry(lambda: trial.report(value, step),
                   f"report step {step} of trial {trial.number}", retry)


def should_prune(trial: Trial, retry: RetryPolicy | None = None) -> bool:
    """``trial.should_prune()``, retried (it only reads).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    return run_with_retry(trial.should_prune, f"ask whether to prune trial {trial.number}",
                          retry)


def set_user_attr(trial: Trial, key: str, value: Any, retry: RetryPolicy | None = None) -> None:
    """``trial.set_user_attr(key, value)``, retried (an upsert).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    run_with_retry(lambda: trial.set_user_attr(key, value),
                   f"set {key!r} of trial {trial.number}", retry)


def tell(study: optuna.Study, trial: Trial | FrozenTrial, value: float | None = None, *,
         state: TrialState = TrialState.COMPLETE, retry: RetryPolicy | None = None) -> None:
    """``study.tell(trial, value, state=state)``, retried; a retry skips a trial already told.

    Args:
        study: The sweep's study.
        trial: The running trial.
        value: Its objective, for ``COMPLETE``.
        state: ``COMPLETE``, ``PRUNED`` or ``FAIL``.
        retry: How long to retry through a database outage (default from the environment).

    Raises:
        ValueError: Optuna refuses the tell (e.g. the trial already finished, on a first
            attempt).
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    values = None if value is None else [value]
    attempts = 0

    def tell_once() -> None:
        nonlocal attempts
        attempts += 1  # an earlier attempt may have committed: then there is nothing to do
        study.tell(trial.number, values, state=state, skip_if_finished=attempts > 1)

    run_with_retry(tell_once, f"tell Optuna how trial {trial.number} ended", retry)


def fail_trial(study: optuna.Study, trial: Trial | FrozenTrial, reason: str, *,
               interrupted: bool = False, retry: RetryPolicy | None = None) -> None:
    """Tell Optuna a trial failed, recording its one-line ``reason``.

    Args:
        study: The sweep's study.
        trial: The running trial.
        reason: Why it failed, shown by ``sweepmaster status``.
        interrupted: The trial was stopped from outside and should run again on relaunch.
        retry: How long to retry through a database outage (default from the environment).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    storage = study._storage
    attrs: Mapping[str, Any] = {FAIL_REASON_ATTR: reason,
                                **({INTERRUPTED_ATTR: True} if interrupted else {})}

    def set_attrs() -> None:
        for key, value in attrs.items():
            storage.set_trial_system_attr(trial._trial_id, key, value)

    run_with_retry(set_attrs, f"record why trial {trial.number} failed", retry)
    tell(study, trial, state=TrialState.FAIL, retry=retry)
