"""The workers of a sweep in ``sm_workers``: registration, heartbeats, stop, lost detection.

A worker is one process training a sweep's trials (``sweepmaster launch`` or
``sweepmaster worker``), on any host that reaches the sweep's database. It registers a row
(host, pid, device spec, state ``running``), refreshes ``heartbeat_at`` every few seconds
(:class:`sweepmaster.sweep.workers.WorkerSession`), and marks itself ``stopped`` when it exits
cleanly. A worker that stops beating (its host died, it was killed, its network is cut) is
marked ``lost`` by any other worker of the sweep once its heartbeat is older than a grace period,
and at once when it ran on the same host and its pid is gone (:func:`mark_lost_workers`).
Readers that must not write (the dashboard) see the same states through :func:`list_workers`,
which reports a ``running`` row with a stale heartbeat as ``lost``.

Every write is one short transaction retried through database outages
(:func:`~sweepmaster.store.retry.run_with_retry`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, exists, func, insert, select, update
from sqlalchemy.engine import Engine

from sweepmaster.store.models import TrialProgress, Worker, utcnow
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_LOST_AFTER_S",
    "WorkerInfo",
    "heartbeat",
    "list_workers",
    "mark_lost_workers",
    "pid_alive",
    "register_worker",
    "stop_worker",
    "this_host",
]

#: Seconds between two heartbeats of a running worker.
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
#: Seconds without a heartbeat after which a running worker counts as lost (6 missed beats).
DEFAULT_LOST_AFTER_S = 30.0


@dataclass(frozen=True)
class WorkerInfo:
    """One worker of a sweep, as read from ``sm_workers``.

    Attributes:
        id: Primary key in ``sm_workers`` (``sm_trial_progress.worker_id`` points here).
        sweep_id: The sweep it works on.
        host: Host name of the machine it runs on.
        pid: Its process id on that host.
        devices: The device spec it trains on, e.g. ``"cpu"`` or ``"cuda:0,cuda:1"``.
        status: ``running``, ``stopped`` or ``lost`` (a stale ``running`` row reads ``lost``).
        started_at: When it registered (timezone-aware UTC).
        heartbeat_at: Its last heartbeat (timezone-aware UTC).
        heartbeat_age_s: Seconds from its last heartbeat to the time of the read.
        num_running: Trials it is training now (``RUNNING`` progress rows it wrote).
        num_finished: Trials it ended ``COMPLETE`` or ``PRUNED``.
    """

    id: int
    sweep_id: int
    host: str
    pid: int
    devices: str
    status: str
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float
    num_running: int
    num_finished: int


def this_host() -> str:
    """The name this machine's workers register under (``socket.gethostname()``)."""
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this host (signal 0 probe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def register_worker(engine: Engine, sweep_id: int, devices: str, *, host: str | None = None,
                    pid: int | None = None, retry: RetryPolicy | None = None) -> int:
    """Insert a ``running`` worker row for this process; return its id.

    Args:
        engine: An engine on a database at head.
        sweep_id: The sweep it joins (``SweepInfo.id``).
        devices: Its device spec, as given to ``--devices`` or ``resources.devices``.
        host: Host name (default :func:`this_host`).
        pid: Process id (default this process's).
        retry: How long to retry through an outage (default from the environment).

    Raises:
        StorageError: The database rejected the write or stayed unavailable too long.
    """
    now = utcnow()
    values = {"sweep_id": sweep_id, "host": host or this_host(), "pid": pid or os.getpid(),
              "devices": devices, "status": "running", "started_at": now, "heartbeat_at": now}

    def write() -> int:
        with engine.begin() as connection:
            result = connection.execute(insert(Worker).values(**values))
            (worker_id,) = result.inserted_primary_key  # type: ignore[misc]
        return int(worker_id)

    return run_with_retry(write, f"register a worker of sweep {sweep_id}", retry)


def heartbeat(engine: Engine, worker_id: int, retry: RetryPolicy | None = None) -> None:
    """Set the worker's ``heartbeat_at`` to now, and its status ``running``.

    A worker its peers marked lost during a network cut comes back when it beats again; a
    worker marked ``stopped`` stays stopped (a late beat cannot revive it).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """

    def write() -> None:
        with engine.begin() as connection:
            connection.execute(update(Worker)
                               .where(Worker.id == worker_id, Worker.status != "stopped")
                               .values(heartbeat_at=utcnow(), status="running"))

    run_with_retry(write, f"record the heartbeat of worker {worker_id}", retry)


def stop_worker(engine: Engine, worker_id: int, retry: RetryPolicy | None = None) -> None:
    """Mark the worker ``stopped`` (it exited cleanly) with a last heartbeat of now.

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """

    def write() -> None:
        with engine.begin() as connection:
            connection.execute(update(Worker).where(Worker.id == worker_id)
                               .values(heartbeat_at=utcnow(), status="stopped"))

    run_with_retry(write, f"record that worker {worker_id} stopped", retry)


def forget_idle_worker(engine: Engine, worker_id: int,
                       retry: RetryPolicy | None = None) -> bool:
    """Delete a worker's row if no trial progress names it (it trained nothing).

    A launch with nothing left to run leaves no trace in ``sm_workers``.

    Returns:
        Whether the row was deleted.

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """

    def write() -> bool:
        with engine.begin() as connection:
            result = connection.execute(
                delete(Worker).where(Worker.id == worker_id,
                                     ~exists().where(TrialProgress.worker_id == worker_id)))
            return bool(result.rowcount)

    return run_with_retry(write, f"forget idle worker {worker_id}", retry)


def mark_lost_workers(engine: Engine, sweep_id: int, *,
                      lost_after_s: float = DEFAULT_LOST_AFTER_S, host: str | None = None,
                      now: datetime | None = None, retry: RetryPolicy | None = None) -> list[int]:
    """Mark the sweep's running workers that stopped beating as ``lost``; return their ids.

    A worker is lost when its heartbeat is older than ``lost_after_s``, or at once when it ran
    on ``host`` (default this host) and its pid no longer exists there.

    Args:
        engine: An engine on a database at head.
        sweep_id: The sweep whose workers are checked.
        lost_after_s: Grace period in seconds (several heartbeat intervals).
        host: The host whose pids may be probed (default :func:`this_host`).
        now: The current time (default :func:`~sweepmaster.store.models.utcnow`).
        retry: How long to retry through an outage (default from the environment).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    host = host or this_host()

    def write() -> list[int]:
        current = now or utcnow()
        with engine.begin() as connection:
            rows = connection.execute(
                select(Worker.id, Worker.host, Worker.pid, Worker.heartbeat_at)
                .where(Worker.sweep_id == sweep_id, Worker.status == "running")
            ).all()
            lost = [
                row.id for row in rows
                if (current - row.heartbeat_at).total_seconds() > lost_after_s
                or (row.host == host and row.pid != os.getpid() and not pid_alive(row.pid))
            ]
            if lost:
                connection.execute(update(Worker)
                                   .where(Worker.id.in_(lost), Worker.status == "running")
                                   .values(status="lost"))
        return lost

    return run_with_retry(write, f"check the workers of sweep {sweep_id}", retry)


def list_workers(engine: Engine, sweep_id: int, *, lost_after_s: float = DEFAULT_LOST_AFTER_S,
                 now: datetime | None = None) -> list[WorkerInfo]:
    """Return the sweep's workers, oldest first, with the trials each runs and finished.

    Reads only: a ``running`` row whose heartbeat is older than ``lost_after_s`` is reported
    ``lost`` without being written. Only a ``running`` worker runs trials: one that stopped or
    was lost (killed with ``kill -9``, its trials' progress rows left RUNNING) runs none.

    Args:
        engine: An engine on the sweep's database (read-only is enough).
        sweep_id: The sweep.
        lost_after_s: Grace period in seconds.
        now: The current time (default :func:`~sweepmaster.store.models.utcnow`).
    """
    current = now or utcnow()
    running = func.count(TrialProgress.id).filter(TrialProgress.state == "RUNNING")
    finished = func.count(TrialProgress.id).filter(TrialProgress.state.in_(("COMPLETE",
                                                                             "PRUNED")))
    query = (
        select(Worker.id, Worker.sweep_id, Worker.host, Worker.pid, Worker.devices,
               Worker.status, Worker.started_at, Worker.heartbeat_at, running, finished)
        .outerjoin(TrialProgress, and_(TrialProgress.worker_id == Worker.id,
                                       TrialProgress.sweep_id == Worker.sweep_id))
        .where(Worker.sweep_id == sweep_id)
        .group_by(Worker.id)
        .order_by(Worker.started_at, Worker.id)
    )
    with engine.connect() as connection:
        rows = connection.execute(query).all()
    workers = []
    for row in rows:
        age_s = max((current - row.heartbeat_at).total_seconds(), 0.0)
        status = row.status
        if status == "running" and age_s > lost_after_s:
            status = "lost"
        workers.append(WorkerInfo(
            id=row.id, sweep_id=row.sweep_id, host=row.host, pid=row.pid, devices=row.devices,
            status=status, started_at=row.started_at, heartbeat_at=row.heartbeat_at,
            # a stopped or lost worker trains nothing, whatever rows it left RUNNING (killed)
            heartbeat_age_s=age_s, num_running=int(row[8] or 0) if status == "running" else 0,
            num_finished=int(row[9] or 0),
        ))
    return workers

