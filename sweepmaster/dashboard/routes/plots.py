"""``/api/sweeps/{name}/plots/{kind}``: Optuna's analysis plots as plotly JSON."""

from __future__ import annotations

from fastapi import APIRouter

from sweepmaster.dashboard.deps import OverviewDep, StateDep
from sweepmaster.dashboard.routes._responses import ERRORS, error
from sweepmaster.dashboard.schemas import PlotFigure, PlotKind

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
