"""``/api/info``: what this dashboard serves."""

from __future__ import annotations

from fastapi import APIRouter

from sweepmaster import __version__
from sweepmaster.dashboard.deps import StateDep
from sweepmaster.dashboard.routes._responses import ERRORS
from sweepmaster.dashboard.schemas import DashboardInfo
from sweepmaster.store.engine import masked_url

router = APIRouter(prefix="/api", tags=["info"], responses=ERRORS)


@router.get("/info", response_model=DashboardInfo, summary="Version and storage")
def get_info(state: StateDep) -> DashboardInfo:
    """Return the dashboard's version and the storage it reads."""
    return DashboardInfo(
        version=__version__,
        storage=masked_url(state.reader.storage),
        read_only=True,
        poll_interval_s=state.poll_interval_s,
    )
