"""The dashboard's FastAPI app: routers, JSON errors, access control, shared state.

Every error is a JSON body ``{"detail": message}``; an unexpected exception is logged with its
traceback on the server and answered with a one-line 500, never the traceback.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sweepmaster import __version__
from sweepmaster.dashboard.deps import DashboardState
from sweepmaster.dashboard.errors import NotFoundError, PlotUnavailableError
from sweepmaster.dashboard.plots import PlotMaker
from sweepmaster.dashboard.reader import DashboardReader
from sweepmaster.dashboard.routes import ROUTERS
from sweepmaster.dashboard.security import LOOPBACK_HOSTS, AccessMiddleware
from sweepmaster.errors import StorageError, SweepmasterError
from sweepmaster.store.engine import first_line

__all__ = ["create_app"]

_log = logging.getLogger(__name__)


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _error(exc.status_code, str(exc.detail), dict(exc.headers or {}))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems: dict[str, None] = {}  # ordered and without repeats
    for err in exc.errors():
        where = ".".join(str(part) for part in err.get("loc", ()))
        problems[f"{where}: {err.get('msg', 'invalid')}"] = None
    return _error(422, "; ".join(problems) or "invalid request")


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return _error(404, str(exc))


async def _plot_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return _error(409, str(exc))


async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(503, str(exc))


async def _user_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(400, str(exc))


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    _log.warning("database error on %s: %s", request.url.path, exc)
    return _error(503, f"cannot read the database: {first_line(exc)}")


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this response: the server logs its traceback.
    return _error(500, f"internal error ({type(exc).__name__}); see the dashboard's log")


def create_app(
    storage: str,
    *,
    token: str | None = None,
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS,
    poll_interval_s: float = 1.0,
) -> FastAPI:
    """Build the dashboard app on one storage URL.

    Example:
        >>> app = create_app("sqlite:///sweepmaster.db")  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8080)  # doctest: +SKIP

    Args:
        storage: SQLAlchemy URL of the sweep database; it is only ever read.
        token: When set, every request must carry it (see
            :mod:`sweepmaster.dashboard.security`).
        allowed_hosts: Without a token, the ``Host`` names answered (loopback names by
            default); ``None`` answers any.
        poll_interval_s: Seconds between database polls of a live event stream.

    Returns:
        The app; its state is ``app.state.dashboard`` (a :class:`DashboardState`).

    Raises:
        StorageError: The database is unreachable.
    """
    if poll_interval_s <= 0:
        raise ValueError(f"poll_interval_s must be > 0, not {poll_interval_s}")
    state = DashboardState(DashboardReader(storage), PlotMaker(storage), poll_interval_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.stopping.set()
        state.plots.close()
        state.reader.close()

    app = FastAPI(
        title="sweepmaster dashboard",
        version=__version__,
        description="Read-only API of a sweep database: sweeps, trials, learning curves, "
        "Optuna's plots, device timelines, and live updates by Server-Sent Events.",
        lifespan=lifespan,
        docs_url=None,  # served by routes/docs.py, from a package rather than a CDN
        redoc_url=None,
    )
    app.state.dashboard = state
    for router in ROUTERS:
        app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(NotFoundError, _not_found)
    app.add_exception_handler(PlotUnavailableError, _plot_unavailable)
    app.add_exception_handler(StorageError, _storage_error)
    app.add_exception_handler(SweepmasterError, _user_error)
    app.add_exception_handler(sqlalchemy.exc.SQLAlchemyError, _database_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(AccessMiddleware, token=token, allowed_hosts=allowed_hosts)
    return app
