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

__all__ = ["ROUTERS", "devices", "docs", "info", "pages", "plots", "streams", "sweeps", "trials"]

ROUTERS = (info.router, sweeps.router, trials.router, plots.router, devices.router,
           streams.router, pages.router, docs.router)
"""Every router, in the order the app includes them (the static pages' catch-all late)."""
