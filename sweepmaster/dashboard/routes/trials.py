"""``/api/sweeps/{name}/trials/{number}``: one trial with its learning curves."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from sweepmaster.dashboard.deps import StateDep, SweepName
from sweepmaster.dashboard.routes._responses import ERRORS
from sweepmaster.dashboard.schemas import TrialDetail

router = APIRouter(prefix="/api/sweeps", tags=["trials"], responses=ERRORS)


@router.get("/{name}/trials/{number}", response_model=TrialDetail, summary="One trial")
def get_trial(
    name: SweepName,
    number: Annotated[int, Path(ge=0, le=2**31 - 1, description="Optuna's trial number.")],
    state: StateDep,
    max_points: Annotated[
        int, Query(ge=2, le=100_000, description="Most points per curve (thinned evenly).")
    ] = 2000,
) -> TrialDetail:
    """Return one trial with everything recorded about it.

    Its params, learning curves of every recorded metric, intermediate values, checkpoint path
    and failure reason.
    """
    return state.reader.trial_detail(name, number, max_points)
