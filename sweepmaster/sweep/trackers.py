"""Experiment trackers: every trial of a sweep as a run in TensorBoard, MLflow or W&B.

``output.report_to: [tensorboard, mlflow, wandb]`` (HuggingFace Trainer's name for it) opens
one run per trial in each tracker, through the tracker's own library, named
``<sweep>-trial-<number>``, with the trial's parameters (sampled and constant), every metric
by optimizer step (``train_loss``, ``lr``, ``tokens_per_s`` each step; ``eval_loss``,
``eval_perplexity`` each evaluation: the names of sweepmaster's own ``sm_metrics``), and the
final ``objective``. :class:`TrialTrackers` receives what the sweep's observer receives
(:class:`~sweepmaster.sweep.run.SweepObserver`), so trials trained alone, in fused arrays, or by
``sweepmaster worker`` all report the same.

Where runs go is each library's own setting:

* ``tensorboard`` (``torch.utils.tensorboard.SummaryWriter``): event files under
  ``<output.dir>/<sweep>/tensorboard/<run name>/``; ``tensorboard --logdir`` on that folder.
* ``mlflow`` (``mlflow.MlflowClient``): the tracking server of ``MLFLOW_TRACKING_URI``
  (mlflow's default otherwise), experiment ``MLFLOW_EXPERIMENT_NAME`` or the sweep's name.
  Metrics are sent in batches (:data:`MLFLOW_FLUSH_S`), not a request per step.
* ``wandb`` (``wandb.init``, one run object per trial): project ``WANDB_PROJECT`` or the
  sweep's name, group the sweep's name, files under ``<output.dir>/<sweep>/``; ``WANDB_MODE``
  (``offline``) and ``WANDB_API_KEY`` as wandb reads them.

A tracker whose library is not installed is refused before a launch
(:func:`~sweepmaster.config.file_checks.missing_library`); a tracker that fails while a sweep
runs (a server that went away) is reported once through the sweep's messages and the trial
trains on without it.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sweepmaster.config.file_checks import TRACKER_LIBRARIES

__all__ = ["MLFLOW_FLUSH_S", "TRACKERS", "RunInfo", "Tracker", "TrackerRun", "TrialTrackers"]

#: Most seconds MLflow metrics wait in memory before they are sent (also sent at each
#: evaluation and at the end of the trial).
MLFLOW_FLUSH_S = 5.0

#: How an ended trial's state is told to MLflow.
_MLFLOW_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


@dataclass(frozen=True)
class RunInfo:
    """What a tracker run of one trial is named and given.

    Attributes:
        sweep: The sweep's name (MLflow experiment, W&B project and group).
        trial_number: Optuna's trial number.
        params: The trial's parameters, dotted path -> value (sampled and constant).
        sweep_dir: The sweep's output directory (``<output.dir>/<sweep>``), for trackers that
            write files.
    """

    sweep: str
    trial_number: int
    params: Mapping[str, Any]
    sweep_dir: Path

    @property
    def name(self) -> str:
        """The run's name: ``<sweep>-trial-<number>``."""
        return f"{self.sweep}-trial-{self.trial_number}"


class TrackerRun(Protocol):
    """One trial's run in one tracker; opened by its class's constructor from a :class:`RunInfo`.

    Calls for one run come from one thread at a time (the trial's); runs of other trials may be
    written concurrently from other threads.
    """

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` (name -> value) at optimizer step ``step``."""

    def finish(self, state: str, objective: float | None, step: int) -> None:
        """End the run: ``state`` is COMPLETE, PRUNED or FAIL; ``objective`` its final value."""


class TensorBoardRun:
    """A trial's TensorBoard event files, through ``torch.utils.tensorboard.SummaryWriter``.

    Scalars by step under the metric names, the parameters and the objective through the HParams
    plugin (``SummaryWriter.add_hparams``' summaries, written into the run's own folder).
    """

    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.params = {name: _hparam_value(value) for name, value in info.params.items()}
        self.writer = SummaryWriter(log_dir=str(info.sweep_dir / "tensorboard" / info.name))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """See :class:`TrackerRun`."""
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def finish(self, state: str, objective: float | None, step: int) -> None:
        """See :class:`TrackerRun`."""
        from torch.utils.tensorboard.summary import hparams

        final = {} if objective is None else {"objective": objective}
        file_writer = self.writer._get_file_writer()  # what add_hparams writes them with
        for summary in hparams(self.params, final):
            file_writer.add_summary(summary)
        if objective is not None:
            self.writer.add_scalar("objective", objective, step)
        self.writer.add_text("state", state, step)
        self.writer.close()


class MlflowRun:
    """A trial's MLflow run, through ``mlflow.MlflowClient`` (thread-safe, no active run)."""

    def __init__(self, info: RunInfo) -> None:
        import os

        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or info.sweep
        self.run_id = self.client.create_run(
            _mlflow_experiment(self.client, experiment), run_name=info.name,
            tags={"sweepmaster.sweep.run": info.sweep,
                  "sweepmaster.trial": str(info.trial_number)}).info.run_id
        params = [Param(name, str(value)) for name, value in info.params.items()]
        for start in range(0, len(params), 100):  # MLflow's most params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.pending: list[Any] = []
        self.last_flush_s = time.monotonic()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """See :class:`TrackerRun`; sent every :data:`MLFLOW_FLUSH_S` s and at evaluations."""
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.pending += [Metric(name, value, now_ms, step) for name, value in metrics.items()]
        if any(name.startswith("eval") for name in metrics) \
                or time.monotonic() - self.last_flush_s >= MLFLOW_FLUSH_S:
            self._flush()

    def finish(self, state: str, objective: float | None, step: int) -> None:
        """See :class:`TrackerRun`."""
        if objective is not None:
            self.log({"objective": objective}, step)
        self._flush()
        self.client.set_terminated(self.run_id, _MLFLOW_STATUS.get(state, "FAILED"))

    def _flush(self) -> None:
        for start in range(0, len(self.pending), 1000):  # MLflow's most metrics per batch
            self.client.log_batch(self.run_id, metrics=self.pending[start:start + 1000])
        self.pending = []
        self.last_flush_s = time.monotonic()


class WandbRun:
    """A trial's W&B run, through ``wandb.init(reinit="create_new")`` (one object per trial)."""

    def __init__(self, info: RunInfo) -> None:
        import os

        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or info.sweep, name=info.name,
            group=info.sweep, config=dict(info.params), dir=str(info.sweep_dir),
            reinit="create_new", settings=wandb.Settings(console="off", silent=True))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """See :class:`TrackerRun`."""
        self.run.log(dict(metrics), step=step)

    def finish(self, state: str, objective: float | None, step: int) -> None:
        """See :class:`TrackerRun`."""
        if objective is not None:
            self.run.summary["objective"] = objective
        self.run.summary["state"] = state
        self.run.finish(exit_code=1 if state == "FAIL" else 0)


@dataclass(frozen=True)
class Tracker:
    """One experiment tracker: the package it needs, and how a trial's run is opened."""

    library: str
    open_run: Callable[[RunInfo], TrackerRun]


#: ``output.report_to`` names -> trackers.
TRACKERS: dict[str, Tracker] = {
    "tensorboard": Tracker(TRACKER_LIBRARIES["tensorboard"], TensorBoardRun),
    "mlflow": Tracker(TRACKER_LIBRARIES["mlflow"], MlflowRun),
    "wandb": Tracker(TRACKER_LIBRARIES["wandb"], WandbRun),
}


class TrialTrackers:
    """The runs of a sweep's trials in the trackers of ``output.report_to``.

    Fed by the sweep's observer; thread-safe: trials train (and report) in the executor's
    worker threads. A tracker that raises is dropped for that trial after one message.

    Args:
        names: Tracker names, keys of :data:`TRACKERS`.
        sweep: The sweep's name.
        sweep_dir: The sweep's output directory.
        constants: Parameters every trial has (``parameters:`` with ``value:``).
        message: Where a tracker's failure is said (the sweep's status messages).
    """

    def __init__(self, names: Sequence[str], sweep: str, sweep_dir: Path,
                 constants: Mapping[str, Any], message: Callable[[str], None]) -> None:
        self.names = list(names)
        self.sweep = sweep
        self.sweep_dir = sweep_dir
        self.constants = dict(constants)
        self.message = message
        self._runs: dict[int, dict[str, TrackerRun]] = {}
        self._steps: dict[int, int] = {}
        self._lock = threading.Lock()  # guards the dicts above; never held while reporting
        self._open_lock = threading.Lock()  # one run opened at a time

    def started(self, number: int, params: Mapping[str, Any]) -> None:
        """Open trial ``number``'s runs (an earlier launch's open ones are ended first)."""
        self.finished(number, "FAIL", None)
        info = RunInfo(self.sweep, number, {**self.constants, **params}, self.sweep_dir)
        runs: dict[str, TrackerRun] = {}
        for name in self.names:
            with self._open_lock:  # libraries set up global state on their first run
                run = self._call(number, name, functools.partial(TRACKERS[name].open_run, info))
            if run is not _FAILED:
                runs[name] = run
        with self._lock:
            self._runs[number] = runs
            self._steps[number] = 0

    def log(self, number: int, metrics: Mapping[str, float], step: int) -> None:
        """Record trial ``number``'s finite ``metrics`` at ``step``."""
        finite = {name: float(v) for name, v in metrics.items() if math.isfinite(v)}
        with self._lock:
            runs = dict(self._runs.get(number, {}))
            self._steps[number] = max(self._steps.get(number, 0), step)
        for name, run in runs.items():
            if finite and self._call(number, name, functools.partial(run.log, finite, step)) \
                    is _FAILED:
                self._drop(number, name)

    def finished(self, number: int, state: str, objective: float | None) -> None:
        """End trial ``number``'s runs (nothing if none are open)."""
        with self._lock:
            runs = self._runs.pop(number, {})
            step = self._steps.pop(number, 0)
        for name, run in runs.items():
            self._call(number, name, functools.partial(run.finish, state, objective, step))

    def close(self) -> None:
        """End every run still open, as FAIL (the launch stopped before its trials ended)."""
        with self._lock:
            numbers = list(self._runs)
        for number in numbers:
            self.finished(number, "FAIL", None)

    def _drop(self, number: int, name: str) -> None:
        with self._lock:
            self._runs.get(number, {}).pop(name, None)

    def _call(self, number: int, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:  # a tracker's server or files: the trial trains on
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.message(f"{name}: trial {number} is no longer reported there "
                         f"({type(exc).__name__}: {detail})")
            return _FAILED


#: What :meth:`TrialTrackers._call` returns when the call raised.
_FAILED: Any = object()


def _hparam_value(value: Any) -> Any:
    """A parameter as TensorBoard's HParams plugin takes it (bool, number or string)."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def _mlflow_experiment(client: Any, name: str) -> str:
    """The id of MLflow experiment ``name``, created if it does not exist yet."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:  # another trial (or worker) created it meanwhile
        return str(client.get_experiment_by_name(name).experiment_id)
