"""Crash-safe resume of a sweep's trials: heartbeats, stale trials, and their checkpoints.

A trial checkpoints its training state every ``train.checkpoint_every`` steps
(:mod:`sweepmaster.runtime.training.training_state`) into :func:`resume_state_dir`. When the
process training it dies (``kill -9``, a lost machine), the trial stays RUNNING in Optuna's
storage; its heartbeat (Optuna's trial heartbeat,
``RDBStorage(heartbeat_interval=..., grace_period=...)``, recorded here by
:class:`TrialHeartbeat` because the ask-and-tell loop does not run ``Study.optimize``'s
heartbeat thread) then stops. :func:`fail_stale` (Optuna's
``fail_stale_trials``), called when a launch starts and periodically while it runs, marks such
trials FAIL (their reason says the process stopped), and :class:`RetryCrashedTrial` enqueues a
WAITING copy with the same parameters (and, for a grid, the same ``grid_id``, so the grid never
hands that cell out again), as Optuna's ``RetryHeartbeatStaleTrialCallback`` does, except that
a crash after which the trial had progressed is not counted against ``max_retry``; a relaunch
queues again a cell abandoned after crashes when it has a checkpoint (:func:`requeue_crashed`).
The copy's state directory is keyed by the *original* trial's number
(:func:`original_trial_number`), so it resumes from the dead trial's last checkpoint, gets the
intermediate values reported before it (:func:`continue_series`), and ends with the weights of
an uninterrupted run.

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
import math
import threading
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import FrozenTrial, Trial, TrialState

from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.sections import TrialHeartbeatConfig
from sweepmaster.store.queries import SweepInfo
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = [
    "CRASHED_ATTR",
    "RESUMED_FROM_ATTR",
    "RETRY_OF_ATTR",
    "RetryCrashedTrial",
    "TrialHeartbeat",
    "continue_series",
    "fail_stale",
    "heartbeat_storage_kwargs",
    "original_trial_number",
    "requeue_crashed",
    "resume_state_dir",
    "sweep_output_dir",
]

_log = logging.getLogger(__name__)

#: User attribute of a trial re-queued after an interruption: the number of the trial it repeats.
RETRY_OF_ATTR = "retry_of"
#: System attribute Optuna's retry callback sets: the first trial of a series of retries.
_FAILED_TRIAL_ATTR = "failed_trial"
#: System attribute of a retry: the trials of its series before it, oldest first (Optuna's).
_RETRY_HISTORY_ATTR = "retry_history"
#: System attribute of a trial failed because its process died (:func:`fail_stale`).
CRASHED_ATTR = "sweepmaster:crashed"
#: System attribute of a trial: the step it started from (its series' checkpoint; 0: none).
RESUMED_FROM_ATTR = "sweepmaster:resumed_from_step"
#: Attributes of one attempt, not carried into its retry.
_ATTEMPT_ATTRS = (CRASHED_ATTR, RESUMED_FROM_ATTR, "fail_reason", "sweepmaster:interrupted")


def heartbeat_storage_kwargs(config: TrialHeartbeatConfig) -> dict[str, Any]:
    """Keyword arguments of ``optuna.storages.RDBStorage`` enabling the trial heartbeat.

    Args:
        config: ``resources.trial_heartbeat``.

    Returns:
        ``heartbeat_interval``, ``grace_period`` (seconds) and the stale-trial callback
        (:class:`RetryCrashedTrial`) that re-queues a stale trial until its process died
        ``max_retry`` more times without progress; empty when ``interval_s`` is null.
    """
    if config.interval_s is None:
        return {}
    name = ("heartbeat_stale_trial_callback"
            if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback")
            else "failed_trial_callback")  # Optuna < 4.9
    return {"heartbeat_interval": config.interval_s, "grace_period": config.grace_s(),
            name: RetryCrashedTrial(config.max_retry)}


class RetryCrashedTrial:
    """The storage's stale-trial callback: re-queue a trial whose process died.

    A process that dies (``kill -9``, a lost machine, the kernel's OOM killer) takes every
    trial it trains with it, a whole fused array at once: that is rarely the fault of any of
    them. So a crash after which the trial's series had made progress (the attempt started
    from a later training-state checkpoint than every attempt before it, recorded by
    :func:`continue_series`) does not count: only crashes in a row from the same checkpoint
    do, ``max_retry`` of them re-queued and the next one not (the trial itself likely kills
    the process: it would never end). What Optuna's ``RetryHeartbeatStaleTrialCallback``
    records is kept: the retry has the trial's parameters, user attributes and system
    attributes (``grid_id``: the grid never hands the cell out again), ``failed_trial`` and
    ``retry_history``.

    Args:
        max_retry: Crashes in a row without progress that are retried; ``None``: every one.
    """

    def __init__(self, max_retry: int | None) -> None:
        self.max_retry = max_retry

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Enqueue the retry of ``trial`` (told FAIL as stale), unless its retries ran out."""
        crashes = _crashes_without_progress(study, trial)
        if self.max_retry is not None and crashes > self.max_retry:
            _log.warning("trial %d is not retried: its process died %d times in a row without "
                         "a new checkpoint (resources.trial_heartbeat.max_retry = %d)",
                         trial.number, crashes, self.max_retry)
            return
        enqueue_retry(study, trial)


def _crashes_without_progress(study: optuna.Study, trial: FrozenTrial) -> int:
    """How many attempts of ``trial``'s series, up to it, died since the series last progressed.

    An attempt progressed when it started from a later checkpoint than every attempt before it
    (:data:`RESUMED_FROM_ATTR`); one that never started training counts as no progress.
    """
    history = [n for n in trial.system_attrs.get(_RETRY_HISTORY_ATTR, []) if n != trial.number]
    by_number = {}
    if history:
        by_number = {t.number: t for t in
                     study._storage.get_all_trials(study._study_id, deepcopy=False)}
    attempts = [by_number.get(n) for n in history] + [trial]
    count, best = 0, -1
    for attempt in attempts:
        start = attempt.system_attrs.get(RESUMED_FROM_ATTR) if attempt is not None else None
        if isinstance(start, int) and start > best:
            best, count = start, 1
        else:
            count += 1
    return count


def enqueue_retry(study: optuna.Study, trial: FrozenTrial) -> None:
    """Queue a WAITING copy of a failed ``trial`` that continues its series of retries.

    As Optuna's ``RetryHeartbeatStaleTrialCallback`` does: parameters, distributions, user and
    system attributes copied (less those of the attempt itself: why it failed, where it
    started), ``failed_trial`` (the series' first trial) and ``retry_history`` extended, so the
    copy resumes from the series' training state (:func:`original_trial_number`).
    """
    system_attrs = {key: value for key, value in trial.system_attrs.items()
                    if key not in _ATTEMPT_ATTRS}
    system_attrs.setdefault(_FAILED_TRIAL_ATTR, trial.number)
    system_attrs[_RETRY_HISTORY_ATTR] = [*trial.system_attrs.get(_RETRY_HISTORY_ATTR, []),
                                         trial.number]
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
        user_attrs=trial.user_attrs, system_attrs=system_attrs))


def requeue_crashed(study: optuna.Study, sweep_dir: Path,
                    retry: RetryPolicy | None = None) -> int:
    """Queue again the trials abandoned after crashes whose series has a checkpoint.

    A relaunch is a person (or a scheduler) asking for the sweep to finish: a cell whose
    process died too often in a row (:class:`RetryCrashedTrial` gave up on it), or that an
    older sweepmaster abandoned after ``max_retry`` crashes however far it got, is retried
    once more when its training state holds a checkpoint, from there. Cells that never
    checkpointed stay abandoned (nothing was gained by their attempts). Call it under the
    study's ask lock (:func:`~sweepmaster.store.locks.study_lock`).

    Args:
        study: The sweep's study.
        sweep_dir: The sweep's :func:`sweep_output_dir`.
        retry: How long to retry through a database outage.

    Returns:
        How many trials were queued.

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    from sweepmaster.runtime.training.training_state import checkpoint_files

    def requeue() -> int:
        trials = study.get_trials(deepcopy=False)
        live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
        taken = [t.params for t in trials if t.state in live]
        num_queued = 0
        for trial in reversed(trials):  # the latest attempt of a cell continues its series
            if trial.state != TrialState.FAIL or trial.params in taken or not _crashed(trial):
                continue
            taken.append(trial.params)
            state_dir = resume_state_dir(sweep_dir, original_trial_number(trial, study))
            if checkpoint_files(state_dir):
                enqueue_retry(study, trial)
                num_queued += 1
        return num_queued

    return run_with_retry(requeue, "queue crashed trials again", retry)


def _crashed(trial: FrozenTrial) -> bool:
    """Whether a FAIL trial was failed because its process died (not by its own error)."""
    if trial.system_attrs.get(CRASHED_ATTR):
        return True
    # an older sweepmaster recorded no mark: a trial failed by its own error or interrupted
    # has a reason, one failed as stale has none
    return "fail_reason" not in trial.system_attrs and \
        "sweepmaster:interrupted" not in trial.system_attrs


def continue_series(trial: Trial, resumed_from_step: int,
                    retry: RetryPolicy | None = None) -> None:
    """Record where ``trial`` starts, and give it its series' history up to there.

    A retry that resumes from its series' checkpoint of step ``resumed_from_step`` reports
    only the evaluations after it; the evaluations before it were reported to Optuna by the
    attempts that reached them. Those intermediate values (steps ``<= resumed_from_step``,
    of the latest attempt that reported each) are copied into the retry, so its learning
    curve and the pruner's view of it are those of an uninterrupted trial. The start step is
    recorded as :data:`RESUMED_FROM_ATTR` (:class:`RetryCrashedTrial` counts progress by it).

    Args:
        trial: The trial starting to train (a retry or not).
        resumed_from_step: The step of the checkpoint it resumed from (0: none).
        retry: How long to retry through a database outage.

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    storage, trial_id = trial.storage, trial._trial_id

    def record() -> None:
        storage.set_trial_system_attr(trial_id, RESUMED_FROM_ATTR, resumed_from_step)
        if not resumed_from_step:
            return
        values = _series_values(trial, resumed_from_step)
        have = storage.get_trial(trial_id).intermediate_values
        for step, value in sorted(values.items()):
            if step not in have:
                storage.set_trial_intermediate_value(trial_id, step, value)

    run_with_retry(record, f"record where trial {trial.number} starts", retry)


def _series_values(trial: Trial, up_to_step: int) -> dict[int, float]:
    """Intermediate values of the attempts before ``trial`` in its series, steps <= ``up_to_step``.

    The series is every trial of the same :func:`original_trial_number`; a later attempt's
    value of a step wins over an earlier one's.
    """
    trials = sorted(trial.study.get_trials(deepcopy=False), key=lambda t: t.number)
    by_number = {t.number: t for t in trials}
    system_attrs, user_attrs = _attrs(trial, trial.study)
    origin = _origin(trial.number, system_attrs, user_attrs, by_number.get)
    values: dict[int, float] = {}
    for attempt in trials:
        if attempt.number >= trial.number or \
                _origin(attempt.number, attempt.system_attrs, attempt.user_attrs,
                        by_number.get) != origin:
            continue
        values.update({step: value for step, value in attempt.intermediate_values.items()
                       if step <= up_to_step and math.isfinite(value)})
    return values


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

    reason = ("its process stopped (killed, crashed or its machine lost): no heartbeat "
              f"for {_grace_s(storage):g} s; a retry resumes from its checkpoint")

    def fail() -> int:
        stale = [trial_id
                 for trial_id in storage._get_stale_trial_ids(study._study_id)  # type: ignore[attr-defined]
                 if trial_id not in keep]
        for trial_id in stale:
            try:
                storage.set_trial_system_attr(trial_id, CRASHED_ATTR, True)
                storage.set_trial_system_attr(trial_id, "fail_reason", reason)
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


def _grace_s(storage: BaseStorage) -> float:
    """The grace period of a storage with a heartbeat, in seconds (Optuna's default: 2 beats)."""
    backend = getattr(storage, "_backend", storage)  # Optuna caches an RDB storage's reads
    grace_s = getattr(backend, "grace_period", None)
    if grace_s is None:
        grace_s = 2 * storage.get_heartbeat_interval()  # type: ignore[attr-defined]
    return float(grace_s)


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

    def lookup(number: int) -> FrozenTrial | None:
        nonlocal by_number
        if by_number is None:
            by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
        return by_number.get(number)

    system_attrs, user_attrs = _attrs(trial, study)
    return _origin(trial.number, system_attrs, user_attrs, lookup)


def _origin(number: int, system_attrs: dict[str, Any], user_attrs: dict[str, Any],
            lookup: Callable[[int], FrozenTrial | None]) -> int:
    """:func:`original_trial_number` of trial ``number`` with these attributes."""
    seen = {number}
    while True:
        earlier = system_attrs.get(_FAILED_TRIAL_ATTR, user_attrs.get(RETRY_OF_ATTR))
        if not isinstance(earlier, int) or earlier in seen:
            return number
        found = lookup(earlier)
        if found is None:
            return earlier
        seen.add(earlier)
        number = earlier
        system_attrs, user_attrs = found.system_attrs, found.user_attrs


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
