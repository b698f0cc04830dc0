"""What a simulation of SHARP is given and what it measures (pure Python, no torch).

The simulator (:func:`~sweepmaster.runtime.scheduling.simulate.simulate`) runs a
:class:`~sweepmaster.runtime.scheduling.scheduler.Policy` over jobs that arrive
(:class:`Arrival`) and leave early (:class:`Removal`), timing tasks and transfers by a
:class:`CostModel`, and returns a :class:`SimResult` with its timeline (:class:`GanttEntry`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.scheduling.pipeline import PipelineDecision

__all__ = ["Arrival", "CostModel", "GanttEntry", "Removal", "SimResult"]


@dataclass(frozen=True)
class CostModel:
    """How long tasks and transfers take in a simulation.

    Attributes:
        bandwidth_bytes_per_s: Host <-> device bandwidth of each device's link, bytes per
            second; ``math.inf`` makes transfers instant (their bytes are still counted).
        prefetch: Overlap transfers with compute (Hydra's double buffering): a device promotes
            the shard of the task its policy's lookahead names while it computes, and writes
            back while it computes the next task. False: promote, compute and write-back run
            one after another. With infinite bandwidth the lookahead is not asked (it reserves
            nothing: scheduling is exactly the policy's choice at each free device).
        compute_s: Actual compute seconds of a task; None uses its ``est_seconds`` times
            ``speed``.
        speed: Measured / estimated seconds of the devices' tasks (what the policies'
            correction learns), measured before the run, e.g. from a short real run's records
            (:func:`~sweepmaster.runtime.scheduling.durations.recorded_durations`); CPU virtual
            devices take 2-8x their FLOP estimates (``docs/benchmarks.md``). Unused with
            ``compute_s``; a pipelined step keeps its shape's seconds.
        p2p_bytes_per_s: Device -> device bandwidth of a pipelined step's boundary copies,
            bytes per second; None: devices have no p2p path and those copies go through the
            host (device -> host, then host -> device, counted in the swap volume).
    """

    bandwidth_bytes_per_s: float = 16e9
    prefetch: bool = True
    compute_s: Callable[[TaskSpec], float] | None = None
    p2p_bytes_per_s: float | None = None
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.speed < math.inf:
            raise ValueError(f"speed must be positive and finite, got {self.speed}")

    def task_s(self, task: TaskSpec) -> float:
        """Compute seconds of ``task`` under this model."""
        if self.compute_s is not None:
            return self.compute_s(task)
        return task.est_seconds * self.speed


@dataclass(frozen=True)
class Arrival:
    """A job that arrives at ``time_s`` seconds into the simulation."""

    time_s: float
    job: JobSpec


@dataclass(frozen=True)
class Removal:
    """A job removed (pruned, failed) at ``time_s`` seconds; its running task still ends."""

    time_s: float
    job_id: str


class GanttEntry(NamedTuple):
    """One bar of the timeline: a task's compute, or a transfer for it.

    ``kind`` is the task kind for compute bars, or ``"promote"``, ``"prefetch"``, ``"demote"``.
    Times are seconds from the start of the simulation.
    """

    device: int
    job_id: str
    task_index: int
    start_s: float
    end_s: float
    kind: str


@dataclass(frozen=True)
class SimResult:
    """What a simulation measured.

    Attributes:
        makespan_s: Seconds until the last task's compute and write-back ended.
        busy_s: Compute seconds of each device.
        utilization: ``busy_s / makespan_s`` of each device.
        swap_bytes: Bytes moved between host and devices (promotes, prefetches, demotes).
        promote_bytes: Bytes copied host -> device (prefetches included).
        demote_bytes: Bytes copied device -> host.
        device_promote_bytes: ``promote_bytes`` of each device.
        device_demote_bytes: ``demote_bytes`` of each device.
        num_promotes: Host -> device shard copies (prefetches included).
        num_prefetch_hits: Tasks whose shard a prefetch had brought in.
        completion_s: Completion time in seconds of each job that finished.
        gantt: Compute bars in start order (a pipelined step: one ``"pipeline"`` bar per device
            over the whole step, its load included; ``busy_s`` counts only its packs' compute).
        transfers: Transfer bars in issue order.
        p2p_bytes: Bytes copied device -> device (pipelined steps with p2p); not in
            ``swap_bytes``.
        num_pipelined_steps: Steps run pipelined over several devices.
        pipelined_steps: Per job, its pipelined steps' decisions in order.
    """

    makespan_s: float
    busy_s: tuple[float, ...]
    utilization: tuple[float, ...]
    swap_bytes: int
    promote_bytes: int
    demote_bytes: int
    device_promote_bytes: tuple[int, ...]
    device_demote_bytes: tuple[int, ...]
    num_promotes: int
    num_prefetch_hits: int
    completion_s: dict[str, float]
    gantt: tuple[GanttEntry, ...]
    transfers: tuple[GanttEntry, ...]
    p2p_bytes: int = 0
    num_pipelined_steps: int = 0
    pipelined_steps: dict[str, tuple[PipelineDecision, ...]] = field(default_factory=dict)
