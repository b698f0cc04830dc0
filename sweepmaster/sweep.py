"""Launch orchestration: config -> study -> jobs -> executor -> results.

:func:`run_sweep` is what ``sweepmaster launch`` runs: it validates nothing itself (the config is
already a validated :class:`~sweepmaster.config.SweepConfig`), brings the database up to head,
opens the Optuna study, and asks for trials until the sweep is done. Each trial becomes a
:class:`~sweepmaster.workload.spec.TrainSpec` trained by the runtime's executor; progress goes to
sweepmaster's tables (batched) and intermediate values to Optuna (pruning honoured).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import Trial, TrialState

from sweepmaster import study as study_manager
from sweepmaster.config import SweepConfig
from sweepmaster.errors import StorageError
from sweepmaster.runtime import Executor
from sweepmaster.runtime.events import EvalEvent, StartEvent, StepEvent, TrainCallbacks
from sweepmaster.store import (
    ProgressRecorder,
    create_store_engine,
    get_or_create_sweep,
    set_sweep_status,
    upgrade_to_head,
)
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

__all__ = ["SweepObserver", "SweepOutcome", "TokenData", "prepare_data", "run_sweep",
           "train_spec_from_config"]


class SweepObserver:
    """Receives a sweep's progress for display; every method is a no-op (subclass to show it)."""

    def message(self, text: str) -> None:
        """A one-line status message (data preparation, resume information)."""

    def sweep_started(self, name: str, n_trials: int, n_finished: int) -> None:
        """The study is open: ``n_finished`` of ``n_trials`` trials are already done."""

    def trial_started(self, number: int, params: dict[str, Any], total_steps: int,
                      device: str) -> None:
        """Trial ``number`` starts training."""

    def trial_step(self, number: int, event: StepEvent) -> None:
        """Trial ``number`` finished an optimizer step."""

    def trial_evaluated(self, number: int, event: EvalEvent) -> None:
        """Trial ``number`` finished an evaluation."""

    def trial_finished(self, number: int, state: str, objective: float | None,
                       reason: str | None) -> None:
        """Trial ``number`` ended COMPLETE, PRUNED or FAIL."""


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
    """Wires one trial's runtime events to the store, Optuna and the observer."""

    def __init__(self, trial: Trial, recorder: ProgressRecorder, observer: SweepObserver,
                 metric: str) -> None:
        self.trial = trial
        self.recorder = recorder
        self.observer = observer
        self.metric = metric
        self.last_train_loss = math.nan

    def on_start(self, event: StartEvent) -> None:
        self.recorder.trial_started(self.trial.number, self.trial._trial_id, event.total_steps,
                                    event.device)
        self.observer.trial_started(self.trial.number, self.trial.params, event.total_steps,
                                    event.device)

    def on_step(self, event: StepEvent) -> None:
        self.last_train_loss = event.train_loss
        self.recorder.step(self.trial.number, event.step, event.total_steps, event.train_loss,
                           event.tokens_per_s, event.lr)
        self.observer.trial_step(self.trial.number, event)

    def on_eval(self, event: EvalEvent) -> bool:
        self.recorder.evaluated(self.trial.number, event.step, event.eval_loss,
                                event.eval_perplexity)
        self.observer.trial_evaluated(self.trial.number, event)
        value = {"eval_loss": event.eval_loss, "eval_perplexity": event.eval_perplexity,
                 "train_loss": self.last_train_loss}[self.metric]
        if event.step == 0 or not math.isfinite(value):
            return False
        self.trial.report(value, event.step)
        return self.trial.should_prune()


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
    """Run (or resume) a sweep until it is done; trials run one at a time per device.

    Args:
        config: The validated sweep.
        storage: Storage URL overriding ``config.storage``.
        n_trials: Finished trials wanted in total, overriding ``study.n_trials`` (default: the
            grid size for a grid).
        executor: The executor to train on; default one on ``resources.devices``.
        observer: Receives progress for display.

    Returns:
        What this launch did.

    Raises:
        SweepmasterError: The storage is unusable or the data are missing.
        KeyboardInterrupt: Ctrl-C; the running trial is marked FAIL (interrupted, it runs again
            on relaunch) and the sweep ``interrupted`` before this propagates.
    """
    observer = observer or SweepObserver()
    url = storage or config.storage
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    study = study_manager.open_study(config, url)
    info = get_or_create_sweep(engine, config.name, study.study_name, config.canonical_text())
    if not info.created and info.config_text != config.canonical_text():
        raise StorageError(
            f"sweep {config.name!r} already exists in {url} with a different configuration; "
            "give the sweep a new name or use another --storage"
        )
    target = n_trials or config.study.n_trials or config.grid_size()
    set_sweep_status(engine, info.id, "running")
    num_requeued = study_manager.requeue_interrupted(study)
    if num_requeued:
        observer.message(f"re-queued {num_requeued} interrupted trial(s)")
    observer.sweep_started(config.name, target, study_manager.count_finished(study))

    data_cache: dict[str, TokenData] = {}
    recorder = ProgressRecorder(engine, info.id)
    keeper = _CheckpointKeeper(config, study)
    own_executor = executor is None
    executor = executor or Executor(config.resources.devices)
    num_run = num_failed = 0
    try:
        while (trial := study_manager.next_trial(study, config, target)) is not None:
            num_run += 1
            state, objective, reason = _run_trial(
                trial, config, study, executor, recorder, observer, keeper, data_cache)
            num_failed += state == "FAIL"
            observer.trial_finished(trial.number, state, objective, reason)
    except KeyboardInterrupt:
        set_sweep_status(engine, info.id, "interrupted")
        raise
    except BaseException:
        set_sweep_status(engine, info.id, "failed")
        raise
    finally:
        recorder.flush()
        if own_executor:
            executor.close()
    set_sweep_status(engine, info.id, "completed")
    best_number = best_value = None
    if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        best_number, best_value = study.best_trial.number, study.best_value
    return SweepOutcome(config.name, url, num_run, study_manager.count_finished(study),
                        num_failed, best_number, best_value)


def _run_trial(trial: Trial, config: SweepConfig, study: optuna.Study, executor: Executor,
               recorder: ProgressRecorder, observer: SweepObserver, keeper: _CheckpointKeeper,
               data_cache: dict[str, TokenData]) -> tuple[str, float | None, str | None]:
    """Train one trial; tell Optuna and the store how it ended. Returns (state, value, reason)."""
    try:
        trial_config = config.with_params(trial.params)
        data_key = trial_config.data.model_dump_json()
        if data_key not in data_cache:
            observer.message("tokenizing data (cached after the first time)")
            data_cache[data_key] = prepare_data(trial_config)
        spec = train_spec_from_config(trial_config, data_cache[data_key], f"trial-{trial.number}")
        callbacks = _TrialCallbacks(trial, recorder, observer, config.study.metric)
        result = executor.fit(spec, callbacks)
    except KeyboardInterrupt:
        reason = "interrupted (Ctrl-C); runs again on relaunch"
        recorder.finished(trial.number, "FAIL", failure_reason=reason)
        study_manager.fail_trial(study, trial, reason, interrupted=True)
        observer.trial_finished(trial.number, "FAIL", None, reason)
        raise
    except Exception as exc:  # one trial's failure never ends the sweep
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        recorder.finished(trial.number, "FAIL", failure_reason=reason)
        study_manager.fail_trial(study, trial, reason)
        return "FAIL", None, reason
    if result.pruned:
        recorder.finished(trial.number, "PRUNED")
        study.tell(trial, state=TrialState.PRUNED)
        return "PRUNED", None, None
    if not math.isfinite(result.objective):
        reason = f"objective {config.study.metric} is {result.objective}"
        recorder.finished(trial.number, "FAIL", failure_reason=reason)
        study_manager.fail_trial(study, trial, reason)
        return "FAIL", None, reason
    path = keeper.save(trial.number, spec, result)
    if path is not None:
        trial.set_user_attr("checkpoint_path", str(path))
    for key, value in config.constants().items():
        trial.set_user_attr(key, value)
    recorder.finished(trial.number, "COMPLETE", objective=result.objective,
                      checkpoint_path=str(path) if path else None)
    study.tell(trial, result.objective)
    return "COMPLETE", result.objective, None
