"""Crash-safe resume of a sweep's trials: heartbeats, stale trials, and their checkpoints.

A trial checkpoints its training state every ``train.checkpoint_every`` steps
(:mod:`sweepmaster.runtime.training.checkpoint`) into :func:`resume_state_dir`. When the process
training it dies (``kill -9``, a lost machine), the trial stays RUNNING in Optuna's storage; its
heartbeat (Optuna's trial heartbeat, ``RDBStorage(heartbeat_interval=..., grace_period=...)``,
recorded here by :class:`TrialHeartbeat` because the ask-and-tell loop does not run
``Study.optimize``'s heartbeat thread) then stops. :func:`fail_stale` (Optuna's
``fail_stale_trials``), called when a launch starts and periodically while it runs, marks such
trials FAIL, and Optuna's ``RetryHeartbeatStaleTrialCallback`` enqueues a WAITING copy with the
same parameters (and, for a grid, the same ``grid_id``, so the grid never hands that cell out
again). The copy's state directory is keyed by the *original* trial's number
(:func:`original_trial_number`), so it resumes from the dead trial's last checkpoint and ends
with the weights of an uninterrupted run.

Example:
    >>> kwargs = heartbeat_storage_kwargs(config.resources.trial_heartbeat)  # doctest: +SKIP
    >>> fail_stale(study)  # doctest: +SKIP
    >>> with TrialHeartbeat(study._storage) as heartbeat:  # doctest: +SKIP
    ...     heartbeat.add(trial._trial_id)
    ...     ...  # train; heartbeat.remove(trial._trial_id) once told
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import warnings
from collections.abc import Collection
from pathlib import Path
from types import TracebackType
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, Trial, TrialState

from sweepmaster.config import SweepConfig, TrialHeartbeatConfig
from sweepmaster.store.queries import SweepInfo
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = [
    "RETRY_OF_ATTR",
    "TrialHeartbeat",
    "fail_stale",
    "heartbeat_storage_kwargs",
    "original_trial_number",
    "resume_state_dir",
    "sweep_output_dir",
]

_log = logging.getLogger(__name__)

#: User attribute of a trial re-queued after an interruption: the number of the trial it repeats.
RETRY_OF_ATTR = "retry_of"
#: System attribute Optuna's retry callback sets: the first trial of a series of retries.
_FAILED_TRIAL_ATTR = "failed_trial"


def heartbeat_storage_kwargs(config: TrialHeartbeatConfig) -> dict[str, Any]:
    """Keyword arguments of ``optuna.storages.RDBStorage`` enabling the trial heartbeat.

    Args:
        config: ``resources.trial_heartbeat``.

    Returns:
        ``heartbeat_interval``, ``grace_period`` (seconds) and the stale-trial callback that
        re-queues a stale trial at most ``max_retry`` times; empty when ``interval_s`` is null.
    """
    if config.interval_s is None:
        return {}
    retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    with warnings.catch_warnings():  # experimental in Optuna: a warning per construction
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if retry_cls is not None:
            callback = {"heartbeat_stale_trial_callback": retry_cls(max_retry=config.max_retry)}
        else:  # Optuna < 4.9
            callback = {"failed_trial_callback":
                        optuna.storages.RetryFailedTrialCallback(max_retry=config.max_retry)}
    return {"heartbeat_interval": config.interval_s, "grace_period": config.grace_s(),
            **callback}


def fail_stale(study: optuna.Study, retry: RetryPolicy | None = None,
               keep: Collection[int] = ()) -> int:
    """Fail the study's RUNNING trials whose heartbeat is older than the grace period.

    What Optuna's ``fail_stale_trials`` does, less the trials in ``keep``: each stale trial
    becomes FAIL and the storage's stale-trial callback re-queues it (a WAITING copy with its
    parameters, ``failed_trial`` and ``retry_history`` system attributes). A trial that never
    recorded a heartbeat is never stale. Safe to call from several processes: a trial is failed
    (and re-queued) once.

    A process passes the trials it trains itself as ``keep``: their heartbeat may be old only
    because the database was unreachable for a while (its recordings failed), and they are
    alive, so failing them would throw away live training.

    Args:
        study: The sweep's study (a no-op unless its storage has a heartbeat interval).
        retry: How long to retry through a database outage.
        keep: Trial ids (``trial._trial_id``) never failed here: this process's live trials.

    Returns:
        How many trials, not in ``keep``, are RUNNING with a stale heartbeat before the call
        (0 when the heartbeat is off).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    storage = study._storage
    if not is_heartbeat_enabled(storage):
        return 0
    failed: list[int] = []  # failed by this call, over every attempt: re-queued once each

    def fail() -> int:
        stale = [trial_id
                 for trial_id in storage._get_stale_trial_ids(study._study_id)  # type: ignore[attr-defined]
                 if trial_id not in keep]
        for trial_id in stale:
            try:
                if storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                    failed.append(trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another process failed it first (and re-queues it)
        return len(stale)

    num_stale = run_with_retry(fail, "fail trials of dead processes", retry)
    get_callback = getattr(storage, "get_heartbeat_stale_trial_callback", None)
    if get_callback is None:  # Optuna < 4.9
        get_callback = storage.get_failed_trial_callback  # type: ignore[attr-defined]
    callback = get_callback()
    if callback is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            for trial_id in failed:
                frozen = _read_trial(storage, trial_id, retry)
                callback(study, copy.deepcopy(frozen))
    if num_stale:
        _log.warning("%d trial(s) of a dead process failed by heartbeat and re-queued", num_stale)
    return num_stale


def _read_trial(storage: BaseStorage, trial_id: int, retry: RetryPolicy | None) -> FrozenTrial:
    return run_with_retry(lambda: storage.get_trial(trial_id), "read a trial of a dead process",
                          retry)


class TrialHeartbeat:
    """Records the heartbeat of every running trial of this process on one background thread.

    ``Study.optimize`` runs one heartbeat thread per trial; a sweep asks and tells trials itself,
    so it keeps them alive here instead: :meth:`add` records a first heartbeat at once (a trial
    without one is never considered stale), then the thread records one for every added trial
    each ``heartbeat_interval`` seconds until :meth:`remove` or :meth:`close`. A failed
    recording (a database outage) is logged and tried again next interval. Thread-safe.

    Args:
        storage: The study's storage; without a heartbeat interval this does nothing.
    """

    def __init__(self, storage: BaseStorage) -> None:
        self._storage = storage
        self._interval_s: float | None = None
        if is_heartbeat_enabled(storage):
            self._interval_s = float(storage.get_heartbeat_interval())  # type: ignore[attr-defined]
        self._trial_ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """Whether the storage has a heartbeat interval (otherwise every call is a no-op)."""
        return self._interval_s is not None

    def add(self, trial_id: int) -> None:
        """Record the trial's heartbeat now and keep recording it (``trial._trial_id``)."""
        if self._interval_s is None:
            return
        self._beat(trial_id)
        with self._lock:
            self._trial_ids.add(trial_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trial-heartbeat",
                                                daemon=True)
                self._thread.start()

    def trial_ids(self) -> frozenset[int]:
        """The trials whose heartbeat this process records (live, not told yet)."""
        with self._lock:
            return frozenset(self._trial_ids)

    def remove(self, trial_id: int) -> None:
        """Stop recording the trial's heartbeat (it finished, or was told FAIL)."""
        with self._lock:
            self._trial_ids.discard(trial_id)

    def close(self) -> None:
        """Stop the thread; the trials' heartbeats age from now on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> TrialHeartbeat:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _run(self) -> None:
        assert self._interval_s is not None
        while not self._stop.wait(self._interval_s):
            with self._lock:
                trial_ids = sorted(self._trial_ids)
            for trial_id in trial_ids:
                self._beat(trial_id)

    def _beat(self, trial_id: int) -> None:
        try:
            self._storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]
        except Exception as exc:  # a database outage: the next interval tries again
            _log.warning("heartbeat of trial id %d not recorded: %s", trial_id, exc)


def original_trial_number(trial: Trial | FrozenTrial, study: optuna.Study | None = None) -> int:
    """The number of the first trial of the series of retries ``trial`` belongs to.

    Follows Optuna's ``failed_trial`` system attribute (a heartbeat-stale retry:
    ``RetryHeartbeatStaleTrialCallback.retried_trial_number``) and sweepmaster's
    :data:`RETRY_OF_ATTR` user attribute (a trial re-queued after Ctrl-C), through the study's
    trials, back to a trial that repeats none.

    Args:
        trial: A trial of ``study``.
        study: Its study (default: ``trial.study`` of a live :class:`~optuna.trial.Trial`).

    Returns:
        The trial number whose state directory the series shares.
    """
    if study is None:
        assert isinstance(trial, Trial), "pass the study of a frozen trial"
        study = trial.study
    by_number: dict[int, FrozenTrial] | None = None
    number = trial.number
    system_attrs, user_attrs = _attrs(trial, study)
    seen = {number}
    while True:
        earlier = system_attrs.get(_FAILED_TRIAL_ATTR, user_attrs.get(RETRY_OF_ATTR))
        if not isinstance(earlier, int) or earlier in seen:
            return number
        if by_number is None:
            by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
        if earlier not in by_number:
            return earlier
        seen.add(earlier)
        number = earlier
        system_attrs, user_attrs = by_number[earlier].system_attrs, by_number[earlier].user_attrs


def _attrs(trial: Trial | FrozenTrial, study: optuna.Study) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
    if isinstance(trial, FrozenTrial):
        return trial.system_attrs, trial.user_attrs
    storage = study._storage
    return (storage.get_trial_system_attrs(trial._trial_id),
            storage.get_trial_user_attrs(trial._trial_id))


def sweep_output_dir(config: SweepConfig, sweep: SweepInfo) -> Path:
    """The directory of one sweep's files: ``<output.dir>/<sweep>-<key>``.

    ``key`` is 8 hex digits of a hash of the sweep's record in its database (its name, id and
    creation time), so two sweeps of the same name in two databases (or in one database
    deleted and created again) never share a directory, while every worker of one sweep,
    whatever URL it reaches the database by, uses the same one. It holds the saved weights
    (``trial-<n>/``) and the training state of unfinished trials (``state/``).

    Args:
        config: The sweep (``output.dir``).
        sweep: Its record (:func:`~sweepmaster.store.get_or_create_sweep`).
    """
    identity = f"{sweep.id}\n{sweep.name}\n{sweep.created_at.isoformat()}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return Path(config.output.dir) / f"{config.name}-{key}"


def resume_state_dir(sweep_dir: Path, trial_number: int) -> Path:
    """The training-state directory of a trial series: ``<sweep_dir>/state/trial-<n>``.

    Args:
        sweep_dir: The sweep's :func:`sweep_output_dir`.
        trial_number: The series' :func:`original_trial_number`.
    """
    return sweep_dir / "state" / f"trial-{trial_number}"
