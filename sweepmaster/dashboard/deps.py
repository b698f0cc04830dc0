"""Dependencies of the routes: the app's shared state and the sweep a path names."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Path, Request

from sweepmaster.dashboard.plots import PlotMaker
from sweepmaster.dashboard.queries import SweepOverview
from sweepmaster.dashboard.reader import DashboardReader

__all__ = ["DashboardState", "OverviewDep", "StateDep", "SweepName"]


@dataclass
class DashboardState:
    """What every request of one app shares.

    Attributes:
        reader: Read-only access to the storage.
        plots: Optuna's plots, cached.
        poll_interval_s: Seconds between two database polls of a live event stream.
        stopping: Set when the server stops; live event streams then end.
    """

    reader: DashboardReader
    plots: PlotMaker
    poll_interval_s: float = 1.0
    stopping: threading.Event = field(default_factory=threading.Event)


def get_state(request: Request) -> DashboardState:
    """The app's :class:`DashboardState`."""
    state: DashboardState = request.app.state.dashboard
    return state


StateDep = Annotated[DashboardState, Depends(get_state)]
SweepName = Annotated[str, Path(description="The sweep's name.", min_length=1, max_length=255)]


def get_overview(name: SweepName, state: StateDep) -> SweepOverview:
    """The sweep the path names.

    Raises:
        NotFoundError: There is no such sweep (HTTP 404).
    """
    return state.reader.overview(name)


OverviewDep = Annotated[SweepOverview, Depends(get_overview)]
