"""The web dashboard: a read-only FastAPI app (API + Server-Sent Events) serving ``web/``.

Example:
    >>> from sweepmaster.dashboard import start_in_background
    >>> handle = start_in_background("sqlite:///sweepmaster.db", port=0)  # doctest: +SKIP
    >>> handle.login_url  # doctest: +SKIP
    'http://127.0.0.1:40213/'
    >>> handle.stop()  # doctest: +SKIP
"""

from __future__ import annotations

from sweepmaster.dashboard.app import create_app
from sweepmaster.dashboard.errors import DashboardError, NotFoundError, PlotUnavailableError
from sweepmaster.dashboard.server import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    TOKEN_ENV,
    DashboardHandle,
    serve,
    start_in_background,
)

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "DashboardError",
    "DashboardHandle",
    "NotFoundError",
    "PlotUnavailableError",
    "create_app",
    "serve",
    "start_in_background",
]
