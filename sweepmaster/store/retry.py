"""Riding out short database outages: retries with exponential backoff, bounded in time.

A sweep writes to its database for hours; a SQLite file locked by another process for longer
than its busy timeout, a PostgreSQL server restarting, or a pooled connection killed by the
server (``pg_terminate_backend``, a failover, an idle timeout) must not end it.
:func:`run_with_retry` runs one unit of database work (one transaction, or one call into Optuna's
storage) and, when it fails with a *transient* error (:func:`is_transient`), waits and runs it
again: first after :attr:`RetryPolicy.initial_delay_s`, then twice as long each time (with
jitter, so many workers do not retry in lockstep) up to :attr:`RetryPolicy.max_delay_s`. No
attempt starts later than :attr:`RetryPolicy.timeout_s` after the first failure (default 60 s,
or ``$SWEEPMASTER_STORAGE_RETRY_S``); then it raises :class:`~sweepmaster.errors.StorageError`.

Only work that is safe to repeat may be retried: a whole transaction (the failed attempt was
rolled back), or a storage call that is idempotent or whose effect the caller checks for before
repeating it. One window is unavoidable: when a connection drops while the server commits, the
client cannot tell whether the commit happened; an insert retried then may be written twice.

Example:
    >>> def write():
    ...     with engine.begin() as connection:
    ...         connection.execute(statement)
    >>> run_with_retry(write, "record progress")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from sweepmaster.errors import StorageError

__all__ = [
    "DEFAULT_RETRY_TIMEOUT_S",
    "DEFAULT_STATEMENT_TIMEOUT_S",
    "RETRY_TIMEOUT_ENV",
    "STATEMENT_TIMEOUT_ENV",
    "RetryPolicy",
    "is_transient",
    "run_with_retry",
    "statement_timeout_s",
]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a database may stay unusable before a retried write gives up.
DEFAULT_RETRY_TIMEOUT_S = 60.0
#: Environment variable overriding :data:`DEFAULT_RETRY_TIMEOUT_S` (seconds, ``0``: no retry).
RETRY_TIMEOUT_ENV = "SWEEPMASTER_STORAGE_RETRY_S"

#: Seconds a PostgreSQL statement may take before it is ended (a silent network included):
#: well inside :data:`DEFAULT_RETRY_TIMEOUT_S`, so that an outage ends within the window.
DEFAULT_STATEMENT_TIMEOUT_S = 20.0
#: Environment variable overriding :data:`DEFAULT_STATEMENT_TIMEOUT_S` (seconds, > 0).
STATEMENT_TIMEOUT_ENV = "SWEEPMASTER_STATEMENT_TIMEOUT_S"

#: SQLite errors that go away by themselves; its other OperationalErrors ("no such table",
#: syntax errors) do not.
_SQLITE_TRANSIENT = ("locked", "busy", "unable to open database file", "disk i/o error")
_jitter = random.Random()  # never the global random module: trials may seed that one


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often database work is retried through an outage.

    Attributes:
        timeout_s: Seconds after the first failure when no new attempt starts any more; the
            total time is at most this plus one attempt (a connect or busy timeout). ``0``
            never retries.
        initial_delay_s: Seconds before the first retry.
        max_delay_s: Longest wait between two attempts, in seconds.
        multiplier: Growth of the wait from one retry to the next.
    """

    timeout_s: float = DEFAULT_RETRY_TIMEOUT_S
    initial_delay_s: float = 0.05
    max_delay_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not (self.timeout_s >= 0 and self.initial_delay_s > 0 and self.max_delay_s > 0
                and self.multiplier >= 1):
            raise ValueError(f"invalid retry policy {self!r}: timeout_s >= 0, delays > 0 and "
                             "multiplier >= 1 needed")

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """Return the default policy, with ``timeout_s`` from ``$SWEEPMASTER_STORAGE_RETRY_S``.

        Raises:
            StorageError: The variable is set but is not a number of seconds >= 0.
        """
        text = os.environ.get(RETRY_TIMEOUT_ENV, "").strip()
        if not text:
            return cls()
        try:
            timeout_s = float(text)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s >= 0 or timeout_s == float("inf"):
            raise StorageError(f"{RETRY_TIMEOUT_ENV}: expected a number of seconds >= 0, "
                               f"got {text!r}")
        return cls(timeout_s=timeout_s)

    def delays(self) -> Iterator[float]:
        """Yield the waits between attempts (seconds): exponential, capped, jittered 50-100 %."""
        delay = self.initial_delay_s
        while True:
            yield delay * _jitter.uniform(0.5, 1.0)
            delay = min(delay * self.multiplier, self.max_delay_s)


def _causes(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_transient(err: BaseException) -> bool:
    """Say whether a database error may go away by itself, so the work is worth repeating.

    Transient: a connection the pool invalidated (the server closed it), a pool checkout
    timeout, any ``OperationalError`` of a server database (unreachable, shut down, connection
    terminated, serialization failure, deadlock), a closed-connection ``InterfaceError``, and a
    SQLite file that is locked, busy or cannot be opened for now. Optuna's
    ``StorageInternalError`` is judged by the SQLAlchemy error it wraps.

    Args:
        err: The exception raised by the database work.

    Returns:
        ``True`` when retrying may succeed.
    """
    import sqlalchemy.exc  # here: reading the settings (RetryPolicy.from_env) needs no SQLAlchemy

    for cause in _causes(err):
        if isinstance(cause, sqlalchemy.exc.TimeoutError):
            return True
        if not isinstance(cause, sqlalchemy.exc.DBAPIError):
            continue
        if cause.connection_invalidated:
            return True
        if isinstance(cause.orig, sqlite3.Error):
            message = str(cause.orig).lower()
            return isinstance(cause.orig, sqlite3.OperationalError) and any(
                text in message for text in _SQLITE_TRANSIENT)
        if isinstance(cause, sqlalchemy.exc.OperationalError):
            return True
        if isinstance(cause, sqlalchemy.exc.InterfaceError):
            return "closed" in str(cause.orig).lower()
        return False
    return False


def _database_error(err: BaseException) -> BaseException | None:
    """The SQLAlchemy error behind ``err`` (itself, or wrapped by Optuna), if there is one."""
    import sqlalchemy.exc

    return next((c for c in _causes(err) if isinstance(c, sqlalchemy.exc.SQLAlchemyError)),
                None)


def statement_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a PostgreSQL statement may take: ``$SWEEPMASTER_STATEMENT_TIMEOUT_S`` or 20.

    Used by :func:`~sweepmaster.store.engine.postgres_connect_args` (the server's
    ``statement_timeout``, ``tcp_user_timeout``) and
    :func:`~sweepmaster.store.engine.guard_statements` (the client's deadline).

    Args:
        environ: The environment; default ``os.environ``.

    Raises:
        StorageError: The variable is set but is not a positive number of seconds.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(STATEMENT_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_STATEMENT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise StorageError(f"${STATEMENT_TIMEOUT_ENV}: expected a positive number of seconds, "
                           f"got {text!r}")
    return seconds


def run_with_retry(work: Callable[[], T], what: str, policy: RetryPolicy | None = None) -> T:
    """Run ``work``; repeat it with backoff while it fails transiently, within ``policy``.

    Args:
        work: One unit of database work that is safe to repeat (see the module doc).
        what: What the work does, for messages, e.g. ``"record the end of trial 3"``.
        policy: Limits; default :meth:`RetryPolicy.from_env`.

    Returns:
        What ``work`` returned.

    Raises:
        StorageError: ``work`` failed with a database error that is not transient (at once),
            or with transient ones for longer than ``policy.timeout_s``. The message is one
            line: ``"cannot <what>"``, how long the database was unavailable, and the driver's
            message.
        Exception: Whatever else ``work`` raised, unchanged.
    """
    from sweepmaster.store.engine import first_line

    policy = policy if policy is not None else RetryPolicy.from_env()
    first_failure_s: float | None = None
    delays = policy.delays()
    num_attempts = 0
    while True:
        num_attempts += 1
        try:
            result = work()
        except Exception as err:
            cause = _database_error(err)
            if cause is None:
                raise
            if not is_transient(err):
                raise StorageError(f"cannot {what}: {first_line(cause)}") from err
            now = time.monotonic()
            if first_failure_s is None:
                first_failure_s = now
                if policy.timeout_s > 0:  # else the caller reports the failure, or not
                    _log.warning("cannot %s: database unavailable (%s); retrying for up to "
                                 "%.0f s", what, first_line(cause), policy.timeout_s)
            waited_s = now - first_failure_s
            delay_s = next(delays)
            if waited_s + delay_s > policy.timeout_s:
                raise StorageError(
                    f"cannot {what}: database unavailable for {waited_s:.1f} s "
                    f"({num_attempts} attempts): {first_line(cause)}"
                ) from err
            _log.debug("%s: attempt %d failed (%s); next in %.2f s", what, num_attempts,
                       first_line(cause), delay_s)
            time.sleep(delay_s)
            continue
        if first_failure_s is not None:
            _log.warning("%s: database available again after %.1f s (%d attempts)", what,
                         time.monotonic() - first_failure_s, num_attempts)
        return result
