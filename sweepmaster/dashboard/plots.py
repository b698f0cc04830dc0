"""Optuna's analysis plots as plotly JSON, drawn by ``optuna.visualization`` itself.

The plots are Optuna's (optimization history, parallel coordinate, hyperparameter importance,
intermediate values, timeline), not re-implementations. The study is loaded once per sweep
through Optuna's cached RDB storage, so later requests re-read only unfinished trials; a drawn
figure is reused while the sweep's state counts are unchanged (and, for plots of running
trials, for a few seconds). One figure is drawn at a time: they are CPU-bound.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

import sweepmaster.dashboard.queries as q
from sweepmaster.dashboard.errors import PlotUnavailableError
from sweepmaster.dashboard.schemas import PlotAvailability, PlotFigure, PlotKind
from sweepmaster.store.optuna_tables import read_only_storage

__all__ = ["PlotMaker"]

_LIVE_KINDS = {PlotKind.intermediate_values, PlotKind.timeline}
"""Plots that change while trials run, not only when a trial finishes."""
_LIVE_MAX_AGE_S = 5.0


@dataclass(frozen=True)
class _Cached:
    counts: tuple[tuple[str, int], ...]
    drawn_at_s: float
    figure: PlotFigure


def _complete(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    return [t for t in trials if t.state == TrialState.COMPLETE]


def _check(kind: PlotKind, trials: list[FrozenTrial]) -> None:
    """Raise :class:`PlotUnavailableError` when Optuna would draw nothing (or fail)."""
    num_complete = len(_complete(trials))
    if kind in (PlotKind.history, PlotKind.parallel_coordinate) and num_complete == 0:
        raise PlotUnavailableError(f"{kind.value} needs a COMPLETE trial; there is none yet")
    if kind == PlotKind.importances and num_complete < 2:
        raise PlotUnavailableError(
            f"parameter importances need at least 2 COMPLETE trials; there are {num_complete}"
        )
    if kind == PlotKind.intermediate_values and not any(t.intermediate_values for t in trials):
        raise PlotUnavailableError("no trial has reported an intermediate value yet")
    if kind == PlotKind.timeline and not any(t.datetime_start for t in trials):
        raise PlotUnavailableError("no trial has started yet")


_DRAW: dict[PlotKind, Callable[[optuna.Study], Any]] = {
    PlotKind.history: optuna.visualization.plot_optimization_history,
    PlotKind.parallel_coordinate: optuna.visualization.plot_parallel_coordinate,
    PlotKind.importances: optuna.visualization.plot_param_importances,
    PlotKind.intermediate_values: optuna.visualization.plot_intermediate_values,
    PlotKind.timeline: optuna.visualization.plot_timeline,
}


class PlotMaker:
    """Draws and caches Optuna's plots of the sweeps in one storage.

    Thread safety: :meth:`figure` may be called from any thread; figures are drawn one at a
    time.

    Args:
        storage: The storage URL (the one the dashboard reads).
    """

    def __init__(self, storage: str) -> None:
        self._url = storage
        self._storage: optuna.storages.RDBStorage | None = None
        self._studies: dict[str, optuna.Study] = {}
        self._cache: dict[tuple[str, PlotKind], _Cached] = {}
        self._lock = threading.Lock()

    def _rdb(self) -> optuna.storages.RDBStorage:
        """Optuna's storage on the URL, made read-only once Optuna has checked its schema."""
        if self._storage is None:
            kwargs: dict[str, Any] = {}
            if self._url.startswith("sqlite"):
                kwargs = {"connect_args": {"timeout": 30}}
            else:
                kwargs = {"pool_pre_ping": True}
            # Only ever opened for a sweep whose study exists.
            self._storage = read_only_storage(self._url, **kwargs)
        return self._storage

    def _study(self, study_name: str) -> optuna.Study:
        if study_name not in self._studies:
            self._studies[study_name] = optuna.load_study(
                study_name=study_name, storage=self._rdb()
            )
        return self._studies[study_name]

    def figure(self, overview: q.SweepOverview, kind: PlotKind) -> PlotFigure:
        """Draw (or reuse) one plot of a sweep.

        Args:
            overview: The sweep (its counts decide whether a cached figure is current).
            kind: Which plot.

        Returns:
            The plotly figure.

        Raises:
            PlotUnavailableError: The sweep has no study, or too few trials for this plot, or
                Optuna cannot draw it (e.g. a multi-objective study).
        """
        if overview.study_id is None:
            raise PlotUnavailableError(f"sweep {overview.info.name!r} has no Optuna study")
        counts = tuple(sorted(overview.counts.items()))
        key = (overview.info.name, kind)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached.counts == counts:
                age_s = time.monotonic() - cached.drawn_at_s
                if kind not in _LIVE_KINDS or age_s < _LIVE_MAX_AGE_S:
                    return cached.figure
            study, trials = self._trials(overview)
            _check(kind, trials)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fig = _DRAW[kind](study)
            except (ValueError, RuntimeError) as err:
                raise PlotUnavailableError(f"optuna cannot draw {kind.value}: {err}") from err
            figure = PlotFigure(
                kind=kind, num_trials=len(trials), figure=json.loads(fig.to_json())
            )
            self._cache[key] = _Cached(counts, time.monotonic(), figure)
            return figure

    def availability(self, overview: q.SweepOverview, kind: PlotKind) -> PlotAvailability:
        """Whether :meth:`figure` can draw ``kind`` now, and why not (without drawing it).

        Reads the study's trials and applies the checks :meth:`figure` applies before drawing;
        a plot Optuna itself then fails to draw is still refused by :meth:`figure`.
        """
        try:
            if overview.study_id is None:
                raise PlotUnavailableError(f"sweep {overview.info.name!r} has no Optuna study")
            with self._lock:
                _, trials = self._trials(overview)
            _check(kind, trials)
        except PlotUnavailableError as err:
            return PlotAvailability(kind=kind, available=False, reason=str(err))
        return PlotAvailability(kind=kind, available=True)

    def _trials(self, overview: q.SweepOverview) -> tuple[optuna.Study, list[FrozenTrial]]:
        """The sweep's study and its trials (the study reloaded if it was deleted meanwhile)."""
        try:
            study = self._study(overview.info.study_name)
            return study, study.get_trials(deepcopy=False)
        except KeyError:  # the study was deleted (and maybe recreated) since it was loaded
            self._studies.pop(overview.info.study_name, None)
            study = self._study(overview.info.study_name)
            return study, study.get_trials(deepcopy=False)

    def close(self) -> None:
        """Release Optuna's engine."""
        if self._storage is not None:
            self._storage.engine.dispose()
