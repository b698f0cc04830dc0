"""Launch orchestration: config -> study -> jobs -> executor -> results.

:func:`run_sweep` is what ``sweepmaster launch`` runs: it runs the pre-launch checks of
:mod:`sweepmaster.config.preflight` (unless told the caller ran them), brings the database up to
head, opens the Optuna study, and asks for trials until the sweep is done (the loop is
:class:`sweepmaster.sweep.launch.Launch`). Each trial becomes a
:class:`~sweepmaster.workload.spec.TrainSpec` trained by the runtime's executor, alone or with
same-architecture trials as one fused array (``resources.fusion``); progress goes to
sweepmaster's tables (batched) and intermediate values to Optuna (pruning honoured).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, Trial, TrialState
from sqlalchemy.engine import Engine

from sweepmaster import study as study_manager
from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.train_specs import TokenData, TrialSpecs, prepare_data
from sweepmaster.errors import DiskFullError, StorageError, disk_full_cause
from sweepmaster.runtime import ShardExecutor
from sweepmaster.runtime.events import EvalEvent, StepEvent, TaskRecord
from sweepmaster.store import (
    ProgressRecorder,
    TaskEventRecorder,
    create_store_engine,
    current_revision,
    get_or_create_sweep,
    get_sweep,
    set_checkpoint_paths,
    set_sweep_status,
    upgrade_to_head,
)
from sweepmaster.store.engine import masked_text
from sweepmaster.store.fusion import FusionGroupRecorder, StoreFusionCache
from sweepmaster.store.locks import schema_lock, study_lock
from sweepmaster.store.migrate import check_optuna_schema
from sweepmaster.store.models import SweepStatus
from sweepmaster.store.partitions import StorePlanCache
from sweepmaster.store.retry import RetryPolicy, run_with_retry
from sweepmaster.store.workers import forget_idle_worker, list_workers
from sweepmaster.sweep.identity import check_identity
from sweepmaster.sweep.kept_weights import FinalWeightsKeeper, adopt_old_layout
from sweepmaster.sweep.launch import Launch, max_concurrent_trials
from sweepmaster.sweep.observer import SweepObserver
from sweepmaster.sweep.resume import (
    original_trial_number,
    requeue_crashed,
    resume_state_dir,
    sweep_output_dir,
)
from sweepmaster.sweep.signals import interrupt_reason, stop_on_signals
from sweepmaster.sweep.trackers import TrialTrackers
from sweepmaster.sweep.workers import WorkerSession
from sweepmaster.workload import TrainSpec

__all__ = ["SweepObserver", "SweepOutcome", "final_status", "max_concurrent_trials", "run_sweep"]


_ONCE = RetryPolicy(timeout_s=0.0)


@dataclass(frozen=True)
class SweepOutcome:
    """What one launch did.

    Attributes:
        name: The sweep (and study) name.
        storage: The storage URL, its password masked
            (:func:`~sweepmaster.store.engine.masked_text`).
        num_run: Trials this launch trained.
        num_finished: COMPLETE + PRUNED trials in the study after this launch.
        num_failed: Trials of this launch that failed.
        best_number: Number of the best COMPLETE trial, or ``None``.
        best_value: Its objective, or ``None``.
        status: How the sweep ended (:func:`final_status`): ``completed``, or ``incomplete``
            (fewer trials finished than wanted) or ``failed`` (none finished); ``launch``
            exits with code 1 for the last two.
    """

    name: str
    storage: str
    num_run: int
    num_finished: int
    num_failed: int
    best_number: int | None
    best_value: float | None
    status: SweepStatus = "completed"


def run_sweep(config: SweepConfig, *, storage: str | None = None, n_trials: int | None = None,
              executor: ShardExecutor | None = None, observer: SweepObserver | None = None,
              preflight: bool = True) -> SweepOutcome:
    """Run (or resume) a sweep until it is done, training its trials concurrently.

    Trials are asked from Optuna while the executor has room (:func:`max_concurrent_trials`),
    grouped into fused arrays of same-architecture trials per ``resources.fusion`` (see
    :mod:`sweepmaster.sweep.launch`), trained by the executor under Sharded-LRTF (several per
    device when they spill, Hydra's SHARP), and told to Optuna as they end. The executor's shard
    tasks are recorded as the sweep's device timeline, fused arrays in ``sm_fusion_groups``.

    Args:
        config: The validated sweep.
        storage: Storage URL overriding ``config.storage``.
        n_trials: Finished trials wanted in total, overriding ``study.n_trials`` (default: the
            grid size for a grid).
        executor: The executor to train on (its own ``fusion`` setting applies); default one
            on ``resources.devices`` with ``resources.fusion``, caching plans and fusion
            measurements in the storage.
        observer: Receives progress for display (from the executor's worker threads too).
        preflight: Run the checks ``sweepmaster launch`` runs before writing anything
            (:func:`~sweepmaster.config.preflight.check_environment` and
            :func:`~sweepmaster.config.preflight.check_sweep`). ``False`` skips them (a caller that
            ran them already): a trial that cannot train then fails alone and the sweep goes on.

    Returns:
        What this launch did.

    Raises:
        ConfigError: With ``preflight``, the sweep cannot train (a model config that cannot
            be built, data that are not UTF-8 or fill no batch, an output path that is a
            file): nothing is written then.
        StorageError: With ``preflight``, ``$SWEEPMASTER_STORAGE_RETRY_S`` is not a number of
            seconds: nothing is written then.
        SweepmasterError: The storage is unusable, the data are missing, or the study is not
            this sweep's (:func:`~sweepmaster.sweep.identity.check_identity`): nothing is
            written then.
        StorageError: The database stayed unreachable longer than
            ``$SWEEPMASTER_STORAGE_RETRY_S``; the running trials resume on relaunch.
        KeyboardInterrupt: Ctrl-C, or SIGTERM (:class:`~sweepmaster.sweep.signals.Terminated`,
            :func:`~sweepmaster.sweep.signals.stop_on_signals`; a second signal while stopping is
            ignored); the running trials are marked FAIL (interrupted, they run
            again on relaunch) and the sweep ``interrupted`` before this propagates.
    """
    if preflight:
        from sweepmaster.config.preflight import check_environment, check_sweep

        check_environment()
        check_sweep(config, launching=True)
    from sweepmaster.config.value_checks import check_storage_option

    check_storage_option(storage)
    url = storage or config.storage
    study_manager.check_storage_writable(url)
    engine = create_store_engine(url)
    with stop_on_signals(), contextlib.ExitStack() as closing:  # closed, a SQLite -wal merged
        closing.callback(engine.dispose)
        return _run_sweep(config, url, engine, closing, n_trials, executor,
                          observer or SweepObserver())


def _run_sweep(config: SweepConfig, url: str, engine: Engine, closing: contextlib.ExitStack,
               n_trials: int | None, executor: ShardExecutor | None,
               observer: SweepObserver) -> SweepOutcome:
    """:func:`run_sweep` on its store's ``engine``; ``closing`` closes the study's storage."""
    _check_can_join(engine, url, config)  # refused before anything (a lock file) is made
    with schema_lock(engine):  # launches and workers starting together create things once
        _check_can_join(engine, url, config)  # another launch may have created it meanwhile
        upgrade_to_head(engine)
        study, config = study_manager.open_study(config, url)  # the sweep's trial heartbeat
        closing.callback(study_manager.close_study, study)
        info = get_or_create_sweep(engine, config.name, study.study_name,
                                   config.canonical_text())
        moved = adopt_old_layout(config, info, study, engine)  # once, by the first launch
    if moved is not None:
        observer.message(moved)
    sweep_dir = sweep_output_dir(config, info)
    if config.output.report_to:  # one run per trial in each tracker, fed as the display is
        trackers = TrialTrackers(config.output.report_to, config.name, sweep_dir,
                                 config.constants(), observer.message)
        closing.callback(trackers.close)
        observer = _TrackingObserver(observer, trackers)
    target = n_trials or config.study.n_trials or config.grid_size()
    set_sweep_status(engine, info.id, "running")
    ask_lock = functools.partial(study_lock, engine, study.study_name)
    with ask_lock():  # workers starting together must not queue the same trial twice
        num_requeued = study_manager.requeue_interrupted(study)
        num_crashed = requeue_crashed(study, sweep_dir)
    if num_requeued:
        observer.message(f"re-queued {num_requeued} interrupted trial(s)")
    if num_crashed:
        observer.message(f"re-queued {num_crashed} trial(s) whose process died, to resume from "
                         "their checkpoints")
    observer.sweep_started(config.name, target, study_manager.count_finished(study))

    own_executor = executor is None
    if executor is None:
        executor = ShardExecutor(config.resources.devices,
                                 device_memory=config.resources.device_memory,
                                 plan_cache=StorePlanCache(engine),
                                 fusion=config.resources.fusion,
                                 fusion_cache=StoreFusionCache(engine),
                                 pipeline=config.resources.pipeline == "auto",
                                 update_on=config.resources.update_on)
    session = WorkerSession(engine, info.id, config.resources.devices).__enter__()
    try:
        launch = Launch(config, study, executor, _TrialSpecMaker(config, observer, sweep_dir),
                        ProgressRecorder(engine, info.id, worker_id=session.worker_id),
                        TaskEventRecorder(engine, info.id),
                        FusionGroupRecorder(engine, info.id), observer,
                        FinalWeightsKeeper(config, study, sweep_dir,
                                         functools.partial(set_checkpoint_paths, engine,
                                                           info.id)),
                        ask_lock=ask_lock)
    except BaseException:
        session.__exit__(None, None, None)
        raise
    executor.add_task_listener(launch.task_finished)
    storage_lost = finished = False
    try:
        launch.run(target)
        finished = True
    except KeyboardInterrupt as stop:
        launch.interrupt(interrupt_reason(stop))
        _set_status_unless_joined(engine, info.id, session, "interrupted")
        raise
    except StorageError as err:  # the database stayed away longer than the retry window
        storage_lost = True
        launch.abandon()
        session.retry = _ONCE  # what is still written is tried once: the window has passed
        with contextlib.suppress(StorageError):
            _set_status_unless_joined(engine, info.id, session, "interrupted", _ONCE)
        if disk_full_cause(err) is not None:  # SQLite's file (or the server's disk) is full
            database = engine.url.database if engine.dialect.name == "sqlite" else None
            raise DiskFullError(database or masked_text(url), "the sweep's database") from err
        raise
    except BaseException:
        launch.interrupt("the sweep stopped")
        _set_status_unless_joined(engine, info.id, session, "failed")
        raise
    finally:
        if own_executor and finished:  # every trial has its result; the jobs' last task
            executor.close()  # records arrive before the timeline's final write
        executor.remove_task_listener(launch.task_finished)
        if not storage_lost:  # else what the recorders buffer is lost; the trials are not
            launch.flush()
        if own_executor:  # a stopped trial ends at its next step or shard task
            executor.close(cancel=True)
        session.__exit__(None, None, None)
        if finished and launch.num_run == 0 and session.worker_id is not None:
            with contextlib.suppress(StorageError):  # nothing ran: no worker row to keep
                forget_idle_worker(engine, session.worker_id, retry=session.retry)
    trials = run_with_retry(lambda: study.get_trials(deepcopy=False),
                            "read the trials of the study")
    status = final_status(trials, target)
    _set_status_unless_joined(engine, info.id, session, status)
    best_number = best_value = None
    if any(t.state == TrialState.COMPLETE for t in trials):
        best_number, best_value = study.best_trial.number, study.best_value
    return SweepOutcome(config.name, masked_text(url), launch.num_run,
                        study_manager.count_finished(study), launch.num_failed, best_number,
                        best_value, status)


def final_status(trials: list[FrozenTrial], target: int) -> SweepStatus:
    """How a sweep ended, from its trials: ``completed``, ``incomplete`` or ``failed``.

    ``completed``: ``target`` trials finished (COMPLETE or PRUNED), or trials of other
    workers are still running or queued (the sweep goes on there). ``failed``: none finished.
    ``incomplete``: some did, fewer than ``target`` (grid cells failed, or were abandoned
    after ``resources.trial_heartbeat.max_retry`` retries).

    Args:
        trials: Every trial of the sweep's study.
        target: Finished trials the sweep wants.
    """
    finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    if finished >= target or any(t.state in (TrialState.RUNNING, TrialState.WAITING)
                                 for t in trials):
        return "completed"
    return "incomplete" if finished else "failed"


def _check_can_join(engine: Engine, url: str, config: SweepConfig) -> None:
    """Refuse, reading only, a database or study this sweep cannot run on or join.

    Raises:
        StorageError: Optuna's tables are of another version, or the study is not this
            sweep's (:func:`~sweepmaster.sweep.identity.check_identity`).
        ConfigError: The sweep is recorded with another direction, metric or search space.
    """
    check_optuna_schema(engine)
    recorded = get_sweep(engine, config.name) if current_revision(engine) else None
    check_identity(config, url, recorded.config_text if recorded else None)


def _set_status_unless_joined(engine: Engine, sweep_id: int, session: WorkerSession,
                              status: SweepStatus, retry: RetryPolicy | None = None) -> None:
    """Set the sweep's status as this worker leaves, unless another worker still trains it."""
    workers = run_with_retry(
        lambda: list_workers(engine, sweep_id, lost_after_s=session.lost_after_s),
        f"read the workers of sweep {sweep_id}", retry)
    others = [w for w in workers if w.status == "running" and w.id != session.worker_id]
    if not others:
        set_sweep_status(engine, sweep_id, status, retry)


class _TrackingObserver(SweepObserver):
    """A sweep's observer that also reports each trial to its experiment trackers."""

    def __init__(self, observer: SweepObserver, trackers: TrialTrackers) -> None:
        self.observer = observer
        self.trackers = trackers

    def message(self, text: str) -> None:
        self.observer.message(text)

    def sweep_started(self, name: str, n_trials: int, n_finished: int) -> None:
        self.observer.sweep_started(name, n_trials, n_finished)

    def trial_started(self, number: int, params: dict[str, Any], total_steps: int,
                      device: str, num_shards: int = 1) -> None:
        self.trackers.started(number, params)
        self.observer.trial_started(number, params, total_steps, device, num_shards)

    def trial_step(self, number: int, event: StepEvent) -> None:
        self.trackers.log(number, {"train_loss": event.train_loss, "lr": event.lr,
                                   "tokens_per_s": event.tokens_per_s}, event.step)
        self.observer.trial_step(number, event)

    def trial_evaluated(self, number: int, event: EvalEvent) -> None:
        self.trackers.log(number, {"eval_loss": event.eval_loss,
                                   "eval_perplexity": event.eval_perplexity}, event.step)
        self.observer.trial_evaluated(number, event)

    def trial_finished(self, number: int, state: str, objective: float | None,
                       reason: str | None) -> None:
        self.trackers.finished(number, state, objective)
        self.observer.trial_finished(number, state, objective, reason)

    def task_finished(self, record: TaskRecord) -> None:
        self.observer.task_finished(record)


class _LaunchData:
    """Each data configuration's token data, tokenized (or read from the cache) once a launch."""

    def __init__(self, observer: SweepObserver) -> None:
        self.observer = observer
        self.blocks: dict[str, TokenData] = {}

    def __call__(self, trial: SweepConfig) -> TokenData:
        key = trial.data.model_dump_json()
        if key not in self.blocks:
            said: list[bool] = []

            def say() -> None:  # only when the token cache misses, and once
                if not said:
                    said.append(True)
                    self.observer.message("tokenizing data (cached after the first time)")

            self.blocks[key] = prepare_data(trial, on_tokenize=say)
        return self.blocks[key]


class _TrialSpecMaker:
    """An Optuna trial's spec (:class:`TrialSpecs`), named and checkpointed per trial."""

    def __init__(self, config: SweepConfig, observer: SweepObserver, sweep_dir: Path) -> None:
        self.specs = TrialSpecs(config, _LaunchData(observer))
        self.sweep_dir = sweep_dir

    def __call__(self, trial: Trial) -> TrainSpec:
        state_dir = resume_state_dir(self.sweep_dir, original_trial_number(trial))
        return self.specs(trial.params, f"trial-{trial.number}", state_dir=state_dir)
