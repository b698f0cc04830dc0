"""The dashboard's routers: one module per page's data, plus live events and static pages."""

from __future__ import annotations

from sweepmaster.dashboard.routes import (
    devices,
    docs,
    events,
    info,
    pages,
    plots,
    sweeps,
    trials,
)

__all__ = ["ROUTERS", "devices", "docs", "events", "info", "pages", "plots", "sweeps", "trials"]

ROUTERS = (info.router, sweeps.router, trials.router, plots.router, devices.router,
           events.router, pages.router, docs.router)
"""Every router, in the order the app includes them (the static pages' catch-all late)."""
