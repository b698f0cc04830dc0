"""The dashboard's routers: one module per page's data, plus live events and static pages."""

from __future__ import annotations

from sweepmaster.dashboard.routes import (
    devices,
    docs,
    info,
    pages,
    plots,
    streams,
    sweeps,
    trials,
)

__all__ = ["devices", "docs", "info", "pages", "plots", "streams", "sweeps", "trials"]
