"""Events the runtime emits while it trains a job.

The runtime knows nothing of Optuna or the database: it reports through a :class:`TrainCallbacks`
object. ``sweep.py`` wires the callbacks to sweepmaster's tables (batched writes) and to
``trial.report`` / ``trial.should_prune``; the Python API wires them to an Optuna trial only.

Callbacks run on the training thread, between optimizer steps: they must be cheap (buffer, do not
block on I/O per step).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EvalEvent", "StartEvent", "StepEvent", "TrainCallbacks"]


@dataclass(frozen=True)
class StartEvent:
    """A job started training.

    Attributes:
        job: The job's name (``TrainSpec.name``).
        total_steps: Optimizer steps the job will run if not stopped early.
        device: The device it runs on, e.g. ``"cpu"`` or ``"cuda:0"``.
        num_parameters: Trainable parameters of the model.
        resumed_from_step: Steps already done by an earlier, interrupted run whose checkpoint
            this run continues (0 for a fresh start); no step, evaluation or event up to this
            step is repeated.
    """

    job: str
    total_steps: int
    device: str
    num_parameters: int
    resumed_from_step: int = 0


@dataclass(frozen=True)
class StepEvent:
    """One optimizer step finished.

    Attributes:
        job: The job's name.
        step: Optimizer steps done so far (1 after the first step).
        total_steps: Optimizer steps planned.
        epoch: Zero-based epoch the step belongs to.
        train_loss: Mean token cross-entropy (nats) of this step's minibatch.
        lr: Learning rate used for this step.
        tokens_per_s: Training tokens per second over the recent steps (wall clock).
        device: The device it runs on.
    """

    job: str
    step: int
    total_steps: int
    epoch: int
    train_loss: float
    lr: float
    tokens_per_s: float
    device: str


@dataclass(frozen=True)
class EvalEvent:
    """An evaluation on the validation split finished.

    Attributes:
        job: The job's name.
        step: Optimizer steps done when it was taken (0 = before training).
        total_steps: Optimizer steps planned.
        eval_loss: Mean token cross-entropy (nats) over the evaluated blocks.
        eval_perplexity: ``exp(eval_loss)``.
    """

    job: str
    step: int
    total_steps: int
    eval_loss: float
    eval_perplexity: float


class TrainCallbacks:
    """Receives a job's progress; subclass and override what you need (every method is a no-op)."""

    def on_start(self, event: StartEvent) -> None:
        """Called once before the first step (and before the step-0 evaluation, if any)."""

    def on_step(self, event: StepEvent) -> None:
        """Called after every optimizer step."""

    def on_eval(self, event: EvalEvent) -> bool:
        """Called after every evaluation.

        Returns:
            ``True`` to stop the job now (pruning); the runtime then returns a ``TrainResult``
            with ``pruned=True``.
        """
        return False
