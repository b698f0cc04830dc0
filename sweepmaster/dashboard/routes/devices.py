"""``/api/sweeps/{name}/timeline``, ``/fusion`` and ``/workers``: where the sweep trains.

The first two read tables the executor writes (``sm_task_events``, ``sm_fusion_groups``;
columns in :mod:`sweepmaster.dashboard.queries`) and are empty until it does;
``/workers`` reads ``sm_workers`` (:mod:`sweepmaster.store.workers`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from sweepmaster.dashboard.deps import StateDep, SweepName
from sweepmaster.dashboard.routes._responses import ERRORS
from sweepmaster.dashboard.schemas import FusionGroups, Timeline, WorkerList

router = APIRouter(prefix="/api/sweeps", tags=["devices"], responses=ERRORS)


@router.get("/{name}/timeline", response_model=Timeline, summary="Device timeline")
def get_timeline(
    name: SweepName,
    state: StateDep,
    limit: Annotated[
        int, Query(ge=1, le=200_000, description="Most shard tasks (the latest).")
    ] = 20_000,
) -> Timeline:
    """Return shard tasks per device over time with swap volume and memory per device."""
    return state.reader.timeline(name, limit)


@router.get("/{name}/fusion", response_model=FusionGroups, summary="Fused arrays")
def get_fusion(name: SweepName, state: StateDep) -> FusionGroups:
    """Return the sweep's fused arrays (same-architecture trials trained as one job)."""
    return state.reader.fusion(name)


@router.get("/{name}/workers", response_model=WorkerList, summary="Workers")
def get_workers(name: SweepName, state: StateDep) -> WorkerList:
    """Return the processes training the sweep: host, pid, devices, state, last heartbeat."""
    return state.reader.workers(name)
