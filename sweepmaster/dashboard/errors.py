"""Errors of the dashboard; the app turns each into a JSON ``{"detail": message}`` response."""

from __future__ import annotations

from sweepmaster.errors import SweepmasterError

__all__ = ["DashboardError", "NotFoundError", "PlotUnavailableError"]


class DashboardError(SweepmasterError):
    """The dashboard cannot start as asked (e.g. a public address without a token)."""


class NotFoundError(SweepmasterError):
    """A sweep or trial the request names does not exist (HTTP 404)."""


class PlotUnavailableError(SweepmasterError):
    """An analysis plot cannot be drawn from the sweep's trials yet (HTTP 409)."""
