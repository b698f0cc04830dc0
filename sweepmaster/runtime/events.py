"""Events the runtime emits while it trains a job.

The runtime knows nothing of Optuna or the database: it reports through a :class:`TrainCallbacks`
object. ``sweep.py`` wires the callbacks to sweepmaster's tables (batched writes) and to
``trial.report`` / ``trial.should_prune``; the Python API wires them to an Optuna trial only.

Callbacks run on the training thread, between optimizer steps: they must be cheap (buffer, do not
block on I/O per step).

The statistics of a trial (:class:`TrialStatistics`) and of a shard task
(:class:`TaskStatistics`) are declared here once, a dataclass field per statistic with its
:class:`Statistic` row (unit, how it adds up over tasks, label, description). Everything that
stores or shows them derives from :data:`TRIAL_STATISTICS` and :data:`TASK_STATISTICS`: the
database columns (``sm_trial_progress``, ``sm_task_events``), the progress recorder, the results
rows and their JSON/CSV export, the ``status`` table, the live display and the dashboard's
timeline models. Adding a statistic is a field here, an Alembic migration of its column (give
the field its revision in ``added_in``) and tests.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "TASK_STATISTICS",
    "TRIAL_STATISTICS",
    "EvalEvent",
    "ReplanEvent",
    "StartEvent",
    "Statistic",
    "StepEvent",
    "TaskRecord",
    "TaskStatistics",
    "TrainCallbacks",
    "TrialStatistics",
    "statistic",
    "statistics_table",
]

Unit = Literal["bytes", "count"]
"""What a statistic counts: bytes (64-bit columns) or events (32-bit columns)."""

Aggregate = Literal["sum", "max"]
"""How values of several tasks make one: added up, or the largest (a peak)."""


@dataclass(frozen=True)
class Statistic:
    """One row of a statistics table: a per-trial or per-task number and how it is kept and shown.

    Attributes:
        name: Its field in :class:`TrialStatistics` / :class:`TaskStatistics` (and so in every
            record deriving from them: results rows, export keys, dashboard totals).
        unit: ``"bytes"`` (a ``BIGINT`` column, shown as a size) or ``"count"``
            (``INTEGER``, shown with thousands separators).
        aggregate: How the values of several tasks add up to one (a device's total on the
            timeline; a trial's over its tasks): ``"sum"`` or ``"max"``.
        description: One sentence for docstrings, the API schema and the CSV reader.
        label: The header of its column in ``sweepmaster status`` and the live display, or
            ``None`` where it is not shown there.
        priority: Which columns of the status table go first when it is too narrow (higher
            goes first; 0 never).
        spill: Shown in the status table only for a sweep where some trial spilled.
        column: Its database column, where it is not named ``name``.
        added_in: The migration revision that added the column to an existing table (its old
            rows read 0, so readers treat the column as optional); ``None`` when the column
            came with its table.
        nullable: ``None`` means "not measured" (derived from the field's type).
    """

    name: str
    unit: Unit
    aggregate: Aggregate
    description: str
    label: str | None = None
    priority: int = 6
    spill: bool = False
    column: str = ""
    added_in: str | None = None
    nullable: bool = False

    @property
    def column_name(self) -> str:
        """The database column: :attr:`column`, else :attr:`name`."""
        return self.column or self.name

    @property
    def optional(self) -> bool:
        """Whether a reader of an older database may find the column missing or ``NULL``."""
        return self.nullable or self.added_in is not None


def statistic(default: Any = dataclasses.MISSING, **row: Any) -> Any:
    """A statistic's dataclass field: ``row`` holds :class:`Statistic`'s attributes but name."""
    return dataclasses.field(default=default, metadata={"statistic": row})


def statistics_table(cls: type) -> tuple[Statistic, ...]:
    """The :class:`Statistic` rows declared by the fields of dataclass ``cls``, in order."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        nullable = type(None) in typing.get_args(hints[f.name])  # int | None
        rows.append(Statistic(name=f.name, nullable=nullable, **f.metadata["statistic"]))
    return tuple(rows)


@dataclass(frozen=True, kw_only=True)
class TrialStatistics:
    """How one trial used its devices: the per-trial statistics (the table's declaration).

    Attributes:
        num_shards: Shards the job was cut into (1: it fit its device); ``None``: unknown.
        swap_bytes: Bytes moved between host and device while it trained (swap volume).
        p2p_bytes: Bytes copied device -> device (pipelined steps), apart from ``swap_bytes``.
        num_promotes: Shard promotions (host -> device copies of a shard's state).
        num_demotes: Shard demotions (device -> host).
        num_replans: Times it was re-planned with less memory after running out of it.
        peak_device_bytes: Peak device memory in bytes, where measured (else ``None``).
    """

    num_shards: int | None = statistic(
        None, unit="count", aggregate="max", label="shards", priority=3, spill=True,
        added_in="0002",
        description="Shards the job was cut into (1: it fit its device); null when unknown.")
    swap_bytes: int = statistic(
        0, unit="bytes", aggregate="sum", label="swap", priority=3, spill=True, added_in="0002",
        description="Bytes moved between host and device while it trained (swap volume).")
    p2p_bytes: int = statistic(
        0, unit="bytes", aggregate="sum", label="p2p", priority=3, spill=True, added_in="0007",
        description="Bytes copied device -> device (pipelined steps), apart from swap_bytes.")
    num_promotes: int = statistic(
        0, unit="count", aggregate="sum", label="promotes", spill=True, added_in="0002",
        description="Shard promotions (host -> device copies of a shard's state).")
    num_demotes: int = statistic(
        0, unit="count", aggregate="sum", label="demotes", spill=True, added_in="0002",
        description="Shard demotions (device -> host copies).")
    num_replans: int = statistic(
        0, unit="count", aggregate="sum", label="replans", added_in="0007",
        description="Times it was re-planned with less memory after running out of it.")
    peak_device_bytes: int | None = statistic(
        None, unit="bytes", aggregate="max", added_in="0002",
        description="Peak device memory in bytes, where measured; null elsewhere.")


@dataclass(frozen=True, kw_only=True)
class TaskStatistics:
    """What one shard task moved and held: the per-task statistics (the table's declaration).

    Attributes:
        swap_bytes: Bytes the task moved between host and device (promote, demote,
            boundaries); column ``bytes``.
        peak_bytes: The device's peak live bytes during the task, or ``None`` if unmetered;
            column ``memory_bytes``.
        p2p_bytes: Bytes the task copied from this device to another (a pipelined step's
            boundaries and gradients; Harmony's p2p swaps), not part of ``swap_bytes``.
    """

    swap_bytes: int = statistic(
        unit="bytes", aggregate="sum", label="swap", column="bytes",
        description="Bytes moved host<->device by the task (swap volume).")
    peak_bytes: int | None = statistic(
        unit="bytes", aggregate="max", column="memory_bytes",
        description="The device's peak live bytes during the task; null when unmetered.")
    p2p_bytes: int = statistic(
        0, unit="bytes", aggregate="sum", label="p2p", added_in="0007",
        description="Bytes the task copied from its device to another (a pipelined step's "
                    "p2p transfers), apart from the swap volume.")


TRIAL_STATISTICS: tuple[Statistic, ...] = statistics_table(TrialStatistics)
"""The per-trial statistics, in the order the status table and the CSV show them."""

TASK_STATISTICS: tuple[Statistic, ...] = statistics_table(TaskStatistics)
"""The per-task statistics, in the order the timeline shows them."""


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
class TaskRecord(TaskStatistics):
    """One shard task a device ran: a bar of the device timeline.

    Its statistics (``swap_bytes``, ``peak_bytes``, ``p2p_bytes``: :class:`TaskStatistics`)
    are keyword arguments.

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
        step: Optimizer steps the job had finished when the task began.
    """

    device: str
    job: str
    shard: int
    kind: str
    start_s: float
    end_s: float
    step: int


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
