"""Locks across processes and hosts: one per study's ask step, one per database's schema.

:func:`schema_lock` serializes creating and upgrading tables (Optuna's and sweepmaster's) and
creating a sweep's records, so that any number of launches and workers may start at once on a
fresh database: the first creates everything, the others wait and then find it there. On
PostgreSQL it is an advisory lock, on a SQLite file a :mod:`filelock` on
``<database>.schema-lock`` beside it (released by the kernel when its holder dies); it is
re-entrant within a thread.

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
import threading
from collections.abc import Iterator
from pathlib import Path

import filelock
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.pool import NullPool

from sweepmaster.store.engine import guard_statements, postgres_connect_args
from sweepmaster.store.retry import RetryPolicy, run_with_retry

__all__ = ["advisory_key", "schema_lock", "study_lock"]

#: Key of the PostgreSQL advisory lock held while a process creates tables or a sweep.
SCHEMA_LOCK_KEY = int.from_bytes(hashlib.sha256(b"sweepmaster:schema").digest()[:8], "big",
                                 signed=True)
_held = threading.local()  # the schema locks this thread holds: re-entry is a no-op


@contextlib.contextmanager
def schema_lock(database: Engine | str, retry: RetryPolicy | None = None) -> Iterator[None]:
    """Hold the database's schema lock for the ``with`` block (blocks while another holds it).

    Held around everything that creates tables or records (Optuna's ``RDBStorage`` and
    ``create_study``, :func:`~sweepmaster.store.migrate.upgrade_to_head`, a sweep's first
    records), so that processes starting together on a fresh database never race to create
    the same table. Re-entrant within a thread; a process that dies releases it.

    Args:
        database: An engine on the database, or its URL.
        retry: How long to retry taking the lock through a database outage (PostgreSQL).

    Raises:
        StorageError: The database stayed unavailable longer than ``retry`` allows.
    """
    url = database.url if isinstance(database, Engine) else make_url(database)
    key = url.render_as_string(hide_password=False)
    held: set[str] = _held.__dict__.setdefault("keys", set())
    if key in held:
        yield
        return
    held.add(key)
    try:
        with _schema_lock(database, url, retry):
            yield
    finally:
        held.discard(key)


@contextlib.contextmanager
def _schema_lock(database: Engine | str, url: URL,
                 retry: RetryPolicy | None) -> Iterator[None]:
    backend = url.get_backend_name()
    if backend == "postgresql":
        engine = database if isinstance(database, Engine) else sa.create_engine(
            url, poolclass=NullPool, connect_args=postgres_connect_args(url))
        if engine is not database:
            guard_statements(engine)
        try:
            with _advisory_lock(engine, SCHEMA_LOCK_KEY, retry,
                                "lock the database to create its tables"):
                yield
        finally:
            if engine is not database:
                engine.dispose()
    elif backend == "sqlite" and url.database not in (None, "", ":memory:") \
            and not str(url.database).startswith("file:"):
        path = Path(str(url.database))
        with filelock.FileLock(path.with_name(path.name + ".schema-lock")):
            yield
    else:
        yield


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
        with _advisory_lock(engine, advisory_key(study_name), retry,
                            "lock the study to ask for a trial"):
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
def _advisory_lock(engine: Engine, key: int, retry: RetryPolicy | None,
                   what: str) -> Iterator[None]:
    def acquire() -> Connection:
        connection = engine.connect()
        try:
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
        except BaseException:
            connection.close()
            raise
        return connection

    connection = run_with_retry(acquire, what, retry)
    try:
        yield
    finally:
        try:
            connection.rollback()  # ends the transaction: the lock is released
        except sa.exc.SQLAlchemyError:
            connection.invalidate()  # the session is gone, and its lock with it
        finally:
            connection.close()
