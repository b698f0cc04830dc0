"""Read-only access to a sweep database, in the shapes the API returns.

:class:`DashboardReader` owns one engine whose connections cannot write (SQLite
``PRAGMA query_only``, a read-only PostgreSQL session) and turns the records of
:mod:`sweepmaster.dashboard.queries` into the response models of
:mod:`sweepmaster.dashboard.schemas`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import inspect
from sqlalchemy.engine import Engine

import sweepmaster.dashboard.queries as q
from sweepmaster.dashboard.errors import NotFoundError
from sweepmaster.dashboard.schemas import (
    BestTrial,
    Curve,
    DeviceLane,
    FusionGroup,
    FusionGroups,
    FusionMemberSpan,
    IntermediateValue,
    MemoryPoint,
    SortOrder,
    StateCounts,
    SweepDetail,
    SweepList,
    SweepSummary,
    TaskSpan,
    Timeline,
    TrialDetail,
    TrialPage,
    TrialSummary,
    WorkerList,
    WorkerSummary,
)
from sweepmaster.runtime.events import TASK_STATISTICS
from sweepmaster.store.engine import create_read_only_engine, masked_text
from sweepmaster.store.models import Worker
from sweepmaster.store.workers import list_workers

__all__ = ["DashboardReader", "PageRequest", "finite", "read_only_engine", "trial_summary"]

_SUMMED = tuple(stat for stat in TASK_STATISTICS if stat.aggregate == "sum")
"""The task statistics a timeline shows per task and adds up per device (swap, p2p bytes)."""

_TIMELINE_MISSING = (
    "no shard tasks recorded: the executor writes them to sm_task_events "
    "(sweepmaster.store.models.TaskEvent)"
)


@dataclasses.dataclass(frozen=True)
class PageRequest:
    """Which page of a sweep's trial table to read.

    Attributes:
        states: Only trials in these Optuna states; all when empty.
        sort: A sort key of :data:`~sweepmaster.dashboard.queries.SORT_KEYS`, or
            ``param:<name>``.
        order: Ascending or descending.
        offset: Rows to skip.
        limit: Most rows to return.
    """

    states: list[str] = dataclasses.field(default_factory=list)
    sort: str = "number"
    order: SortOrder = SortOrder.asc
    offset: int = 0
    limit: int = 50


def finite(value: float | None) -> float | None:
    """Return ``value``, or ``None`` when it is missing, NaN or infinite (JSON has neither)."""
    return value if value is not None and math.isfinite(value) else None


def read_only_engine(storage: str) -> Engine:
    """Create an engine on ``storage`` whose connections refuse to write.

    Args:
        storage: A SQLAlchemy URL (SQLite or PostgreSQL).

    Returns:
        The engine (:func:`~sweepmaster.store.engine.create_read_only_engine`): nothing is
        created, migrated or changed, a SQLite file keeps its journal mode.

    Raises:
        StorageError: The database is missing or unreachable.
    """
    return create_read_only_engine(storage)


def _eta_s(record: q.TrialRecord, now: datetime) -> float | None:
    """Seconds a running trial still needs, at its average pace so far."""
    started, updated = record.progress_started_at, record.progress_updated_at
    if record.state != "RUNNING" or started is None or updated is None or record.step <= 0:
        return None
    pace_s = (updated - started).total_seconds() / record.step
    left_s = pace_s * max(record.total_steps - record.step, 0)
    return max(left_s - (now - updated).total_seconds(), 0.0)


def trial_summary(record: q.TrialRecord, now: datetime | None = None,
                  links: q.TrialLinks | None = None) -> TrialSummary:
    """Turn a trial record into a table row (duration and ETA as of ``now``).

    ``links``: the devices and retries of the trial, where read (:func:`q.trial_links`).
    """
    now = now or datetime.now(timezone.utc)
    start, end = record.datetime_start, record.datetime_complete
    duration = None
    if start is not None:
        duration = max(((end or now) - start).total_seconds(), 0.0)
    used = links.devices.get(record.number, ()) if links else ()
    return TrialSummary(
        number=record.number,
        state=record.state,  # type: ignore[arg-type]
        params={k: (finite(v) if isinstance(v, float) else v) for k, v in record.params.items()},
        step=record.step,
        total_steps=record.total_steps,
        tokens_per_s=finite(record.tokens_per_s),
        train_loss=finite(record.train_loss),
        eval_loss=finite(record.eval_loss),
        objective=finite(record.objective),
        device=record.device,
        devices=list(used) or ([record.device] if record.device else []),
        started_at=start,
        completed_at=end,
        duration_s=duration,
        eta_s=_eta_s(record, now),
        failure_reason=record.failure_reason,
        retried_by=links.retried_by.get(record.number) if links else None,
    )


def _metric(config_text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The parsed configuration and its ``study.metric``; ``None`` where it does not parse."""
    try:
        config = yaml.safe_load(config_text)
    except yaml.YAMLError:
        return None, None
    if not isinstance(config, dict):
        return None, None
    study = config.get("study")
    metric = study.get("metric") if isinstance(study, dict) else None
    return config, metric if isinstance(metric, str) else None


def _summary(overview: q.SweepOverview) -> SweepSummary:
    info = overview.info
    counts = {s: n for s, n in overview.counts.items() if s in StateCounts.model_fields}
    return SweepSummary(
        name=info.name,
        study_name=info.study_name,
        status=info.status,
        direction=overview.directions[0] if overview.directions else None,
        metric=_metric(info.config_text)[1],
        created_at=info.created_at,
        updated_at=info.updated_at,
        counts=StateCounts(**counts, total=sum(overview.counts.values())),
        best_number=overview.best_number,
        best_value=finite(overview.best_value),
    )


class DashboardReader:
    """The dashboard's read-only view of one storage URL.

    Thread safety: every method may be called from any thread (each opens its own connection
    from the engine's pool).

    Args:
        storage: A SQLAlchemy URL of a sweep database.

    Raises:
        StorageError: The database is unreachable.
    """

    def __init__(self, storage: str) -> None:
        self.storage = storage
        self.engine = read_only_engine(storage)

    def close(self) -> None:
        """Close the engine's pooled connections."""
        self.engine.dispose()

    def sweeps(self) -> SweepList:
        """Every sweep with its state counts and best value, oldest first."""
        return SweepList(sweeps=[_summary(o) for o in q.list_sweep_overviews(self.engine)])

    def overview(self, name: str) -> q.SweepOverview:
        """One sweep's overview.

        Raises:
            NotFoundError: There is no sweep ``name``.
        """
        overview = q.sweep_overview(self.engine, name)
        if overview is None:
            raise NotFoundError(f"no sweep named {name!r}")
        return overview

    def summary(self, overview: q.SweepOverview) -> SweepSummary:
        """The sweeps-page view of an overview."""
        return _summary(overview)

    def trial_page(self, overview: q.SweepOverview, page: PageRequest) -> TrialPage:
        """One page of the sweep's trial table (see :func:`~q.trial_page`).

        Raises:
            ValueError: ``page.sort`` is not a sort key.
        """
        total, records = 0, list[q.TrialRecord]()
        if overview.study_id is not None:
            total, records = q.trial_page(
                self.engine,
                overview.info.id,
                overview.study_id,
                states=page.states,
                sort=page.sort,
                descending=page.order == SortOrder.desc,
                offset=page.offset,
                limit=page.limit,
            )
        elif page.sort not in q.SORT_KEYS and not page.sort.startswith("param:"):
            raise ValueError(f"unknown sort key {page.sort!r}")
        now = datetime.now(timezone.utc)
        links = self._links(overview, [r.number for r in records])
        return TrialPage(
            total=total,
            offset=page.offset,
            limit=page.limit,
            sort=page.sort,
            order=page.order,
            states=page.states,  # type: ignore[arg-type]
            trials=[trial_summary(r, now, links) for r in records],
        )

    def _links(self, overview: q.SweepOverview, numbers: list[int]) -> q.TrialLinks | None:
        if overview.study_id is None or not numbers:
            return None
        return q.trial_links(self.engine, overview.info.id, overview.study_id, numbers)

    def trial_rows(self, overview: q.SweepOverview, numbers: list[int]) -> list[TrialSummary]:
        """Table rows of the given trials (unknown numbers left out)."""
        if overview.study_id is None:
            return []
        now = datetime.now(timezone.utc)
        records = q.trial_records(self.engine, overview.info.id, overview.study_id, numbers)
        links = self._links(overview, [r.number for r in records])
        return [trial_summary(r, now, links) for r in records]

    def best(self, overview: q.SweepOverview) -> BestTrial | None:
        """The best COMPLETE trial so far, if any."""
        if overview.best_number is None:
            return None
        rows = self.trial_rows(overview, [overview.best_number])
        params = rows[0].params if rows else {}
        return BestTrial(
            number=overview.best_number, objective=finite(overview.best_value), params=params
        )

    def sweep_detail(self, overview: q.SweepOverview, page: PageRequest) -> SweepDetail:
        """One sweep with a page of its trials.

        Raises:
            ValueError: ``page.sort`` is not a sort key.
        """
        config_text = masked_text(overview.info.config_text)  # a database not migrated yet
        config, _ = _metric(config_text)
        return SweepDetail(
            sweep=_summary(overview),
            config_text=config_text,
            config=json.loads(json.dumps(config, default=str)) if config is not None else None,
            param_names=list(overview.param_names),
            best=self.best(overview),
            page=self.trial_page(overview, page),
        )

    def trial_detail(self, name: str, number: int, max_points: int) -> TrialDetail:
        """One trial with its curves.

        Raises:
            NotFoundError: There is no sweep ``name`` or it has no trial ``number``.
        """
        overview = self.overview(name)
        record = None
        if overview.study_id is not None:
            record = q.trial_detail(
                self.engine, overview.info.id, overview.study_id, number, max_points
            )
        if record is None:
            raise NotFoundError(f"sweep {name!r} has no trial {number}")
        trial = record.trial
        checkpoint = trial.checkpoint_path or record.user_attrs.get("checkpoint_path")
        return TrialDetail(
            sweep=name,
            trial=trial_summary(trial, links=self._links(overview, [trial.number])),
            distributions=record.distributions,
            intermediate_values=[
                IntermediateValue(step=s, value=finite(v)) for s, v in record.intermediate_values
            ],
            curves=[
                Curve(
                    name=c.name,
                    steps=c.steps,
                    values=[finite(v) for v in c.values],
                    num_points=c.num_points,
                )
                for c in record.curves
            ],
            checkpoint_path=None if checkpoint is None else str(checkpoint),
            checkpoint_missing=checkpoint is not None and not Path(str(checkpoint)).is_dir(),
            failure_reason=trial.failure_reason or record.fail_reason,
            user_attrs=json.loads(json.dumps(record.user_attrs, default=str)),
        )

    def timeline(self, name: str, limit: int) -> Timeline:
        """Shard tasks per device (empty until the executor records them).

        Raises:
            NotFoundError: There is no sweep ``name``.
        """
        overview = self.overview(name)
        found = q.task_events(self.engine, overview.info.id, limit)
        if found is None:
            return Timeline(
                sweep=name, available=False, message=_TIMELINE_MISSING, t0=None,
                truncated=False, devices=[],
            )
        events, truncated = found
        t0 = min((e.start_s for e in events), default=None)
        lanes: dict[str, list[q.TaskEvent]] = {}
        for e in events:
            lanes.setdefault(e.device, []).append(e)
        devices = []
        for device in sorted(lanes):
            tasks = lanes[device]
            assert t0 is not None
            devices.append(
                DeviceLane(
                    device=device,
                    tasks=[
                        TaskSpan(
                            job=e.job, trial_number=e.trial_number, shard=e.shard, kind=e.kind,
                            start_s=e.start_s - t0, end_s=e.end_s - t0,
                            **{s.column_name: getattr(e, s.name) for s in _SUMMED},
                        )
                        for e in tasks
                    ],
                    busy_s=sum(max(e.end_s - e.start_s, 0.0) for e in tasks),
                    memory=[
                        MemoryPoint(t_s=e.end_s - t0, bytes=e.peak_bytes)
                        for e in sorted(tasks, key=lambda e: e.end_s)
                        if e.peak_bytes is not None
                    ],
                    **{s.name: sum(getattr(e, s.name) for e in tasks) for s in _SUMMED},
                )
            )
        message = None if events else "no shard tasks recorded for this sweep yet"
        return Timeline(
            sweep=name, available=True, message=message, t0=t0, truncated=truncated,
            devices=devices,
        )

    def fusion(self, name: str) -> FusionGroups:
        """The sweep's fused arrays (empty until the executor records them).

        Raises:
            NotFoundError: There is no sweep ``name``.
        """
        overview = self.overview(name)
        members = q.fusion_members(self.engine, overview.info.id)
        keys: dict[str, str] = {}
        spans: dict[str, list[FusionMemberSpan]] = {}
        for m in members or []:
            keys.setdefault(m.job, m.architecture_key)
            spans.setdefault(m.job, []).append(FusionMemberSpan(
                trial_number=m.trial_number, joined_step=m.joined_step, left_step=m.left_step))
        groups = [
            FusionGroup(job=job, architecture_key=keys[job],
                        trial_numbers=sorted(s.trial_number for s in spans[job]),
                        members=spans[job])
            for job in spans
        ]
        return FusionGroups(sweep=name, available=members is not None, groups=groups)

    def workers(self, name: str) -> WorkerList:
        """The sweep's workers with their heartbeats (a stale ``running`` one reads ``lost``).

        Raises:
            NotFoundError: There is no sweep ``name``.
        """
        overview = self.overview(name)
        with self.engine.connect() as connection:
            available = inspect(connection).has_table(Worker.__tablename__)
        rows = list_workers(self.engine, overview.info.id) if available else []
        return WorkerList(sweep=name, available=available,
                          workers=[WorkerSummary(**dataclasses.asdict(w)) for w in rows])
