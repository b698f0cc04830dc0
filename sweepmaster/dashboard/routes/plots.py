"""``/api/sweeps/{name}/plots/{kind}``: Optuna's analysis plots as plotly JSON."""

from __future__ import annotations

from fastapi import APIRouter

from sweepmaster.dashboard.deps import OverviewDep, StateDep
from sweepmaster.dashboard.routes._responses import ERRORS, error
from sweepmaster.dashboard.schemas import PlotAvailability, PlotFigure, PlotKind

router = APIRouter(prefix="/api/sweeps", tags=["plots"], responses=ERRORS)


@router.get(
    "/{name}/plots/{kind}",
    response_model=PlotFigure,
    summary="An Optuna plot",
    responses={409: error("The sweep has too few trials for this plot.")},
)
def get_plot(kind: PlotKind, state: StateDep, overview: OverviewDep) -> PlotFigure:
    """Return an ``optuna.visualization`` figure as plotly JSON.

    Kinds: optimization history, parallel coordinate, parameter importances, intermediate
    values, timeline. A 409 says why a plot cannot be drawn yet.
    """
    return state.plots.figure(overview, kind)


@router.get(
    "/{name}/plots/{kind}/availability",
    response_model=PlotAvailability,
    summary="Whether an Optuna plot can be drawn yet",
)
def get_plot_availability(kind: PlotKind, state: StateDep,
                          overview: OverviewDep) -> PlotAvailability:
    """Return whether the plot can be drawn from the sweep's trials now, and why not.

    What the plot's own route would refuse with 409, answered without an error, so that a page
    asks first and shows the reason.
    """
    return state.plots.availability(overview, kind)
