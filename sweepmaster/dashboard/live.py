"""Live updates: what changed in a sweep since the last look, for Server-Sent Events.

Each event stream polls the database about once a second (a few indexed queries, cheap at
10,000 trials) and pushes only what changed: the sweep's summary (state counts, best trial,
status) when it differs, and the table rows of trials whose Optuna state or progress row
changed. Writers stamp rows with their own clock and commit a little later, so each poll looks
back :data:`OVERLAP_S` seconds before the newest stamp it has seen and drops rows already sent
unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import anyio.to_thread
import sqlalchemy.exc
from fastapi.sse import ServerSentEvent

import sweepmaster.dashboard.queries as q
from sweepmaster.dashboard.errors import NotFoundError
from sweepmaster.dashboard.reader import DashboardReader, trial_summary
from sweepmaster.dashboard.schemas import SweepList, SweepSummary, TrialsChanged
from sweepmaster.errors import SweepmasterError
from sweepmaster.store.engine import first_line

__all__ = ["OVERLAP_S", "SweepListWatcher", "SweepWatcher", "event_stream"]

OVERLAP_S = 5.0
"""Seconds each poll looks back before the newest change it has seen."""
RETRY_MS = 2000
"""How soon a browser reconnects after the stream drops (sent with the first event)."""


class SweepWatcher:
    """Finds the changes of one sweep between calls of :meth:`poll` (one per event stream).

    Not thread-safe: one stream polls it from one worker thread at a time.

    Args:
        reader: The dashboard's reader.
        name: The sweep to watch.
    """

    def __init__(self, reader: DashboardReader, name: str) -> None:
        self._reader = reader
        self._name = name
        self._summary: SweepSummary | None = None
        self._summary_key: tuple[object, ...] | None = None
        self._sent: dict[int, tuple[str, datetime | None]] = {}
        start = datetime.now(timezone.utc) - timedelta(seconds=OVERLAP_S)
        self._progress_seen = start
        self._complete_seen = start

    def poll(self) -> list[tuple[str, Any]]:
        """Return ``(event name, payload)`` pairs of what changed since the last call.

        The first call returns the summary and the rows of unfinished or just-changed trials.

        Raises:
            NotFoundError: The sweep no longer exists.
        """
        engine = self._reader.engine
        overview = q.sweep_overview(engine, self._name, with_best=False, with_params=False)
        if overview is None:
            raise NotFoundError(f"no sweep named {self._name!r}")
        events: list[tuple[str, Any]] = []
        key = (overview.info.status, overview.info.updated_at, sorted(overview.counts.items()))
        if key != self._summary_key:  # the best trial can only change with the counts
            self._summary_key = key
            summary = self._reader.summary(self._reader.overview(self._name))
            if summary != self._summary:
                self._summary = summary
                events.append(("sweep", summary))
        if overview.study_id is None:
            return events
        overlap = timedelta(seconds=OVERLAP_S)
        changed: set[int] = set()
        states = q.active_trial_states(engine, overview.study_id, self._complete_seen - overlap)
        for number, state, completed in states:
            if self._sent.get(number, ("", None))[0] != state:
                changed.add(number)
            if completed is not None:
                self._complete_seen = max(self._complete_seen, completed)
        for number, updated in q.changed_progress(
            engine, overview.info.id, self._progress_seen - overlap
        ):
            if self._sent.get(number, ("", None))[1] != updated:
                changed.add(number)
            self._progress_seen = max(self._progress_seen, updated)
        if changed:
            records = q.trial_records(
                engine, overview.info.id, overview.study_id, sorted(changed)
            )
            now = datetime.now(timezone.utc)
            links = q.trial_links(engine, overview.info.id, overview.study_id,
                                  [r.number for r in records])
            rows = []
            for record in records:
                self._sent[record.number] = (record.state, record.progress_updated_at)
                rows.append(trial_summary(record, now, links))
            if rows:
                events.append(("trials", TrialsChanged(trials=rows)))
        return events


class SweepListWatcher:
    """Finds changes of the list of sweeps (new sweeps, counts, status) between polls."""

    def __init__(self, reader: DashboardReader) -> None:
        self._reader = reader
        self._last: SweepList | None = None

    def poll(self) -> list[tuple[str, Any]]:
        """Return ``[("sweeps", list)]`` when the list changed, else nothing."""
        sweeps = self._reader.sweeps()
        if sweeps == self._last:
            return []
        self._last = sweeps
        return [("sweeps", sweeps)]


async def event_stream(
    watcher: SweepWatcher | SweepListWatcher, interval_s: float, stopping: threading.Event
) -> AsyncIterator[ServerSentEvent]:
    """Poll ``watcher`` every ``interval_s`` seconds and yield its changes as events.

    A database error is sent as an ``error`` event and polling goes on; a sweep that
    disappears ends the stream after an ``error`` event. The stream also ends once
    ``stopping`` is set, so a server can shut down promptly.

    Args:
        watcher: What to poll.
        interval_s: Seconds between polls.
        stopping: Set (from any thread) when the server stops.

    Yields:
        ``sweep``, ``trials``, ``sweeps`` and ``error`` events (JSON data).
    """
    retry: int | None = RETRY_MS
    while not stopping.is_set():
        try:
            changes = await anyio.to_thread.run_sync(watcher.poll)
        except NotFoundError as err:
            yield ServerSentEvent(event="error", data={"detail": str(err)}, retry=retry)
            return
        except (SweepmasterError, sqlalchemy.exc.DBAPIError) as err:
            message = first_line(err) if isinstance(err, sqlalchemy.exc.DBAPIError) else str(err)
            changes = [("error", {"detail": f"cannot read the database: {message}"})]
        for name, payload in changes:
            data = payload.model_dump(mode="json") if hasattr(payload, "model_dump") else payload
            yield ServerSentEvent(event=name, data=data, retry=retry)
            retry = None
        if retry is not None:  # nothing to say on the first poll: still open the stream
            yield ServerSentEvent(comment="connected", retry=retry)
            retry = None
        with anyio.move_on_after(interval_s):
            while not stopping.is_set():
                await anyio.sleep(min(0.1, interval_s))
