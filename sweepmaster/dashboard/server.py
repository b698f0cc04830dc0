"""Serving the dashboard: in the foreground (``sweepmaster dashboard``) or beside a sweep.

Binds ``127.0.0.1`` by default. Any other address serves other machines, so it needs a token:
``token=`` or the :data:`TOKEN_ENV` environment variable (at least :data:`MIN_TOKEN_CHARS`
characters, no spaces); without one, :func:`serve` and :func:`start_in_background` make a
random one, which the login URL they print carries (as Jupyter does). The socket is bound
before the server starts, so an address in use is a clear :class:`DashboardError` rather than
a log line.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI

from sweepmaster.dashboard.app import create_app
from sweepmaster.dashboard.deps import DashboardState
from sweepmaster.dashboard.errors import DashboardError
from sweepmaster.dashboard.security import LOOPBACK_HOSTS

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "MIN_TOKEN_CHARS",
    "DashboardHandle",
    "is_loopback",
    "resolve_token",
    "serve",
    "start_in_background",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
TOKEN_ENV = "SWEEPMASTER_DASHBOARD_TOKEN"
"""Environment variable holding the dashboard's token when ``--token`` is not given."""

#: Fewest characters of a token given (NIST SP 800-63B's minimum for a chosen secret).
MIN_TOKEN_CHARS = 8

_STARTUP_TIMEOUT_S = 30.0
_GRACEFUL_SHUTDOWN_S = 3


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name or address (only this machine can connect)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, token: str | None) -> str | None:
    """Return the token to require, from ``token`` or :data:`TOKEN_ENV`, or a new one.

    A token given must be at least :data:`MIN_TOKEN_CHARS` characters without white space: a
    blank or short one would open the dashboard to whoever guesses it. Without one, a loopback
    address serves without a token, and any other address gets a new random token
    (``secrets.token_urlsafe``, 256 bits), which the login URL carries, as Jupyter does.

    Args:
        host: The address to bind.
        token: The token given on the command line, if any.

    Returns:
        The token, or ``None`` (only on a loopback address without one).

    Raises:
        DashboardError: The token given is blank, shorter than :data:`MIN_TOKEN_CHARS` or
            holds white space (``"--token: expected ..."``, never echoing it).
    """
    given = token if token is not None else os.environ.get(TOKEN_ENV)
    where = "--token" if token is not None else f"environment variable {TOKEN_ENV}"
    if token is None and not given:
        given = None  # an empty variable is an unset one
    if given is not None:
        problem = ("a blank one" if not given.strip() else
                   "one with white space" if any(c.isspace() for c in given) else
                   f"one of {len(given)} characters" if len(given) < MIN_TOKEN_CHARS else None)
        if problem is not None:
            raise DashboardError(
                f"{where}: expected a token of at least {MIN_TOKEN_CHARS} characters without "
                f"spaces (leave it out off localhost for a generated one), got {problem}")
        return given
    if not is_loopback(host):
        return secrets.token_urlsafe(32)
    return None


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
    except socket.gaierror as err:
        raise DashboardError(f"cannot serve the dashboard on {host}: {err.strerror}") from err
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        raise DashboardError(
            f"cannot serve the dashboard on {host}:{port}: {err.strerror or err}"
        ) from err
    return sock


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/"


class _RedactToken(logging.Filter):
    """Hides ``token=`` query values in uvicorn's access log lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _TOKEN_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a
                for a in record.args
            )
        return True


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s]*")


class _Server(uvicorn.Server):
    """uvicorn's server that also ends the app's live event streams when asked to exit."""

    def __init__(self, config: uvicorn.Config, state: DashboardState) -> None:
        super().__init__(config)
        self.dashboard_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.dashboard_state.stopping.set()
        super().handle_exit(sig, frame)


def _server(app: FastAPI, log_level: str, access_log: bool) -> _Server:
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    server = _Server(config, app.state.dashboard)
    access = logging.getLogger("uvicorn.access")  # configured by uvicorn.Config() above
    if not any(isinstance(f, _RedactToken) for f in access.filters):
        access.addFilter(_RedactToken())
    return server


def serve(
    storage: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    *,
    poll_interval_s: float = 1.0,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the dashboard until interrupted (Ctrl-C).

    Example:
        >>> serve("sqlite:///sweepmaster.db")  # doctest: +SKIP

    Args:
        storage: SQLAlchemy URL of the sweep database (only read).
        host: Address to bind; anything but a loopback address needs a token.
        port: Port to bind; 0 picks a free one.
        token: Token every request must carry; default the :data:`TOKEN_ENV` variable.
        poll_interval_s: Seconds between database polls of a live event stream.
        on_ready: Called with the URL to open (with ``?token=`` when there is a token) once
            the socket is bound; default prints it to stderr.

    Raises:
        DashboardError: A blank or short token, or the address cannot be bound.
        StorageError: The database is unreachable.
    """
    token = resolve_token(host, token)
    app = create_app(storage, token=token, poll_interval_s=poll_interval_s,
                     allowed_hosts=None if token else _loopback_hosts(host))
    sock = _bind(host, port)
    url = _url(host, sock)
    login = f"{url}?token={quote(token)}" if token else url
    if on_ready is None:
        print(f"sweepmaster dashboard: {login}", file=sys.stderr, flush=True)
    else:
        on_ready(login)
    _server(app, "info", True).run(sockets=[sock])


def _loopback_hosts(host: str) -> frozenset[str]:
    return LOOPBACK_HOSTS | {host.strip("[]").lower()}


class DashboardHandle:
    """A dashboard served from a background thread (see :func:`start_in_background`).

    Attributes:
        url: The base URL, e.g. ``http://127.0.0.1:8080/``.
        login_url: The URL to open: ``url`` with ``?token=`` when a token is required.
        app: The served FastAPI app.
    """

    def __init__(self, server: _Server, thread: threading.Thread, app: FastAPI, url: str,
                 token: str | None) -> None:
        self._server = server
        self._thread = thread
        self.url = url
        self.login_url = f"{url}?token={quote(token)}" if token else url
        self.app = app

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (live event streams end first) and wait for the thread to end.

        Args:
            timeout_s: Longest wait in seconds for the server thread to finish.
        """
        self._server.dashboard_state.stopping.set()
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> DashboardHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_in_background(
    storage: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    *,
    poll_interval_s: float = 1.0,
) -> DashboardHandle:
    """Serve the dashboard from a daemon thread, e.g. while ``launch`` runs a sweep.

    Logs only warnings (no access log), so a progress display in the terminal stays clean.

    Example:
        >>> handle = start_in_background("sqlite:///sweepmaster.db", port=0)  # doctest: +SKIP
        >>> print(handle.login_url)  # doctest: +SKIP
        >>> handle.stop()  # doctest: +SKIP

    Args:
        storage: SQLAlchemy URL of the sweep database (only read).
        host: Address to bind; anything but a loopback address needs a token.
        port: Port to bind; 0 picks a free one (read it from ``handle.url``).
        token: Token every request must carry; default the :data:`TOKEN_ENV` variable.
        poll_interval_s: Seconds between database polls of a live event stream.

    Returns:
        A handle with ``url``, ``login_url`` and ``stop()``; also a context manager.

    Raises:
        DashboardError: A blank or short token, the address cannot be bound, or
            the server did not start.
        StorageError: The database is unreachable.
    """
    token = resolve_token(host, token)
    app = create_app(storage, token=token, poll_interval_s=poll_interval_s,
                     allowed_hosts=None if token else _loopback_hosts(host))
    sock = _bind(host, port)
    server = _server(app, "warning", False)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as err:  # noqa: B036 (uvicorn exits with SystemExit on failure)
            failure.append(err)
        finally:
            sock.close()

    thread = threading.Thread(target=run, name="sweepmaster-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            reason = f": {failure[0]!r}" if failure else ""
            raise DashboardError(f"the dashboard did not start on {host}:{port}{reason}")
        time.sleep(0.02)
    return DashboardHandle(server, thread, app, _url(host, sock), token)
