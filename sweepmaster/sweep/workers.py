"""Several workers on one sweep: a worker's heartbeat, and joining a sweep by its name.

Every process that trains a sweep's trials (``sweepmaster launch`` or ``sweepmaster worker``,
on any host reaching the sweep's database) is a worker. Optuna hands out the trials (the ask
step is serialized per study by :func:`~sweepmaster.store.locks.study_lock`, so no grid cell
runs twice); sweepmaster records each worker in ``sm_workers``
(:mod:`sweepmaster.store.workers`) and each trial's progress row carries the worker that trains
it.

:class:`WorkerSession` registers the worker, refreshes its heartbeat from a daemon thread every
``interval_s`` seconds, marks peers whose heartbeat went stale (or, on the same host, whose pid
died) ``lost``, and marks the worker ``stopped`` when the ``with`` block ends. Database outages
are ridden out with backoff (:mod:`sweepmaster.store.retry`); a beat that still fails is logged
and the thread goes on beating, so a worker never dies of its heartbeat.

:func:`load_joined_config` rebuilds a sweep's configuration from the text stored in
``sm_sweeps`` when the sweep was created, so ``sweepmaster worker --sweep NAME`` needs no
``sweep.yaml``.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from types import TracebackType

from sqlalchemy import inspect
from sqlalchemy.engine import Engine, make_url

from sweepmaster.config.schema import SweepConfig, parse_sweep_config
from sweepmaster.errors import ConfigError, StorageError
from sweepmaster.store import (
    create_store_engine,
    current_revision,
    get_sweep,
    list_sweeps,
    upgrade_to_head,
)
from sweepmaster.store.engine import create_read_only_engine, masked_url
from sweepmaster.store.locks import schema_lock
from sweepmaster.store.models import Worker
from sweepmaster.store.retry import RetryPolicy
from sweepmaster.store.workers import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_LOST_AFTER_S,
    WorkerInfo,
    heartbeat,
    list_workers,
    mark_lost_workers,
    register_worker,
    stop_worker,
)

__all__ = ["WorkerSession", "load_joined_config", "sweep_workers"]

_log = logging.getLogger(__name__)


class WorkerSession:
    """This process as a worker of one sweep, for the duration of a ``with`` block.

    Example:
        >>> with WorkerSession(engine, sweep.id, "cpu") as session:  # doctest: +SKIP
        ...     recorder = ProgressRecorder(engine, sweep.id, worker_id=session.worker_id)

    Args:
        engine: An engine on the sweep's database, at head.
        sweep_id: The sweep (``SweepInfo.id``).
        devices: The device spec this worker trains on (shown by ``status``).
        interval_s: Seconds between heartbeats.
        lost_after_s: Seconds without a heartbeat after which a peer counts as lost.
        retry: How long each beat is retried through an outage (default: from the
            environment); a beat that gives up is logged and the next one tries again.

    Attributes:
        worker_id: The worker's row in ``sm_workers`` (set on entering the block).
        num_beats: Heartbeats written so far.
    """

    def __init__(self, engine: Engine, sweep_id: int, devices: str, *,
                 interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 lost_after_s: float = DEFAULT_LOST_AFTER_S,
                 retry: RetryPolicy | None = None) -> None:
        if not 0 < interval_s < lost_after_s:
            raise ValueError(f"need 0 < interval_s < lost_after_s, got {interval_s} and "
                             f"{lost_after_s}")
        self.engine = engine
        self.sweep_id = sweep_id
        self.devices = devices
        self.interval_s = interval_s
        self.lost_after_s = lost_after_s
        self.retry = retry
        self.worker_id: int | None = None
        self.num_beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WorkerSession:
        """Register the worker, mark dead peers lost, and start beating.

        Raises:
            StorageError: The database stayed unavailable longer than ``retry`` allows.
        """
        self.worker_id = register_worker(self.engine, self.sweep_id, self.devices,
                                         retry=self.retry)
        mark_lost_workers(self.engine, self.sweep_id, lost_after_s=self.lost_after_s,
                          retry=self.retry)
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.worker_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Stop beating, mark the worker ``stopped`` and dead peers ``lost`` (errors logged)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if self.worker_id is not None:
            try:
                stop_worker(self.engine, self.worker_id, retry=self.retry)
                mark_lost_workers(self.engine, self.sweep_id, lost_after_s=self.lost_after_s,
                                  retry=self.retry)
            except StorageError as err:  # peers will mark it lost
                _log.warning("worker %d not marked stopped: %s", self.worker_id, err)

    def _beat(self) -> None:
        assert self.worker_id is not None
        while not self._stop.wait(self.interval_s):
            try:
                heartbeat(self.engine, self.worker_id, retry=self.retry)
                self.num_beats += 1
                mark_lost_workers(self.engine, self.sweep_id, lost_after_s=self.lost_after_s,
                                  retry=self.retry)
            except StorageError as err:
                _log.warning("worker %d: heartbeat not recorded, trying again in %.0f s: %s",
                             self.worker_id, self.interval_s, err)
            except Exception:  # never let the heartbeat thread die
                _log.exception("worker %d: heartbeat failed", self.worker_id)


def load_joined_config(storage: str, name: str) -> SweepConfig:
    """Rebuild the configuration of the sweep ``name`` stored in ``storage``, to join it.

    The text is the one the sweep was created with (``SweepConfig.canonical_text``: resolved,
    absolute data and tokenizer paths, no ``resources``); those paths must exist on this host.

    Args:
        storage: SQLAlchemy URL of the sweep's database.
        name: The sweep's name.

    Returns:
        The validated configuration (``resources`` at their defaults).

    Raises:
        StorageError: The database is unreachable, or has no sweep ``name`` (the message lists
            the sweeps it has).
        ConfigError: The stored configuration is invalid here, e.g. names data files that this
            host does not have.
    """
    url = make_url(storage)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        raise StorageError(f"no database {masked_url(storage)} to join: launch the sweep there "
                           "first")
    engine = create_store_engine(storage)
    try:
        info = None
        with schema_lock(engine):  # a launch creating the sweep now finishes first
            revision = current_revision(engine)
            if revision is not None:  # an empty database has no sweeps
                upgrade_to_head(engine)
                info = get_sweep(engine, name)
        if info is None:
            names = [s.name for s in list_sweeps(engine)] if revision else []
            known = ", ".join(repr(n) for n in names) if names else "none"
            raise StorageError(f"no sweep {name!r} in {masked_url(storage)} (sweeps there: "
                               f"{known}); start it with `sweepmaster launch sweep.yaml "
                               "--storage URL` first")
    finally:
        engine.dispose()
    source = f"sweep {name} in {masked_url(storage)}"
    try:
        raw = json.loads(info.config_text)
    except json.JSONDecodeError as err:
        raise ConfigError(source, "", f"stored configuration is not JSON: {err}") from None
    return parse_sweep_config(raw, source=source)


def sweep_workers(storage: str, name: str) -> list[WorkerInfo]:
    """Return the workers of the sweep ``name`` in ``storage``, oldest first (read only).

    Raises:
        StorageError: The database is unreachable or has no sweep ``name``.
    """
    engine = create_read_only_engine(storage)
    try:
        info = get_sweep(engine, name)
        if info is None:
            raise StorageError(f"no sweep {name!r} in {masked_url(storage)}")
        if not inspect(engine).has_table(Worker.__tablename__):  # tables older than workers
            return []
        return list_workers(engine, info.id)
    finally:
        engine.dispose()
