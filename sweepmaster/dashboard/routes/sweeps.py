"""``/api/sweeps``: the list of sweeps, one sweep, and pages of its trial table."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query

from sweepmaster.dashboard.deps import OverviewDep, StateDep
from sweepmaster.dashboard.queries import SORT_KEYS
from sweepmaster.dashboard.reader import PageRequest
from sweepmaster.dashboard.routes._responses import ERRORS
from sweepmaster.dashboard.schemas import SortOrder, SweepDetail, SweepList, TrialPage, TrialState

router = APIRouter(prefix="/api/sweeps", tags=["sweeps"], responses=ERRORS)

MAX_INDEX = 2**31 - 1
SORT_PATTERN = f"^({'|'.join(SORT_KEYS)}|param:.+)$"

States = Annotated[
    list[TrialState], Query(alias="state", description="Only trials in these states (repeat).")
]
Sort = Annotated[
    str,
    Query(
        pattern=SORT_PATTERN,
        max_length=300,
        description=f"Sort key: {', '.join(SORT_KEYS)}, or param:NAME. Rows without a value "
        "come last.",
    ),
]
Order = Annotated[SortOrder, Query(description="asc or desc.")]
Offset = Annotated[int, Query(ge=0, le=MAX_INDEX, description="Rows to skip.")]
Limit = Annotated[int, Query(ge=1, le=1000, description="Rows per page.")]


def _page(
    overview: OverviewDep,
    states: States = [],  # noqa: B006 (FastAPI copies defaults)
    sort: Sort = "number",
    order: Order = SortOrder.asc,
    offset: Offset = 0,
    limit: Limit = 50,
) -> PageRequest:
    """The page of the trial table a request asks for; a parameter to sort by must exist."""
    if sort.startswith("param:") and sort[len("param:") :] not in overview.param_names:
        raise HTTPException(422, f"sweep {overview.info.name!r} has no parameter {sort[6:]!r}")
    return PageRequest(list(states), sort, order, offset, limit)


PageDep = Annotated[PageRequest, Depends(_page)]


@router.get("", response_model=SweepList, summary="List sweeps")
def list_sweeps(state: StateDep) -> SweepList:
    """Return every sweep with its trial counts per state and best value, oldest first."""
    return state.reader.sweeps()


@router.get("/{name}", response_model=SweepDetail, summary="One sweep")
def get_sweep(state: StateDep, overview: OverviewDep, page: PageDep) -> SweepDetail:
    """Return a sweep's configuration, counts per state, best trial and a page of trials."""
    return state.reader.sweep_detail(overview, page)


@router.get("/{name}/trials", response_model=TrialPage, summary="A page of trials")
def list_trials(state: StateDep, overview: OverviewDep, page: PageDep) -> TrialPage:
    """Return one page of the sweep's trial table, filtered by state and sorted."""
    return state.reader.trial_page(overview, page)
