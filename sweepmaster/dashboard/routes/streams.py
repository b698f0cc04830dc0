"""Server-Sent Events: live changes of the sweep list and of one sweep.

Events (each ``data`` is JSON): ``sweeps`` (a :class:`SweepList`), ``sweep`` (a
:class:`SweepSummary`: counts, best, status), ``trials`` (a :class:`TrialsChanged`: rows that
changed), ``error`` (``{"detail": message}``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.sse import EventSourceResponse, ServerSentEvent

from sweepmaster.dashboard.deps import OverviewDep, StateDep, SweepName
from sweepmaster.dashboard.live import SweepListWatcher, SweepWatcher, event_stream
from sweepmaster.dashboard.routes._responses import ERRORS

router = APIRouter(prefix="/api", tags=["events"], responses=ERRORS)


@router.get("/events", response_class=EventSourceResponse, summary="Live sweep list")
async def sweeps_events(state: StateDep) -> AsyncIterator[ServerSentEvent]:
    """Stream ``sweeps`` events whenever the list of sweeps or their counts change."""
    watcher = SweepListWatcher(state.reader)
    async for item in event_stream(watcher, 2 * state.poll_interval_s, state.stopping):
        yield item


@router.get("/sweeps/{name}/events", response_class=EventSourceResponse, summary="Live sweep")
async def sweep_events(
    name: SweepName, state: StateDep, overview: OverviewDep
) -> AsyncIterator[ServerSentEvent]:
    """Stream ``sweep`` (counts, best, status) and ``trials`` (changed rows) events."""
    watcher = SweepWatcher(state.reader, name)
    async for item in event_stream(watcher, state.poll_interval_s, state.stopping):
        yield item
