"""A sweep's results: Optuna's trials joined with sweepmaster's progress rows.

What ``sweepmaster status`` and the end of ``sweepmaster launch`` print, read from the database
at any time (also while the sweep runs in another process).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.trial import TrialState
from sqlalchemy.engine import Engine

from sweepmaster.errors import StorageError
from sweepmaster.runtime.events import TRIAL_STATISTICS, TrialStatistics
from sweepmaster.store import get_sweep, list_sweeps, trial_progress
from sweepmaster.store.engine import create_read_only_engine, masked_text
from sweepmaster.store.models import Sweep
from sweepmaster.store.optuna_tables import read_only_storage
from sweepmaster.store.trial_links import TrialLinks, trial_links
from sweepmaster.study import FAIL_REASON_ATTR

__all__ = ["SweepResults", "TrialRow", "UnfinishedCell", "load_results", "sweep_names"]


@dataclass(frozen=True)
class TrialRow(TrialStatistics):
    """One trial of a sweep, as the results table shows it.

    With the trial's statistics (:class:`~sweepmaster.runtime.events.TrialStatistics`:
    ``swap_bytes``, ``num_shards``, ...; zero or ``None`` when not recorded), keyword arguments.

    Attributes:
        number: Optuna's trial number.
        state: ``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING`` or ``WAITING``.
        params: Sampled parameters by dotted path.
        objective: Optuna's value (COMPLETE trials), else ``None``.
        eval_loss: Last validation loss (nats per token), or ``None``.
        step: Optimizer steps done.
        total_steps: Optimizer steps planned.
        tokens_per_s: Last training throughput in tokens per second.
        device: Where it trained (its progress row: the device it started on).
        devices: Every device that ran one of its tasks (or those of its fused array), sorted;
            ``(device,)`` where no task was recorded, empty when it never started.
        retried_by: The trial that runs it again after it was interrupted, or ``None``.
        duration_s: Wall-clock seconds from start to end (or to now while running).
        reason: Failure reason of a FAIL trial.
        checkpoint_path: Saved final weights, if kept and still on disk here.
        missing_checkpoint: The recorded folder of its saved weights where it is no longer
            on disk here (deleted or moved), else ``None``.
    """

    number: int
    state: str
    params: dict[str, Any] = field(default_factory=dict)
    objective: float | None = None
    eval_loss: float | None = None
    step: int = 0
    total_steps: int = 0
    tokens_per_s: float | None = None
    device: str | None = None
    devices: tuple[str, ...] = ()
    retried_by: int | None = None
    duration_s: float | None = None
    reason: str | None = None
    checkpoint_path: str | None = None
    missing_checkpoint: str | None = None

    @property
    def spilled(self) -> bool:
        """Whether it trained by spilling (more than one shard, or bytes swapped)."""
        return (self.num_shards or 0) > 1 or self.swap_bytes > 0

    @property
    def eval_perplexity(self) -> float | None:
        """``exp(eval_loss)``, or ``None``."""
        return None if self.eval_loss is None else math.exp(min(self.eval_loss, 700.0))


@dataclass(frozen=True)
class UnfinishedCell:
    """A grid cell no trial finished (COMPLETE or PRUNED) and none trains or waits to.

    Attributes:
        params: The cell's parameters by dotted path.
        num_failed: Its failed trials (an abandoned cell: its retries ran out).
        reason: Why its last trial failed, or ``None`` when it never ran.
    """

    params: dict[str, Any]
    num_failed: int
    reason: str | None


@dataclass(frozen=True)
class SweepResults:
    """A sweep's trials, best first (by the study's direction), unfinished last.

    ``unfinished`` lists the grid cells that no trial finished, for a grid sweep that ended
    ``failed`` or ``incomplete`` (empty otherwise).
    """

    name: str
    status: str
    direction: str
    metric: str
    trials: list[TrialRow]
    unfinished: list[UnfinishedCell] = field(default_factory=list)

    def count(self, state: str) -> int:
        """Number of trials in ``state``."""
        return sum(t.state == state for t in self.trials)

    @property
    def any_spilled(self) -> bool:
        """Whether any trial of the sweep spilled (``status`` shows swap columns only then)."""
        return any(t.spilled for t in self.trials)


def _open(storage: str) -> Engine | None:
    """A read-only engine on ``storage``, or ``None`` when it has no sweepmaster tables."""
    engine = create_read_only_engine(storage)
    if not sqlalchemy.inspect(engine).has_table(Sweep.__tablename__):
        engine.dispose()
        return None
    return engine


def sweep_names(storage: str) -> list[str]:
    """Names of the sweeps recorded in ``storage``, oldest first; reads only.

    Raises:
        StorageError: The database is missing or unreachable.
    """
    engine = _open(storage)
    if engine is None:
        return []
    try:
        return [s.name for s in list_sweeps(engine)]
    finally:
        engine.dispose()


def load_results(storage: str, name: str) -> SweepResults:
    """Read one sweep's results; never writes to the database.

    Raises:
        StorageError: The database is missing or unreachable, or has no sweep ``name``.
    """
    engine = _open(storage)
    if engine is None:
        raise StorageError(f"no sweep named {name!r} in {masked_text(storage)} (sweeps there: "
                           "none)")
    try:
        info = get_sweep(engine, name)
        if info is None:
            known = ", ".join(s.name for s in list_sweeps(engine)) or "none"
            raise StorageError(f"no sweep named {name!r} in {masked_text(storage)} (sweeps "
                               f"there: {known})")
        progress = {row.trial_number: row for row in trial_progress(engine, info.id)}
    finally:
        engine.dispose()
    optuna_storage = read_only_storage(storage)
    try:
        study = optuna.load_study(study_name=info.study_name, storage=optuna_storage)
        study_id = optuna_storage.get_study_id_from_name(info.study_name)
        numbers = [t.number for t in study.get_trials(deepcopy=False)]
        links = trial_links(optuna_storage.engine, info.id, study_id, numbers)
        return _results(info, study, progress, links)
    finally:
        optuna_storage.engine.dispose()


def _results(info: Any, study: optuna.Study, progress: dict[int, Any],
             links: TrialLinks) -> SweepResults:
    metric = "eval_loss"
    try:
        import yaml

        metric = yaml.safe_load(info.config_text)["study"]["metric"]
    except Exception:  # an old or foreign config text: keep the default label
        pass
    rows = []
    for t in study.get_trials(deepcopy=False):
        p = progress.get(t.number)
        end = t.datetime_complete
        duration = None
        if t.datetime_start is not None:
            if end is None and t.state == TrialState.RUNNING:
                end = datetime.now()  # Optuna's datetimes are naive local time
            if end is not None:
                duration = (end - t.datetime_start).total_seconds()
        rows.append(TrialRow(
            number=t.number, state=t.state.name, params=dict(t.params),
            objective=t.value if t.state == TrialState.COMPLETE else None,
            eval_loss=p.eval_loss if p else None, step=p.step if p else 0,
            total_steps=p.total_steps if p else 0, tokens_per_s=p.tokens_per_s if p else None,
            device=p.device if p else None,
            devices=links.devices.get(t.number) or ((p.device,) if p and p.device else ()),
            retried_by=links.retried_by.get(t.number), duration_s=duration,
            reason=(p.failure_reason if p and p.failure_reason
                    else t.system_attrs.get(FAIL_REASON_ATTR)),
            checkpoint_path=(p.checkpoint_path if p and p.checkpoint_path
                             and Path(p.checkpoint_path).is_dir() else None),
            missing_checkpoint=(p.checkpoint_path if p and p.checkpoint_path
                                and not Path(p.checkpoint_path).is_dir() else None),
            **({stat.name: getattr(p, stat.name) for stat in TRIAL_STATISTICS} if p else {}),
        ))
    unfinished = (_unfinished_cells(study.get_trials(deepcopy=False), rows)
                  if info.status in ("failed", "incomplete") else [])
    sign = 1.0 if study.direction == optuna.study.StudyDirection.MINIMIZE else -1.0
    rows.sort(key=lambda r: (r.objective is None, sign * (r.objective or 0.0), r.number))
    direction = "minimize" if sign > 0 else "maximize"
    return SweepResults(info.name, info.status, direction, metric, rows, unfinished)


def _unfinished_cells(trials: list[optuna.trial.FrozenTrial],
                      rows: list[TrialRow]) -> list[UnfinishedCell]:
    """The grid cells no trial finished or trains (from Optuna's grid attributes), in order."""
    space = next((t.system_attrs["search_space"] for t in trials
                  if "search_space" in t.system_attrs), None)
    if not isinstance(space, dict):
        return []  # not a grid
    reasons = {r.number: r.reason for r in rows}
    names = sorted(space)
    by_cell: dict[tuple[Any, ...], list[optuna.trial.FrozenTrial]] = {}
    for t in trials:
        params = t.params or t.system_attrs.get("fixed_params") or {}  # a queued retry: fixed
        if all(n in params for n in names):
            by_cell.setdefault(tuple(params[n] for n in names), []).append(t)
    cells = []
    for values in itertools.product(*(space[n] for n in names)):
        ran = by_cell.get(values, [])
        if any(t.state != TrialState.FAIL for t in ran):
            continue  # finished, running or queued
        failed = sorted(ran, key=lambda t: t.number)
        cells.append(UnfinishedCell(dict(zip(names, values, strict=True)), len(failed),
                                    reasons.get(failed[-1].number) if failed else None))
    return cells
