"""Engine creation for sweepmaster's storage URL (SQLite or PostgreSQL).

SQLite is the embedded default: every connection runs in WAL mode (readers never block the
writer), waits up to :data:`SQLITE_BUSY_TIMEOUT_MS` for a lock instead of failing with
"database is locked", and enforces foreign keys. PostgreSQL connections are pre-pinged so a pool
survives server restarts.

The commands that only read (``status``, ``plan``, ``dashboard``) open the database with
:func:`create_read_only_engine` instead: it never creates, migrates or changes a database, not
even its journal mode, and works in a directory the user cannot write.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import sqlite3
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import sqlalchemy.exc
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Engine, make_url

from sweepmaster.errors import StorageError
from sweepmaster.store.retry import statement_timeout_s

__all__ = ["SQLITE_BUSY_TIMEOUT_MS", "create_read_only_engine", "create_store_engine",
           "first_line", "guard_statements", "make_read_only", "masked_text", "masked_url",
           "postgres_connect_args", "read_only_url"]

SQLITE_BUSY_TIMEOUT_MS = 30_000
"""How long (milliseconds) a SQLite connection waits for a lock before giving up."""

_POSTGRES_CONNECT_TIMEOUT_S = 10


def masked_url(url: str | URL) -> str:
    """Render a storage URL with its password replaced by ``***``.

    Args:
        url: A SQLAlchemy URL, as a string or a :class:`sqlalchemy.engine.URL`.

    Returns:
        The URL as a string that is safe to print.
    """
    try:
        return make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:  # shown as given, less anything like a password
        return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", str(url))


#: ``scheme://user:password@``: a URL's password, up to the last ``@`` of its authority.
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/@:\s\"']*:)[^/\s\"']*@")


def masked_text(text: str) -> str:
    """Return ``text`` with the password of every URL in it replaced by ``***``.

    What a configuration text holds of its storage URL (``storage:``), as stored in
    ``sm_sweeps.config_text``, served by the dashboard or logged: a URL without a password,
    and every other character, are kept as they are, so masking twice changes nothing.

    Args:
        text: Any text (a JSON or YAML configuration, a message).

    Returns:
        The text, safe to store and show.
    """
    return _URL_PASSWORD.sub(r"\1***@", text)


def first_line(err: BaseException) -> str:
    """Return the first line of a database error's message (of the driver's error if wrapped)."""
    orig = getattr(err, "orig", None) or err
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(orig).__name__


def _sqlite_file(url: URL) -> Path | None:
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _on_sqlite_connect(busy_timeout_ms: int, dbapi_connection: sqlite3.Connection,
                       connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # busy_timeout first: switching to WAL needs a lock that another connection may hold.
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # SQLite may refuse the switch with "database is locked" at once, without waiting, while
        # other connections open a new file at the same time: wait for it here instead.
        deadline_s = time.monotonic() + busy_timeout_ms / 1000
        while True:
            try:
                cursor.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline_s:
                    raise
                time.sleep(0.01)
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def postgres_connect_args(url: URL) -> dict[str, Any]:
    """Settings of libpq that end every PostgreSQL wait: connecting, statements, silence.

    A network that stops delivering packets without a reset (a cut cable, a dropped route, a
    firewall's state table flushed) would otherwise leave a connection waiting for an answer
    forever. So: ``connect_timeout`` (10 s, unless the URL sets it), TCP keepalives (a probe
    after 5 s idle, every 2 s, 3 unanswered: dead), ``tcp_user_timeout`` (sent data
    unacknowledged that long: dead) and the server's ``statement_timeout`` (appended to the
    URL's ``options``), the last two :func:`statement_timeout_s`. A statement that still gets
    no answer is ended by the client (:func:`guard_statements`). The writers' retries
    (:mod:`sweepmaster.store.retry`) then ride the outage out or give up within their window.

    Args:
        url: The PostgreSQL URL (its query's settings win, except ``options``, extended).

    Returns:
        ``connect_args`` for :func:`sqlalchemy.create_engine`.
    """
    timeout_ms = int(statement_timeout_s() * 1000)
    args: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                            "keepalives_count": 3, "tcp_user_timeout": timeout_ms,
                            "connect_timeout": _POSTGRES_CONNECT_TIMEOUT_S}
    args = {key: value for key, value in args.items() if key not in url.query}
    options = url.query.get("options", "")
    options = " ".join(options) if isinstance(options, tuple) else options
    args["options"] = f"{options} -c statement_timeout={timeout_ms}".strip()
    return args


class _StatementWatchdog:
    """Shuts the socket of a PostgreSQL connection whose statement got no answer in time.

    The server's ``statement_timeout`` ends a slow statement, but only a server that receives
    it: when the network in between swallows packets (and the peer's TCP stack still answers,
    as a proxy or a NAT does), the client waits forever. One daemon thread checks every 0.5 s
    the statements (and commits, rollbacks) in flight; one older than its deadline has its
    socket shut, so the driver's wait fails at once with a connection error, which the retries
    treat as an outage.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[int, tuple[float, int]] = {}  # id(dbapi connection) -> deadline, fd
        self._thread: threading.Thread | None = None

    def arm(self, dbapi_connection: Any, timeout_s: float) -> None:
        try:
            fd = int(dbapi_connection.fileno())
        except Exception:  # closed, or a driver without a socket
            return
        with self._lock:
            self._due[id(dbapi_connection)] = (time.monotonic() + timeout_s, fd)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="statement-watchdog",
                                                daemon=True)
                self._thread.start()

    def disarm(self, dbapi_connection: Any) -> None:
        with self._lock:
            self._due.pop(id(dbapi_connection), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self._lock:
                late = [key for key, (deadline, _) in self._due.items() if deadline < now]
                for key in late:
                    _, fd = self._due.pop(key)
                    _shut(fd)


def _shut(fd: int) -> None:
    """Shut a socket (by descriptor) for reading and writing; the driver's wait then fails."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


_WATCHDOG = _StatementWatchdog()


def guard_statements(engine: Engine) -> None:
    """End a PostgreSQL engine's statements that get no answer (:class:`_StatementWatchdog`).

    A statement, commit or rollback (a pooled connection's reset and ``pool_pre_ping`` too)
    still waiting 2 s after :func:`statement_timeout_s` has its connection's socket shut: it
    fails as if the server had gone, and the caller's retries take over. No-op for other
    databases.
    """
    if engine.dialect.name != "postgresql":
        return
    timeout_s = statement_timeout_s() + 2.0

    def arm_cursor(connection: Any, *_: Any) -> None:
        _WATCHDOG.arm(connection.connection.dbapi_connection, timeout_s)

    def disarm_cursor(connection: Any, *_: Any) -> None:
        _WATCHDOG.disarm(connection.connection.dbapi_connection)

    def arm_connection(connection: Any) -> None:
        _WATCHDOG.arm(connection.connection.dbapi_connection, timeout_s)

    def arm_pooled(dbapi_connection: Any, *_: Any) -> None:
        _WATCHDOG.arm(dbapi_connection, timeout_s)

    def disarm_pooled(dbapi_connection: Any, *_: Any) -> None:
        _WATCHDOG.disarm(dbapi_connection)

    def disarm_failed(context: Any) -> None:
        dbapi_connection = getattr(context.connection, "connection", None)
        if dbapi_connection is not None:
            with contextlib.suppress(Exception):
                _WATCHDOG.disarm(dbapi_connection.dbapi_connection)

    ping = engine.dialect.do_ping  # pool_pre_ping's statement runs outside every event

    def guarded_ping(dbapi_connection: Any) -> bool:
        _WATCHDOG.arm(dbapi_connection, timeout_s)
        try:
            return bool(ping(dbapi_connection))
        finally:
            _WATCHDOG.disarm(dbapi_connection)

    engine.dialect.do_ping = guarded_ping  # type: ignore[method-assign]
    event.listen(engine, "before_cursor_execute", arm_cursor)
    event.listen(engine, "after_cursor_execute", disarm_cursor)
    event.listen(engine, "commit", arm_connection)
    event.listen(engine, "rollback", arm_connection)
    event.listen(engine, "handle_error", disarm_failed)
    event.listen(engine.pool, "reset", arm_pooled)
    event.listen(engine.pool, "checkin", disarm_pooled)
    event.listen(engine.pool, "checkout", disarm_pooled)
    event.listen(engine.pool, "close", disarm_pooled)


def create_store_engine(url: str, *,
                        sqlite_busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> Engine:
    """Create an engine for sweepmaster's tables and check that the database is reachable.

    SQLite connections get ``journal_mode=WAL``, ``busy_timeout`` of
    ``sqlite_busy_timeout_ms`` milliseconds and ``foreign_keys=ON`` from a connect event.
    PostgreSQL engines use ``pool_pre_ping`` and give up connecting after 10 seconds (unless
    the URL sets ``connect_timeout``), and on a statement that gets no answer
    (:func:`postgres_connect_args`, :func:`guard_statements`). Longer outages while a sweep
    runs are ridden out by the writers' retries (:mod:`sweepmaster.store.retry`), not here: an
    unreachable database at start fails at once.

    Example:
        >>> engine = create_store_engine("sqlite:///sweepmaster.db")  # doctest: +SKIP

    Args:
        url: A SQLAlchemy database URL, e.g. ``sqlite:///sweepmaster.db`` or
            ``postgresql+psycopg://user:password@host:5432/db``.
        sqlite_busy_timeout_ms: How long a SQLite statement waits for another connection's
            lock before failing with "database is locked" (milliseconds).

    Returns:
        A connected-and-checked :class:`sqlalchemy.engine.Engine`.

    Raises:
        StorageError: The URL cannot be parsed, its driver is not installed, a SQLite file's
            parent directory does not exist, or the database cannot be connected to. The
            message is one line and shows the URL with its password masked.
    """
    try:
        parsed = make_url(url)
    except sqlalchemy.exc.ArgumentError as err:
        raise StorageError(f"invalid storage URL {masked_url(url)!r}: {first_line(err)}") from err
    shown = masked_url(parsed)
    backend = parsed.get_backend_name()

    kwargs: dict[str, Any] = {}
    if backend == "sqlite":
        path = _sqlite_file(parsed)
        if path is not None and not path.parent.is_dir():
            raise StorageError(
                f"cannot open storage {shown}: directory {str(path.parent)!r} does not exist"
            )
    else:  # a server: survive its restarts, and do not hang on an unreachable host
        kwargs["pool_pre_ping"] = True
        if backend == "postgresql":  # nor on a silent network (postgres_connect_args)
            kwargs["connect_args"] = postgres_connect_args(parsed)

    try:
        engine = create_engine(parsed, **kwargs)
    except (sqlalchemy.exc.ArgumentError, ImportError) as err:
        raise StorageError(f"cannot use storage {shown}: {first_line(err)}") from err
    if backend == "sqlite":
        event.listen(engine, "connect",
                     functools.partial(_on_sqlite_connect, sqlite_busy_timeout_ms))
    guard_statements(engine)

    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except sqlalchemy.exc.DBAPIError as err:
        engine.dispose()
        raise StorageError(f"cannot connect to storage {shown}: {first_line(err)}") from err
    return engine


# --- read-only access ----------------------------------------------------------------------


def _sqlite_is_wal(path: Path) -> bool:
    """Whether a SQLite file's header says WAL mode (bytes 18 and 19 are 2), without opening it."""
    try:
        with path.open("rb") as file:
            header = file.read(100)
    except OSError:
        return False
    return len(header) == 100 and header[18:20] == b"\x02\x02"


def _sqlite_immutable(path: Path) -> bool:
    """Whether ``path`` is opened ``immutable=1`` rather than ``mode=ro`` (no file made).

    So is a WAL-mode file beside which no ``-wal`` file says a writer has it open (a ``mode=ro``
    reader would create ``-wal`` and ``-shm`` files and, unable to delete them, leave them
    behind), and a file in a directory the user cannot write, where SQLite could not create
    them (unless a writer's ``-shm`` is there).
    """
    if not os.access(path.absolute().parent, os.W_OK):
        return not Path(f"{path}-shm").exists()
    return _sqlite_is_wal(path) and not Path(f"{path}-wal").exists()


def _sqlite_uri(path: Path) -> str:
    """The ``file:`` URI SQLite opens ``path`` read-only with (see :func:`_sqlite_immutable`)."""
    mode = "immutable=1" if _sqlite_immutable(path) else "mode=ro"
    return f"file:{urllib.parse.quote(str(path.absolute()))}?{mode}"


def read_only_url(url: str) -> str:
    """Return a URL that opens ``url``'s database without writing anything.

    A SQLite file becomes a ``file:`` URI with ``mode=ro``: SQLite refuses every write and
    creates no database. A WAL-mode file that no process has open (no ``-wal`` file beside it)
    is opened ``immutable=1`` instead, which creates no ``-wal`` / ``-shm`` files either; so is
    one in a directory the user cannot write, where SQLite could not create them. An engine
    passed to :func:`make_read_only` makes that choice again for each new connection and
    drops an ``immutable`` one once a writer appears, so a long-lived reader (the dashboard)
    sees what a sweep writes later. Other URLs are returned as they are.

    Args:
        url: A SQLAlchemy URL.

    Returns:
        The URL to connect with.

    Raises:
        StorageError: The URL cannot be parsed, or names a SQLite file that does not exist
            (``"no database at <url>"``).
    """
    try:
        parsed = make_url(url)
    except sqlalchemy.exc.ArgumentError as err:
        raise StorageError(f"invalid storage URL {masked_url(url)!r}: {first_line(err)}") from err
    if parsed.get_backend_name() != "sqlite":
        return url
    path = _sqlite_file(parsed)
    if path is None:
        return url  # an in-memory database, or a URI the user wrote: used as given
    if not path.is_file():
        raise StorageError(f"no database at {masked_url(parsed)}: nothing to read "
                           "(a launch creates it)")
    return f"sqlite:///{_sqlite_uri(path)}&uri=true"


def _read_only_uri_file(uri: object) -> Path | None:
    """The file a ``file:`` URI of :func:`_sqlite_uri` names; ``None`` for any other."""
    if not isinstance(uri, str) or not uri.startswith("file:"):
        return None
    quoted, _, query = uri.removeprefix("file:").partition("?")
    if query not in ("mode=ro", "immutable=1"):
        return None
    return Path(urllib.parse.unquote(quoted))


_IMMUTABLE = "sweepmaster_immutable"  # connection record info: the file's stamp when opened


def _file_stamp(path: Path) -> tuple[int, int]:
    """Size (bytes) and modification time (ns) of a file; ``(-1, -1)`` if it is gone."""
    try:
        stat = path.stat()
    except OSError:
        return -1, -1
    return stat.st_size, stat.st_mtime_ns


def _sqlite_reconnect(dialect: Any, connection_record: Any, cargs: list[Any],
                      cparams: dict[str, Any]) -> None:
    """``do_connect``: open a read-only SQLite URI ``immutable`` or ``mode=ro`` as it is now."""
    path = _read_only_uri_file(cargs[0] if cargs else None)
    if path is None:
        return
    stamp = _file_stamp(path)
    cargs[0] = _sqlite_uri(path)
    connection_record.info[_IMMUTABLE] = stamp if cargs[0].endswith("?immutable=1") else None


def _sqlite_drop_immutable(path: Path, dbapi_connection: Any, connection_record: Any,
                           connection_proxy: Any) -> None:
    """``checkout``: drop an ``immutable`` connection once a writer has opened the file.

    Such a connection neither reads a ``-wal`` file nor notices a changed database file, so
    it is replaced (``mode=ro`` while the writer runs) as soon as either appears.
    """
    stamp = connection_record.info.get(_IMMUTABLE)
    if stamp is not None and (Path(f"{path}-wal").exists() or _file_stamp(path) != stamp):
        raise sqlalchemy.exc.DisconnectionError(f"{path} has a writer now")


def _sqlite_read_only(busy_timeout_ms: int, dbapi_connection: sqlite3.Connection,
                      connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        cursor.execute("PRAGMA query_only = ON")
    finally:
        cursor.close()


def _postgres_read_only(dbapi_connection: Any, connection_record: Any) -> None:
    if hasattr(dbapi_connection, "read_only"):  # psycopg 3
        dbapi_connection.read_only = True
    else:  # psycopg2
        dbapi_connection.set_session(readonly=True)


def make_read_only(engine: Engine) -> Engine:
    """Make every new connection of ``engine`` refuse writes, and drop its pooled ones.

    SQLite connections get ``PRAGMA query_only`` (and the busy timeout); PostgreSQL sessions
    are read-only.

    Args:
        engine: An engine on SQLite or PostgreSQL.

    Returns:
        The same engine.
    """
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect",
                     functools.partial(_sqlite_read_only, SQLITE_BUSY_TIMEOUT_MS))
        cargs, _ = engine.dialect.create_connect_args(engine.url)
        path = _read_only_uri_file(cargs[0] if cargs else None)
        if path is not None:  # a URI of read_only_url: chosen again per connection
            event.listen(engine, "do_connect", _sqlite_reconnect)
            event.listen(engine, "checkout", functools.partial(_sqlite_drop_immutable, path))
    elif engine.dialect.name == "postgresql":
        event.listen(engine, "connect", _postgres_read_only)
    engine.dispose()  # pooled connections predate the listener
    return engine


def create_read_only_engine(url: str) -> Engine:
    """Create an engine that reads ``url``'s database and can never change it.

    Nothing is created or migrated, and a SQLite file keeps its journal mode and its
    directory's list of files: it is opened through :func:`read_only_url`, and every
    connection refuses writes (:func:`make_read_only`). The engine sees what writers commit
    later, so it may stay open (the dashboard).

    Example:
        >>> engine = create_read_only_engine("sqlite:///sweepmaster.db")  # doctest: +SKIP

    Args:
        url: A SQLAlchemy database URL.

    Returns:
        A connected-and-checked engine.

    Raises:
        StorageError: The URL cannot be parsed, its driver is not installed, a SQLite file does
            not exist, or the database cannot be connected to; one line, password masked.
    """
    connect_url = read_only_url(url)
    parsed = make_url(connect_url)
    shown = masked_url(url)
    kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() != "sqlite":
        kwargs["pool_pre_ping"] = True
        if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
            kwargs["connect_args"] = {"connect_timeout": _POSTGRES_CONNECT_TIMEOUT_S}
    try:
        engine = make_read_only(create_engine(parsed, **kwargs))
    except (sqlalchemy.exc.ArgumentError, ImportError) as err:
        raise StorageError(f"cannot use storage {shown}: {first_line(err)}") from err
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1 FROM sqlite_master LIMIT 1" if
                                    parsed.get_backend_name() == "sqlite" else "SELECT 1"))
    except sqlalchemy.exc.DBAPIError as err:
        engine.dispose()
        raise StorageError(f"cannot read storage {shown}: {first_line(err)}") from err
    return engine
