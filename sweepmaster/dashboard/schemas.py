"""Response models of the dashboard's API (the OpenAPI schema is generated from these).

Every number that can be missing or non-finite is ``null`` in JSON: NaN and infinities do not
exist in JSON, and a running trial has no objective yet.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from enum import Enum
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model

from sweepmaster.runtime.events import TASK_STATISTICS

__all__ = [
    "BestTrial",
    "Curve",
    "DashboardInfo",
    "DeviceLane",
    "ErrorResponse",
    "FusionGroup",
    "FusionGroups",
    "IntermediateValue",
    "MemoryPoint",
    "ParamValue",
    "PlotAvailability",
    "PlotFigure",
    "PlotKind",
    "SortOrder",
    "StateCounts",
    "SweepDetail",
    "SweepList",
    "SweepSummary",
    "TaskSpan",
    "Timeline",
    "TrialDetail",
    "TrialPage",
    "TrialState",
    "TrialSummary",
    "TrialsChanged",
    "WorkerList",
    "WorkerSummary",
]

TrialState = Literal["RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL"]
"""Optuna's trial state names."""

ParamValue = float | int | str | bool | None
"""A parameter value as Optuna returns it (a categorical choice may be any of these)."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


_M = TypeVar("_M", bound=_Model)


def _with_task_statistics(per: Literal["task", "lane"]) -> Callable[[type[_M]], type[_M]]:
    """Give a model one ``int`` field per summed statistic of ``TASK_STATISTICS``, after its own.

    ``per="task"``: a task's value, named like its column (``bytes``, ``p2p_bytes``);
    ``per="lane"``: the sum over a lane's tasks, named like the statistic (``swap_bytes``...).
    A statistic a database may lack (``Statistic.optional``) defaults to 0.
    """

    def extend(model: type[_M]) -> type[_M]:
        fields: dict[str, Any] = {}
        for stat in TASK_STATISTICS:
            if stat.aggregate != "sum":
                continue
            name = stat.column_name if per == "task" else stat.name
            text = stat.description if per == "task" else f"Sum of the tasks': {stat.description}"
            fields[name] = (int, Field(0 if stat.optional else ..., description=text))
        return create_model(model.__name__, __base__=model, __module__=model.__module__,
                            __doc__=model.__doc__, **fields)

    return extend


class ErrorResponse(_Model):
    """Body of every error response."""

    detail: str = Field(description="What went wrong, in one line.")


class DashboardInfo(_Model):
    """The dashboard's version and storage."""

    version: str
    storage: str = Field(description="The storage URL, password masked.")
    read_only: bool
    poll_interval_s: float = Field(description="Seconds between polls of a live stream.")


class SortOrder(str, Enum):
    """Direction of a sort."""

    asc = "asc"
    desc = "desc"


class PlotKind(str, Enum):
    """Optuna analysis plots the API renders (``optuna.visualization``)."""

    history = "history"
    parallel_coordinate = "parallel_coordinate"
    importances = "importances"
    intermediate_values = "intermediate_values"
    timeline = "timeline"


class StateCounts(_Model):
    """Number of trials per Optuna state."""

    RUNNING: int = 0
    WAITING: int = 0
    COMPLETE: int = 0
    PRUNED: int = 0
    FAIL: int = 0
    total: int = 0


class SweepSummary(_Model):
    """One sweep as the sweeps page lists it."""

    name: str
    study_name: str
    status: str = Field(description="running, completed, interrupted, failed or incomplete.")
    direction: str | None = Field(description="minimize or maximize; null without a study.")
    metric: str | None = Field(description="The objective metric named in sweep.yaml.")
    created_at: datetime
    updated_at: datetime
    counts: StateCounts
    best_number: int | None = None
    best_value: float | None = None


class SweepList(_Model):
    """Every sweep in the database, oldest first."""

    sweeps: list[SweepSummary]


class TrialSummary(_Model):
    """One row of a sweep's trial table."""

    number: int
    state: TrialState
    params: dict[str, ParamValue]
    step: int = Field(description="Optimizer steps done.")
    total_steps: int = Field(description="Optimizer steps planned (0 before it started).")
    tokens_per_s: float | None
    train_loss: float | None = Field(description="Latest training loss (nats/token).")
    eval_loss: float | None = Field(description="Latest evaluation loss (nats/token).")
    objective: float | None = Field(description="Optuna's value of a COMPLETE trial.")
    device: str | None = Field(description="The device it was started on.")
    devices: list[str] = Field(
        default_factory=list,
        description="Every device it ran on (a spilled or fused trial may use several).")
    started_at: datetime | None
    completed_at: datetime | None
    duration_s: float | None = Field(description="Start to end, or to now while running.")
    eta_s: float | None = Field(description="Estimated seconds to finish a running trial.")
    failure_reason: str | None
    retried_by: int | None = Field(
        default=None, description="The trial that runs this one again after it was interrupted.")


class BestTrial(_Model):
    """The best COMPLETE trial so far."""

    number: int
    objective: float | None
    params: dict[str, ParamValue]


class TrialPage(_Model):
    """One page of a sweep's trial table."""

    total: int = Field(description="Trials that match the state filter.")
    offset: int
    limit: int
    sort: str
    order: SortOrder
    states: list[TrialState]
    trials: list[TrialSummary]


class SweepDetail(_Model):
    """One sweep: its configuration, state counts, best trial and a page of its trials."""

    sweep: SweepSummary
    config_text: str = Field(description="The sweep.yaml the sweep was launched with.")
    config: dict[str, Any] | None = Field(description="config_text parsed, if it parses.")
    param_names: list[str]
    best: BestTrial | None
    page: TrialPage


class Curve(_Model):
    """One recorded metric over optimizer steps."""

    name: str
    steps: list[int]
    values: list[float | None]
    num_points: int = Field(description="Points recorded; more than shown when thinned.")


class IntermediateValue(_Model):
    """A value reported to Optuna (``trial.report``) at a step."""

    step: int
    value: float | None


class TrialDetail(_Model):
    """One trial with everything recorded about it."""

    sweep: str
    trial: TrialSummary
    distributions: dict[str, str] = Field(description="Optuna distribution JSON per param.")
    intermediate_values: list[IntermediateValue]
    curves: list[Curve]
    checkpoint_path: str | None
    checkpoint_missing: bool = Field(
        default=False, description="A checkpoint path is recorded, but no folder is there now "
        "(deleted or moved since the trial saved it).")
    failure_reason: str | None
    user_attrs: dict[str, Any]


class PlotFigure(_Model):
    """A plotly figure made by ``optuna.visualization`` (``fig.to_json()``, parsed)."""

    kind: PlotKind
    num_trials: int = Field(description="Trials of the study when it was drawn.")
    figure: dict[str, Any] = Field(description="Plotly figure: data, layout.")


class PlotAvailability(_Model):
    """Whether an analysis plot can be drawn from the sweep's trials now, and why not."""

    kind: PlotKind
    available: bool
    reason: str | None = Field(
        default=None, description="Why it cannot be drawn yet (what the plot's route answers "
        "with 409); null when it can.")


@_with_task_statistics("task")
class TaskSpan(_Model):
    """One shard task on a device, in seconds from the timeline's ``t0``, with its statistics."""

    job: str
    trial_number: int | None
    shard: int
    kind: str
    start_s: float
    end_s: float


class MemoryPoint(_Model):
    """Device memory in use at a time (seconds from ``t0``)."""

    t_s: float
    bytes: int


@_with_task_statistics("lane")
class DeviceLane(_Model):
    """One device's row of the timeline, with the sums of its tasks' statistics."""

    device: str
    tasks: list[TaskSpan]
    busy_s: float = Field(description="Sum of task durations shown.")
    memory: list[MemoryPoint]


class Timeline(_Model):
    """Shard tasks per device over time (written by the SHARP executor)."""

    sweep: str
    available: bool = Field(description="Whether the executor's task table exists.")
    message: str | None
    t0: float | None = Field(description="UNIX time of the first task shown.")
    truncated: bool = Field(description="Older tasks were left out.")
    devices: list[DeviceLane]


class FusionMemberSpan(_Model):
    """One member trial of a fused array and when it was in it (the array's own steps)."""

    trial_number: int
    joined_step: int = Field(description="Array steps before it joined (0: a founding member; "
                                         "later: it refilled a slot another member left).")
    left_step: int | None = Field(description="Array steps when it left (pruned, finished or "
                                              "failed); null while it trains.")


class FusionGroup(_Model):
    """A fused array: same-architecture trials trained as one job, refilled as members leave."""

    job: str
    architecture_key: str
    trial_numbers: list[int]
    members: list[FusionMemberSpan] = Field(description="Every member, in joining order.")


class FusionGroups(_Model):
    """A sweep's fused arrays."""

    sweep: str
    available: bool = Field(description="Whether the executor's fusion table exists.")
    groups: list[FusionGroup]


class TrialsChanged(_Model):
    """Payload of the ``trials`` live event: rows that changed since the last event."""

    trials: list[TrialSummary]


class WorkerSummary(_Model):
    """One process training the sweep's trials (``launch`` or ``worker``) on some host."""

    id: int
    host: str
    pid: int
    devices: str = Field(description="Its device spec, e.g. cpu or cuda:0,cuda:1.")
    status: Literal["running", "stopped", "lost"] = Field(
        description="lost: no heartbeat for longer than the grace period.")
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_s: float = Field(description="Seconds since its last heartbeat.")
    num_running: int = Field(description="Trials it trains now.")
    num_finished: int = Field(description="Trials it ended COMPLETE or PRUNED.")


class WorkerList(_Model):
    """The workers of a sweep, oldest first."""

    sweep: str
    available: bool = Field(description="Whether the database has the workers table.")
    workers: list[WorkerSummary]
