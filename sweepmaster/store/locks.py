"""A lock per study across processes and hosts, so workers never ask for the same grid cell.

Optuna's ``GridSampler`` picks a cell that no finished or running trial has; two workers asking
at the same moment can both see a cell free and both train it (Optuna documents this for
distributed grids). :func:`study_lock` serializes the ask step of every worker of a study: it is
held from before a trial is created until its cell (its ``grid_id`` and parameters) is stored,
a few short transactions, never while a trial trains.

- PostgreSQL: a transaction-level advisory lock (``pg_advisory_xact_lock``) on a connection of
  its own, keyed by the study name. A worker that dies or loses its connection releases it
  with its session.
- SQLite (workers on one host): an exclusive ``flock`` on ``<database>.ask-lock`` beside the
  database file, released by the kernel when the process dies. An in-memory database is
  private to one process and needs none.
- Other backends: no lock (a grid may then run a cell twice under a race, as with Optuna).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = ["advisory_key", "study_lock"]


def advisory_key(study_name: str) -> int:
    """The signed 64-bit PostgreSQL advisory lock key of a study's ask step."""
    digest = hashlib.sha256(f"sweepmaster:ask:{study_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextlib.contextmanager
def study_lock(engine: Engine, study_name: str,
               retry: RetryPolicy | None = None) -> Iterator[None]:
    """Hold the study's ask lock for the ``with`` block (blocks while another worker holds it).

    Args:
        engine: An engine on the sweep's database.
        study_name: The Optuna study (one lock per study).
        retry: How long to retry taking the lock through a database outage.

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    url = engine.url
    if url.get_backend_name() == "postgresql":
        with _advisory_lock(engine, advisory_key(study_name), retry):
            yield
    elif url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        path = Path(str(url.database)).with_name(Path(str(url.database)).name + ".ask-lock")
        with path.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    else:
        yield


@contextlib.contextmanager
def _advisory_lock(engine: Engine, key: int, retry: RetryPolicy | None) -> Iterator[None]:
    def acquire() -> Connection:
        connection = engine.connect()
        try:
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
        except BaseException:
            connection.close()
            raise
        return connection

    connection = run_with_retry(acquire, "lock the study to ask for a trial", retry)
    try:
        yield
    finally:
        try:
            connection.rollback()  # ends the transaction: the lock is released
        except sa.exc.SQLAlchemyError:
            connection.invalidate()  # the session is gone, and its lock with it
        finally:
            connection.close()
