"""Events the runtime emits while it trains a job.

The runtime knows nothing of Optuna or the database: it reports through a :class:`TrainCallbacks`
object. ``sweep.py`` wires the callbacks to sweepmaster's tables (batched writes) and to
``trial.report`` / ``trial.should_prune``; the Python API wires them to an Optuna trial only.

Callbacks run on the training thread, between optimizer steps: they must be cheap (buffer, do not
block on I/O per step).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EvalEvent", "ReplanEvent", "StartEvent", "StepEvent", "TaskRecord", "TrainCallbacks"]


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


@dataclass(frozen=True)
class ReplanEvent:
    """A job ran out of device memory before its first step ended and restarts on a smaller plan.

    The executor freed what the job held, planned it for ``budget_bytes`` (less than its failed
    attempt's planned peak) and restarts it from its spec, so it trains exactly as a fresh job of
    the new plan would; the events of the failed attempt (start, step-0 evaluation) are not sent
    again.

    Attributes:
        job: The job's name.
        device: The device that ran out of memory, e.g. ``"cuda:0"``.
        attempt: Re-plans of this job so far (1 for the first).
        budget_bytes: The budget the new plan was made for (bytes).
        num_shards: Shards of the new plan.
        microbatch_size: The largest microbatch (blocks) among its shards.
        smallest_microbatch_size: The smallest microbatch (blocks) among its shards.
    """

    job: str
    device: str
    attempt: int
    budget_bytes: int
    num_shards: int
    microbatch_size: int
    smallest_microbatch_size: int

    @property
    def message(self) -> str:
        """The user's one line.

        E.g. ``"job trial-3 ran out of memory on cuda:0 in its first step; re-planned: 6 shards,
        microbatch 2"`` (``microbatch 1-4`` when its shards run different ones).
        """
        shards = f"{self.num_shards} shard{'s' if self.num_shards != 1 else ''}"
        micro = str(self.microbatch_size)
        if self.smallest_microbatch_size != self.microbatch_size:
            micro = f"{self.smallest_microbatch_size}-{self.microbatch_size}"
        return (f"job {self.job} ran out of memory on {self.device} in its first step; "
                f"re-planned: {shards}, microbatch {micro}")


@dataclass(frozen=True)
class TaskRecord:
    """One shard task a device ran: a bar of the device timeline.

    Attributes:
        device: The device, e.g. ``"cuda:0"`` or ``"cpu:1"``.
        job: The job's name (``TrainSpec.name``).
        shard: The shard (0 for a job, or a fused array, of one shard).
        kind: ``"forward"``, ``"backward"`` (training shard tasks; the last shard's includes its
            forward and loss: a job or fused array of one shard runs one per step), ``"eval"``
            (an evaluation pass of the shard), ``"update"`` (a deferred clipped update),
            ``"measure"`` (a fusion measurement), ``"pipeline"`` (a
            pipelined step, one record per device; ``shard``: the first of its pack) or
            ``"demote"`` (a pipelined job's packs, or a kept shard, written back before another
            task needs the room).
        start_s: Wall-clock start (seconds since the epoch).
        end_s: Wall-clock end (seconds since the epoch).
        swap_bytes: Bytes the task moved between host and device (promote, demote, boundaries).
        peak_bytes: The device's peak live bytes during the task, or ``None`` if unmetered.
        step: Optimizer steps the job had finished when the task began.
        p2p_bytes: Bytes the task copied from this device to another (a pipelined step's
            boundaries and gradients; Harmony's p2p swaps), not part of ``swap_bytes``.
    """

    device: str
    job: str
    shard: int
    kind: str
    start_s: float
    end_s: float
    swap_bytes: int
    peak_bytes: int | None
    step: int
    p2p_bytes: int = 0


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

    def on_replan(self, event: ReplanEvent) -> None:
        """Called when the job ran out of memory in its first step and restarts re-planned."""
