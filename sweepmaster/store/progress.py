"""Batched recording of trial progress into ``sm_trial_progress`` and ``sm_metrics``.

Training threads call :class:`ProgressRecorder` once per optimizer step; writing a row per step
would make the database the bottleneck (and, on SQLite, contend with Optuna's own writes). The
recorder keeps the latest values in memory and writes them at most every ``min_interval_s``
seconds, each time in one transaction.

The database may be unavailable for a while (a locked SQLite file, a restarting server, killed
connections): writes that must happen now (:meth:`~ProgressRecorder.trial_started`,
:meth:`~ProgressRecorder.finished`, :meth:`~ProgressRecorder.flush`) are retried with backoff
(:mod:`sweepmaster.store.retry`); the periodic flushes of a training thread are tried once and
keep their values buffered for the next one. Only an outage longer than the retry policy's
``timeout_s`` raises :class:`~sweepmaster.errors.StorageError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection, Engine

from sweepmaster.errors import StorageError
from sweepmaster.runtime.events import TRIAL_STATISTICS
from sweepmaster.store.models import FINAL_TRIAL_STATES, Metric, TrialProgress, utcnow
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = ["ProgressRecorder"]

_log = logging.getLogger(__name__)

#: Per-trial device usage columns :meth:`ProgressRecorder.finished` may set.
DEVICE_STATS = tuple(stat.name for stat in TRIAL_STATISTICS)


@dataclass
class _LiveTrial:
    """In-memory latest values of one running trial; ``dirty`` until they are written."""

    progress_id: int
    step: int
    total_steps: int
    train_loss: float | None = None
    tokens_per_s: float | None = None
    eval_loss: float | None = None
    dirty: bool = False


@dataclass(frozen=True)
class _Pending:
    """What one flush writes: progress row updates and metric rows."""

    rows: list[dict[str, object]]
    metrics: list[dict[str, object]]


class ProgressRecorder:
    """Records the progress of one sweep's trials, batching writes.

    :meth:`trial_started` writes at once; :meth:`step` and :meth:`evaluated` only update memory
    and write (flush) when at least ``min_interval_s`` seconds passed since the last flush;
    :meth:`finished` writes everything still buffered together with the trial's final state.
    Every write is one transaction: progress rows and their metric rows appear together or not
    at all.

    Thread safety: all methods may be called from any thread. Buffering takes a short lock; one
    thread writes at a time. A flush triggered by :meth:`step` or :meth:`evaluated` is skipped
    while another thread is writing, and a failed one is logged and retried at the next flush,
    so a training thread does not wait out a database outage mid-trial; it fails (with
    ``StorageError``) only once the outage has lasted longer than ``retry.timeout_s``.

    Example:
        >>> recorder = ProgressRecorder(engine, sweep.id)  # doctest: +SKIP
        >>> recorder.trial_started(0, optuna_trial_id=1, total_steps=100, device="cpu")
        >>> recorder.step(0, step=1, total_steps=100, train_loss=4.2, tokens_per_s=9e3, lr=1e-3)
        >>> recorder.finished(0, "COMPLETE", objective=3.9)

    Args:
        engine: An engine on a database at head (:func:`~sweepmaster.store.upgrade_to_head`).
        sweep_id: The sweep whose trials this recorder writes (``SweepInfo.id``).
        min_interval_s: Least time in seconds between two flushes triggered by :meth:`step`
            or :meth:`evaluated`; ``0`` flushes on every call.
        retry: How long writes are retried through a database outage; default
            :meth:`~sweepmaster.store.retry.RetryPolicy.from_env` (60 s).
        worker_id: The worker (``sm_workers.id``) whose trials this recorder writes; stored in
            each row it starts or ends, ``None`` for none.

    Attributes:
        flush_count: Number of transactions that wrote buffered progress (flushes and
            :meth:`finished` calls); :meth:`trial_started` is not counted.
    """

    def __init__(self, engine: Engine, sweep_id: int, min_interval_s: float = 0.5,
                 retry: RetryPolicy | None = None, worker_id: int | None = None) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, not {min_interval_s}")
        self._engine = engine
        self._sweep_id = sweep_id
        self._worker_id = worker_id
        self._min_interval_s = min_interval_s
        self._retry = retry if retry is not None else RetryPolicy.from_env()
        self._no_retry = RetryPolicy(timeout_s=0.0)
        self._ended: set[int] = set()  # trial numbers finished through this recorder
        self._outage_since_s: float | None = None  # first failed periodic flush of an outage
        self._lock = threading.Lock()  # guards the buffers below; never held during I/O
        self._write_lock = threading.Lock()  # one database write at a time
        self._trials: dict[int, _LiveTrial] = {}
        self._metrics: list[dict[str, object]] = []
        self._last_flush_s = time.monotonic()
        self.flush_count = 0

    def trial_started(
        self, trial_number: int, optuna_trial_id: int | None, total_steps: int, device: str,
        step: int = 0,
    ) -> None:
        """Write a trial's progress row now, in state ``RUNNING`` at ``step`` (0 unless resumed).

        A relaunch of a trial number already recorded resets its row (losses, objective,
        failure reason, checkpoint path, start time) and deletes its metrics.

        Args:
            trial_number: Optuna's trial number.
            optuna_trial_id: Optuna's ``trial_id``, if known.
            total_steps: Optimizer steps the trial will run if not stopped early.
            device: The device it trains on, e.g. ``"cpu"`` or ``"cuda:0"``.
            step: Optimizer steps already done: a trial resumed from a training-state
                checkpoint continues from there.

        Raises:
            StorageError: The database rejected the write, or stayed unavailable longer than
                the retry policy allows.
        """
        now = utcnow()
        values = {
            "optuna_trial_id": optuna_trial_id,
            "state": "RUNNING",
            "step": step,
            "total_steps": total_steps,
            "tokens_per_s": None,
            "train_loss": None,
            "eval_loss": None,
            "objective": None,
            "device": device,
            "failure_reason": None,
            "checkpoint_path": None,
            "started_at": now,
            "updated_at": now,
            "worker_id": self._worker_id,
        }
        with self._write_lock:
            with self._lock:  # an earlier launch's buffered values must not outlive it
                old = self._trials.pop(trial_number, None)
                if old is not None:
                    self._metrics = [
                        m for m in self._metrics if m["trial_progress_id"] != old.progress_id
                    ]

            def write() -> int:
                with self._engine.begin() as connection:
                    return self._reset_row(connection, trial_number, values)

            progress_id = run_with_retry(write, f"record the start of trial {trial_number}",
                                         self._retry)
            with self._lock:
                self._trials[trial_number] = _LiveTrial(progress_id, step, total_steps)
                self._ended.discard(trial_number)

    def step(
        self,
        trial_number: int,
        step: int,
        total_steps: int,
        train_loss: float,
        tokens_per_s: float,
        lr: float,
    ) -> None:
        """Buffer one optimizer step; flush if ``min_interval_s`` passed since the last flush.

        Args:
            trial_number: A trial started with :meth:`trial_started`.
            step: Optimizer steps done so far (1 after the first step).
            total_steps: Optimizer steps planned.
            train_loss: The step's training loss (nats/token); recorded as metric
                ``train_loss``.
            tokens_per_s: Recent training throughput in tokens/s; metric ``tokens_per_s``.
            lr: Learning rate used for the step; metric ``lr``.

        Raises:
            ValueError: The trial was not started, or already finished.
        """
        with self._buffer(trial_number) as live:
            live.step = step
            live.total_steps = total_steps
            live.train_loss = train_loss
            live.tokens_per_s = tokens_per_s
            self._add_metrics(live, step, train_loss=train_loss, lr=lr, tokens_per_s=tokens_per_s)

    def evaluated(
        self, trial_number: int, step: int, eval_loss: float, eval_perplexity: float
    ) -> None:
        """Buffer one evaluation; flush if ``min_interval_s`` passed since the last flush.

        Args:
            trial_number: A trial started with :meth:`trial_started`.
            step: Optimizer steps done when it was evaluated.
            eval_loss: Mean evaluation loss (nats/token); metric ``eval_loss``.
            eval_perplexity: ``exp(eval_loss)``; metric ``eval_perplexity``.

        Raises:
            ValueError: The trial was not started, or already finished.
        """
        with self._buffer(trial_number) as live:
            live.eval_loss = eval_loss
            self._add_metrics(live, step, eval_loss=eval_loss, eval_perplexity=eval_perplexity)

    def finished(
        self,
        trial_number: int,
        state: str,
        objective: float | None = None,
        failure_reason: str | None = None,
        checkpoint_path: str | None = None,
        device_stats: Mapping[str, int | None] | None = None,
    ) -> None:
        """Write everything buffered and the trial's final state, in one transaction.

        A trial that never started here (it failed while being prepared, before
        :meth:`trial_started`) gets its row written (or reset) in its final state at step 0.

        Args:
            trial_number: A trial started with :meth:`trial_started`.
            state: ``COMPLETE``, ``PRUNED`` or ``FAIL``.
            objective: The value told to Optuna, if any.
            failure_reason: Why the trial failed, for ``FAIL``.
            checkpoint_path: Where the trial's final checkpoint was saved, if it was.
            device_stats: How it used its device: any statistic of
                :data:`~sweepmaster.runtime.events.TRIAL_STATISTICS` by name
                (``swap_bytes``, ``num_shards``, ...).

        Raises:
            ValueError: ``state`` is not a final state, a ``device_stats`` key is unknown, or
                the trial already finished.
            StorageError: The database rejected the write, or stayed unavailable longer than
                the retry policy allows; the buffered values stay buffered.
        """
        if state not in FINAL_TRIAL_STATES:
            allowed = ", ".join(FINAL_TRIAL_STATES)
            raise ValueError(f"a finished trial's state must be one of {allowed}, not {state!r}")
        stats = dict(device_stats or {})
        unknown = set(stats) - set(DEVICE_STATS)
        if unknown:
            raise ValueError(f"unknown device_stats {sorted(unknown)}; known: {DEVICE_STATS}")
        with self._write_lock:
            with self._lock:
                live = self._trials.get(trial_number)
                if live is None and trial_number in self._ended:
                    self._live(trial_number)  # raises: already finished
                pending = self._take_pending()
            now = utcnow()
            final = {"state": state, "objective": objective, "failure_reason": failure_reason,
                     "checkpoint_path": checkpoint_path, "updated_at": now, **stats}
            unstarted = {"optuna_trial_id": None, "step": 0, "total_steps": 0,
                         "tokens_per_s": None, "train_loss": None, "eval_loss": None,
                         "device": "", "started_at": now, "worker_id": self._worker_id}

            def write() -> None:
                with self._engine.begin() as connection:
                    self._write(connection, pending)
                    if live is None:
                        self._reset_row(connection, trial_number, {**unstarted, **final})
                    else:
                        connection.execute(update(TrialProgress)
                                           .where(TrialProgress.id == live.progress_id)
                                           .values(**final))

            try:
                run_with_retry(write, f"record the end of trial {trial_number}", self._retry)
            except StorageError:
                self._restore(pending)
                raise
            self._flushed()
            with self._lock:
                if live is not None and self._trials.get(trial_number) is live:
                    del self._trials[trial_number]
                self._ended.add(trial_number)

    def flush(self) -> None:
        """Write everything buffered now, in one transaction (nothing if nothing is buffered).

        Raises:
            StorageError: The database rejected the write, or stayed unavailable longer than
                the retry policy allows; the buffered values stay buffered.
        """
        with self._write_lock:
            self._flush_locked(self._retry)

    def _live(self, trial_number: int) -> _LiveTrial:
        live = self._trials.get(trial_number)
        if live is None:
            raise ValueError(
                f"trial {trial_number} of sweep {self._sweep_id} is not running: "
                "call trial_started() first"
            )
        return live

    @contextlib.contextmanager
    def _buffer(self, trial_number: int) -> Iterator[_LiveTrial]:
        """A running trial's latest values to update under the lock (``step``, ``evaluated``).

        They are marked dirty, then written if ``min_interval_s`` passed since the last flush.

        Raises:
            ValueError: The trial was not started, or already finished.
        """
        with self._lock:
            live = self._live(trial_number)
            yield live
            live.dirty = True
        self._maybe_flush()

    def _add_metrics(self, live: _LiveTrial, step: int, **values: float) -> None:
        self._metrics.extend(
            {"trial_progress_id": live.progress_id, "step": step, "name": name, "value": value}
            for name, value in values.items()
        )

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush_s < self._min_interval_s:
            return
        if not self._write_lock.acquire(blocking=False):
            return  # another thread is writing; this data goes with the next flush
        try:
            self._flush_locked(self._no_retry)  # the next periodic flush is the retry
        except StorageError as err:
            now = time.monotonic()
            if self._outage_since_s is None:
                self._outage_since_s = now
                _log.warning("progress of sweep %d not saved yet, will retry: %s",
                             self._sweep_id, err)
            elif now - self._outage_since_s > self._retry.timeout_s:
                raise StorageError(
                    f"cannot record progress of sweep {self._sweep_id}: database unavailable "
                    f"for {now - self._outage_since_s:.0f} s ({err})"
                ) from err
        finally:
            self._write_lock.release()

    def _flush_locked(self, retry: RetryPolicy) -> None:
        with self._lock:
            pending = self._take_pending()
        if not pending.rows and not pending.metrics:
            return

        def write() -> None:
            with self._engine.begin() as connection:
                self._write(connection, pending)

        try:
            run_with_retry(write, "record progress", retry)
        except StorageError:
            self._restore(pending)
            raise
        self._flushed()

    def _reset_row(self, connection: Connection, trial_number: int,
                   values: Mapping[str, object]) -> int:
        """Insert the trial's progress row, or reset it and drop its metrics; return its id."""
        progress_id = connection.execute(
            select(TrialProgress.id).where(
                TrialProgress.sweep_id == self._sweep_id,
                TrialProgress.trial_number == trial_number,
            )
        ).scalar_one_or_none()
        if progress_id is None:
            result = connection.execute(
                insert(TrialProgress).values(
                    sweep_id=self._sweep_id, trial_number=trial_number, **values
                )
            )
            (progress_id,) = result.inserted_primary_key  # type: ignore[misc]
        else:
            connection.execute(
                update(TrialProgress).where(TrialProgress.id == progress_id).values(**values)
            )
            connection.execute(delete(Metric).where(Metric.trial_progress_id == progress_id))
        return int(progress_id)

    def _take_pending(self) -> _Pending:
        """Move the buffered values out of the buffers (``_lock`` held)."""
        now = utcnow()
        rows: list[dict[str, object]] = []
        for live in self._trials.values():
            if live.dirty:
                live.dirty = False
                rows.append(
                    {
                        "b_id": live.progress_id,
                        "step": live.step,
                        "total_steps": live.total_steps,
                        "train_loss": live.train_loss,
                        "tokens_per_s": live.tokens_per_s,
                        "eval_loss": live.eval_loss,
                        "updated_at": now,
                    }
                )
        metrics, self._metrics = self._metrics, []
        return _Pending(rows, metrics)

    def _restore(self, pending: _Pending) -> None:
        """Put back what a failed write took, so the next flush retries it."""
        written = {row["b_id"] for row in pending.rows}
        with self._lock:
            for live in self._trials.values():
                if live.progress_id in written:
                    live.dirty = True
            self._metrics[:0] = pending.metrics

    def _write(self, connection: Connection, pending: _Pending) -> None:
        if pending.rows:
            # One executemany; the bind name of the key must differ from the column names.
            statement = update(TrialProgress).where(TrialProgress.id == bindparam("b_id"))
            connection.execute(statement, pending.rows)
        if pending.metrics:
            connection.execute(insert(Metric), pending.metrics)

    def _flushed(self) -> None:
        """Count a committed flush (``_write_lock`` held)."""
        self._last_flush_s = time.monotonic()
        self._outage_since_s = None
        self.flush_count += 1
