"""Launch orchestration: config -> study -> jobs -> executor -> results.

:func:`run_sweep` is what ``sweepmaster launch`` runs: it validates nothing itself (the config is
already a validated :class:`~sweepmaster.config.SweepConfig`), brings the database up to head,
opens the Optuna study, and asks for trials until the sweep is done. Each trial becomes a
:class:`~sweepmaster.workload.spec.TrainSpec` trained by the runtime's executor; progress goes to
sweepmaster's tables (batched) and intermediate values to Optuna (pruning honoured).
"""

from __future__ import annotations

import concurrent.futures
import math
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import Trial, TrialState

from sweepmaster import study as study_manager
from sweepmaster.config import SweepConfig
from sweepmaster.errors import StorageError
from sweepmaster.runtime import Executor, JobCancelledError
from sweepmaster.runtime.events import EvalEvent, StartEvent, StepEvent, TaskRecord, TrainCallbacks
from sweepmaster.store import (
    ProgressRecorder,
    TaskEventRecorder,
    create_store_engine,
    get_or_create_sweep,
    set_sweep_status,
    upgrade_to_head,
)
from sweepmaster.store.engine import masked_url
from sweepmaster.store.partitions import StorePlanCache
from sweepmaster.workload import (
    OptimizerSpec,
    TrainResult,
    TrainSpec,
    build_model,
    find_splits,
    load_tokenizer,
    make_blocks,
    model_config_from_mapping,
    save_weights,
    tokenize_files,
)

__all__ = ["SweepObserver", "SweepOutcome", "TokenData", "max_concurrent_trials", "prepare_data",
           "run_sweep", "train_spec_from_config"]


class SweepObserver:
    """Receives a sweep's progress for display; every method is a no-op (subclass to show it).

    Trials train concurrently: the trial and task methods are called from the executor's worker
    threads, so an observer must be thread-safe and quick.
    """

    def message(self, text: str) -> None:
        """A one-line status message (data preparation, resume information)."""

    def sweep_started(self, name: str, n_trials: int, n_finished: int) -> None:
        """The study is open: ``n_finished`` of ``n_trials`` trials are already done."""

    def trial_started(self, number: int, params: dict[str, Any], total_steps: int,
                      device: str, num_shards: int = 1) -> None:
        """Trial ``number`` starts training on ``device``.

        A trial spilled into ``num_shards > 1`` shards moves between the devices task by task;
        ``device`` is where its first task runs.
        """

    def trial_step(self, number: int, event: StepEvent) -> None:
        """Trial ``number`` finished an optimizer step."""

    def trial_evaluated(self, number: int, event: EvalEvent) -> None:
        """Trial ``number`` finished an evaluation."""

    def trial_finished(self, number: int, state: str, objective: float | None,
                       reason: str | None) -> None:
        """Trial ``number`` ended COMPLETE, PRUNED or FAIL."""

    def task_finished(self, record: TaskRecord) -> None:
        """A device finished a task (called from the executor's worker threads)."""


@dataclass(frozen=True)
class SweepOutcome:
    """What one launch did.

    Attributes:
        name: The sweep (and study) name.
        storage: The storage URL.
        num_run: Trials this launch trained.
        num_finished: COMPLETE + PRUNED trials in the study after this launch.
        num_failed: Trials of this launch that failed.
        best_number: Number of the best COMPLETE trial, or ``None``.
        best_value: Its objective, or ``None``.
    """

    name: str
    storage: str
    num_run: int
    num_finished: int
    num_failed: int
    best_number: int | None
    best_value: float | None


@dataclass(frozen=True)
class TokenData:
    """Tokenized blocks of one data configuration: ``train`` ``(N, T)``, ``valid`` ``(M, T)``."""

    train: torch.Tensor
    valid: torch.Tensor | None
    vocab_size: int


def prepare_data(config: SweepConfig) -> TokenData:
    """Tokenize (or load from the cache) the sweep's train and validation text into blocks.

    Raises:
        DataError: A file or the tokenizer is missing, or the text is shorter than one block.
    """
    data = config.data
    if data.dir is not None:
        splits = find_splits(data.dir)
        train_files, valid_files = [splits["train"]], [splits["valid"]]
    else:
        assert data.train_files is not None
        train_files, valid_files = list(data.train_files), list(data.valid_files or [])
    train_ids = tokenize_files(train_files, data.tokenizer, max_tokens=data.max_train_tokens,
                               cache_dir=data.cache_dir)
    valid = None
    if valid_files:
        valid_ids = tokenize_files(valid_files, data.tokenizer, max_tokens=data.max_eval_tokens,
                                   cache_dir=data.cache_dir)
        valid = make_blocks(valid_ids, data.block_size)
    vocab_size = len(load_tokenizer(data.tokenizer))
    return TokenData(make_blocks(train_ids, data.block_size), valid, vocab_size)


def train_spec_from_config(config: SweepConfig, data: TokenData, name: str = "job",
                           checkpoint_dir: Path | None = None) -> TrainSpec:
    """Turn one trial's resolved config into the runtime's :class:`TrainSpec`."""
    model = config.model
    source: Any
    if model.config is not None:
        source = model_config_from_mapping(model.config, vocab_size=data.vocab_size)
    else:
        assert model.pretrained is not None
        source = model.pretrained
    train = config.train
    optimizer = OptimizerSpec(
        name=train.optimizer, lr=train.lr, weight_decay=train.weight_decay,
        betas=(train.betas[0], train.betas[1]), momentum=train.momentum,
        warmup_steps=train.warmup_steps, schedule=train.schedule, grad_clip=train.grad_clip,
    )
    return TrainSpec(
        model=source, train_data=data.train, eval_data=data.valid, optimizer=optimizer,
        batch_size=train.batch_size, epochs=train.epochs, max_steps=train.max_steps,
        eval_every=train.eval_every, metric=config.study.metric, seed=train.seed,
        dtype=model.dtype, name=name, checkpoint_dir=checkpoint_dir,
    )


class _TrialCallbacks(TrainCallbacks):
    """Wires one trial's runtime events to the store, Optuna and the observer.

    After :meth:`stop` (the trial was marked failed) every event raises
    :class:`~sweepmaster.runtime.JobCancelledError`, so its job ends at its next step and
    writes nothing more.
    """

    def __init__(self, trial: Trial, recorder: ProgressRecorder, observer: SweepObserver,
                 metric: str) -> None:
        self.trial = trial
        self.recorder = recorder
        self.observer = observer
        self.metric = metric
        self.last_train_loss = math.nan
        self.stopped = threading.Event()
        self.num_shards = 1

    def stop(self) -> None:
        """Drop every later event and end the job at its next one."""
        self.stopped.set()

    def _check(self) -> None:
        if self.stopped.is_set():
            raise JobCancelledError(f"trial {self.trial.number} was stopped")

    def on_start(self, event: StartEvent) -> None:
        self._check()
        self.recorder.trial_started(self.trial.number, self.trial._trial_id, event.total_steps,
                                    event.device)
        self.observer.trial_started(self.trial.number, self.trial.params, event.total_steps,
                                    event.device, self.num_shards)

    def on_step(self, event: StepEvent) -> None:
        self._check()
        self.last_train_loss = event.train_loss
        self.recorder.step(self.trial.number, event.step, event.total_steps, event.train_loss,
                           event.tokens_per_s, event.lr)
        self.observer.trial_step(self.trial.number, event)

    def on_eval(self, event: EvalEvent) -> bool:
        self._check()
        self.recorder.evaluated(self.trial.number, event.step, event.eval_loss,
                                event.eval_perplexity)
        self.observer.trial_evaluated(self.trial.number, event)
        value = {"eval_loss": event.eval_loss, "eval_perplexity": event.eval_perplexity,
                 "train_loss": self.last_train_loss}[self.metric]
        if event.step == 0 or not math.isfinite(value):
            return False
        study_manager.report(self.trial, value, event.step)
        return study_manager.should_prune(self.trial)


def _is_better(value: float, best: float | None, direction: str) -> bool:
    if best is None:
        return True
    return value < best if direction == "minimize" else value > best


class _CheckpointKeeper:
    """Saves final weights per ``output.save``: every trial, only the best so far, or none."""

    def __init__(self, config: SweepConfig, study: optuna.Study) -> None:
        self.mode = config.output.save
        self.root = Path(config.output.dir) / config.name
        self.direction = config.study.direction
        self.best: float | None = None
        try:
            self.best = study.best_value
        except ValueError:
            self.best = None

    def save(self, number: int, spec: TrainSpec, result: TrainResult) -> Path | None:
        if self.mode == "none" or not math.isfinite(result.objective):
            return None
        if self.mode == "best" and not _is_better(result.objective, self.best, self.direction):
            return None
        torch.manual_seed(spec.seed)
        model = build_model(spec.model, spec.dtype)
        model.load_state_dict(result.state_dict)
        path = save_weights(model, self.root / f"trial-{number}")
        if self.mode == "best":
            for old in self.root.glob("trial-*"):
                if old != path and old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            self.best = result.objective
        return path


def run_sweep(config: SweepConfig, *, storage: str | None = None, n_trials: int | None = None,
              executor: Executor | None = None,
              observer: SweepObserver | None = None) -> SweepOutcome:
    """Run (or resume) a sweep until it is done, training its trials concurrently.

    Trials are asked from Optuna while the executor has room (:func:`max_concurrent_trials`),
    trained by the executor under Sharded-LRTF (several per device when they spill, Hydra's
    SHARP), and told to Optuna as they end. The executor's shard tasks are recorded as the
    sweep's device timeline.

    Args:
        config: The validated sweep.
        storage: Storage URL overriding ``config.storage``.
        n_trials: Finished trials wanted in total, overriding ``study.n_trials`` (default: the
            grid size for a grid).
        executor: The executor to train on; default one on ``resources.devices``.
        observer: Receives progress for display (from the executor's worker threads too).

    Returns:
        What this launch did.

    Raises:
        SweepmasterError: The storage is unusable or the data are missing.
        KeyboardInterrupt: Ctrl-C; the running trials are marked FAIL (interrupted, they run
            again on relaunch) and the sweep ``interrupted`` before this propagates.
    """
    observer = observer or SweepObserver()
    url = storage or config.storage
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    study = study_manager.open_study(config, url)
    info = get_or_create_sweep(engine, config.name, study.study_name, config.canonical_text())
    if not info.created and info.config_text != config.canonical_text():
        raise StorageError(
            f"sweep {config.name!r} already exists in {masked_url(url)} with a different "
            "configuration; "
            "give the sweep a new name or use another --storage"
        )
    target = n_trials or config.study.n_trials or config.grid_size()
    set_sweep_status(engine, info.id, "running")
    num_requeued = study_manager.requeue_interrupted(study)
    if num_requeued:
        observer.message(f"re-queued {num_requeued} interrupted trial(s)")
    observer.sweep_started(config.name, target, study_manager.count_finished(study))

    own_executor = executor is None
    if executor is None:
        executor = Executor(config.resources.devices,
                            device_memory=config.resources.device_memory,
                            plan_cache=StorePlanCache(engine))
    launch = _Launch(config, study, executor, ProgressRecorder(engine, info.id),
                     TaskEventRecorder(engine, info.id), observer,
                     _CheckpointKeeper(config, study))
    executor.add_task_listener(launch.task_finished)
    try:
        launch.run(target)
    except KeyboardInterrupt:
        launch.interrupt()
        set_sweep_status(engine, info.id, "interrupted")
        raise
    except BaseException:
        launch.interrupt("the sweep stopped")
        set_sweep_status(engine, info.id, "failed")
        raise
    finally:
        executor.remove_task_listener(launch.task_finished)
        launch.flush()
        if own_executor:  # a stopped trial ends at its next step or shard task
            executor.close(cancel=True)
    set_sweep_status(engine, info.id, "completed")
    best_number = best_value = None
    if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        best_number, best_value = study.best_trial.number, study.best_value
    return SweepOutcome(config.name, url, launch.num_run, study_manager.count_finished(study),
                        launch.num_failed, best_number, best_value)


def max_concurrent_trials(executor: Executor, spec: TrainSpec) -> int:
    """How many trials a launch trains at once on ``executor``.

    A trial that fits a device holds it from start to end, so one per device. Trials that spill
    share the devices task by task (SHARP), so two per device: while one job's task runs, another
    job is ready for the next free device.

    Raises:
        LayerTooLargeError: A layer of ``spec`` alone does not fit the devices.
    """
    per_device = 2 if executor.will_spill(spec) else 1
    return per_device * len(executor.devices)


@dataclass
class _RunningTrial:
    trial: Trial
    spec: TrainSpec
    callbacks: _TrialCallbacks


class _Launch:
    """One launch's loop: ask trials while there is room, submit them, tell them as they end."""

    def __init__(self, config: SweepConfig, study: optuna.Study, executor: Executor,
                 recorder: ProgressRecorder, timeline: TaskEventRecorder,
                 observer: SweepObserver, keeper: _CheckpointKeeper) -> None:
        self.config = config
        self.study = study
        self.executor = executor
        self.recorder = recorder
        self.timeline = timeline
        self.observer = observer
        self.keeper = keeper
        self.data_cache: dict[str, TokenData] = {}
        self.running: dict[concurrent.futures.Future[TrainResult], _RunningTrial] = {}
        self.capacity: int | None = None
        self.num_run = 0
        self.num_failed = 0

    def run(self, target: int) -> None:
        """Train trials until the study has ``target`` finished ones (or the grid is done)."""
        while True:
            while self.capacity is None or len(self.running) < self.capacity:
                trial = study_manager.next_trial(self.study, self.config, target,
                                                 num_running=len(self.running))
                if trial is None:
                    break
                self.num_run += 1
                self._start(trial)
            if not self.running:
                return
            done, _ = concurrent.futures.wait(
                self.running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                self._finish(future)

    def _start(self, trial: Trial) -> None:
        """Build the trial's job and submit it; a trial that cannot start fails at once."""
        callbacks = _TrialCallbacks(trial, self.recorder, self.observer, self.config.study.metric)
        try:
            trial_config = self.config.with_params(trial.params)
            data_key = trial_config.data.model_dump_json()
            if data_key not in self.data_cache:
                self.observer.message("tokenizing data (cached after the first time)")
                self.data_cache[data_key] = prepare_data(trial_config)
            spec = train_spec_from_config(trial_config, self.data_cache[data_key],
                                          f"trial-{trial.number}")
            if self.capacity is None:
                self.capacity = max_concurrent_trials(self.executor, spec)
            if self.executor.will_spill(spec):
                callbacks.num_shards = len(self.executor.plan(spec).shards)
            self.timeline.name_job(spec.name, trial.number)
            future = self.executor.submit(spec, callbacks)
        except Exception as exc:  # one trial's failure never ends the sweep
            self._failed(trial, _reason(exc))
            return
        self.running[future] = _RunningTrial(trial, spec, callbacks)

    def _finish(self, future: concurrent.futures.Future[TrainResult]) -> None:
        """Tell Optuna and the store how a trial ended."""
        running = self.running.pop(future)
        trial, config = running.trial, self.config
        try:
            result = future.result()
        except KeyboardInterrupt:  # raised by a callback on a worker thread
            self.running[future] = running
            raise
        except Exception as exc:
            self._failed(trial, _reason(exc))
            return
        stats = _device_stats(result, running.callbacks.num_shards)
        if result.pruned:
            self.recorder.finished(trial.number, "PRUNED", device_stats=stats)
            study_manager.tell(self.study, trial, state=TrialState.PRUNED)
            self.observer.trial_finished(trial.number, "PRUNED", None, None)
            return
        if not math.isfinite(result.objective):
            self._failed(trial, f"objective {config.study.metric} is {result.objective}")
            return
        path = self.keeper.save(trial.number, running.spec, result)
        if path is not None:
            study_manager.set_user_attr(trial, "checkpoint_path", str(path))
        for key, value in config.constants().items():
            study_manager.set_user_attr(trial, key, value)
        self.recorder.finished(trial.number, "COMPLETE", objective=result.objective,
                               checkpoint_path=str(path) if path else None,
                               device_stats=stats)
        study_manager.tell(self.study, trial, result.objective)
        self.observer.trial_finished(trial.number, "COMPLETE", result.objective, None)

    def _failed(self, trial: Trial, reason: str, *, interrupted: bool = False) -> None:
        self.num_failed += not interrupted
        self.recorder.finished(trial.number, "FAIL", failure_reason=reason)
        study_manager.fail_trial(self.study, trial, reason, interrupted=interrupted)
        self.observer.trial_finished(trial.number, "FAIL", None, reason)

    def interrupt(self, why: str = "interrupted (Ctrl-C)") -> None:
        """Stop every running trial and mark it FAIL, to run again on relaunch."""
        for running in self.running.values():
            running.callbacks.stop()
            self.executor.cancel(running.spec.name)
        for running in self.running.values():
            self._failed(running.trial, f"{why}; runs again on relaunch", interrupted=True)
        self.running.clear()

    def task_finished(self, record: TaskRecord) -> None:
        """A device ran a task: into the timeline, and to the display."""
        self.timeline.record(record)
        self.observer.task_finished(record)

    def flush(self) -> None:
        """Write what the recorders still buffer."""
        self.recorder.flush()
        self.timeline.flush()


def _reason(exc: BaseException) -> str:
    """A failed trial's one-line reason."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


def _device_stats(result: TrainResult, num_shards: int) -> dict[str, int | None]:
    """How a trial used its device, for ``sm_trial_progress`` (shards only when it spilled)."""
    return {
        "num_shards": num_shards if result.swap_bytes else None,
        "swap_bytes": result.swap_bytes,
        "num_promotes": result.num_promotes,
        "num_demotes": result.num_demotes,
        "peak_device_bytes": result.peak_device_bytes,
    }
