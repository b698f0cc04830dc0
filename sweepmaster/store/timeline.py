"""Batched recording of the executor's shard tasks into ``sm_task_events`` (the device timeline).

Device workers report every task they run
(:class:`~sweepmaster.runtime.events.TaskRecord`); spilled jobs run several per optimizer
step, so the recorder buffers them in memory and writes at most every ``min_interval_s`` seconds,
in one transaction. The dashboard's device page draws them.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import insert
from sqlalchemy.engine import Engine

from sweepmaster.errors import StorageError
from sweepmaster.runtime.events import TASK_STATISTICS, TaskRecord
from sweepmaster.store.models import TaskEvent
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = ["TaskEventRecorder"]

_log = logging.getLogger(__name__)


class TaskEventRecorder:
    """Records one sweep's task events, batching writes; thread-safe.

    Args:
        engine: The store's engine.
        sweep_id: The sweep the tasks belong to.
        min_interval_s: Least seconds between two writes made by :meth:`record`.
        retry: How long :meth:`flush` retries through a database outage; default
            :meth:`~sweepmaster.store.retry.RetryPolicy.from_env` (60 s). A write made by
            :meth:`record` is tried once; its rows wait for the next one.

    Attributes:
        flush_count: Writes committed so far.
    """

    def __init__(self, engine: Engine, sweep_id: int, min_interval_s: float = 0.5,
                 retry: RetryPolicy | None = None) -> None:
        self._retry = retry if retry is not None else RetryPolicy.from_env()
        self._engine = engine
        self._sweep_id = sweep_id
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._rows: list[dict[str, object]] = []
        self._trial_numbers: dict[str, int | None] = {}
        self._last_flush_s = time.monotonic()
        self.flush_count = 0

    def name_job(self, job: str, trial_number: int | None) -> None:
        """Label the tasks of ``job`` with a trial (``None`` for a fused array of several)."""
        with self._lock:
            self._trial_numbers[job] = trial_number

    def record(self, task: TaskRecord) -> None:
        """Buffer one task; write the buffer if ``min_interval_s`` passed since the last write.

        A failed write is logged and retried with the next one (the timeline is best effort:
        it never stops a sweep).
        """
        with self._lock:
            self._rows.append({
                "sweep_id": self._sweep_id,
                "device": task.device,
                "job": task.job,
                "trial_number": self._trial_numbers.get(task.job),
                "shard": task.shard,
                "kind": task.kind,
                "start_s": task.start_s,
                "end_s": task.end_s,
                **{stat.column_name: getattr(task, stat.name) for stat in TASK_STATISTICS},
            })
        if time.monotonic() - self._last_flush_s < self._min_interval_s:
            return
        if not self._write_lock.acquire(blocking=False):
            return  # another thread writes; these rows go with the next write
        try:
            self._flush_locked(RetryPolicy(timeout_s=0.0))
        except StorageError as err:
            _log.warning("device timeline of sweep %d not saved yet: %s", self._sweep_id, err)
        finally:
            self._write_lock.release()

    def flush(self) -> None:
        """Write everything buffered now.

        Raises:
            StorageError: The database rejected the write, or stayed unavailable longer than
                the retry policy allows; the rows stay buffered.
        """
        with self._write_lock:
            self._flush_locked(self._retry)

    def _flush_locked(self, retry: RetryPolicy) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        self._last_flush_s = time.monotonic()
        if not rows:
            return

        def write() -> None:
            with self._engine.begin() as connection:
                connection.execute(insert(TaskEvent), rows)

        try:
            run_with_retry(write, "record the device timeline", retry)
        except StorageError:
            with self._lock:
                self._rows[:0] = rows
            raise
        self.flush_count += 1
