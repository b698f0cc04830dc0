"""Scheduling: SHARP's Sharded-LRTF and baselines, pipelined mode, the simulator, exact makespans.

Names are imported on first use (:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.runtime.scheduling.chains import JobSpec, ShardKey, TaskKind, TaskSpec
    from sweepmaster.runtime.scheduling.durations import TimedTask, recorded_durations
    from sweepmaster.runtime.scheduling.optimal import OptimalSchedule, Placement, optimal_makespan
    from sweepmaster.runtime.scheduling.pipeline import (
        PipelineDecision,
        PipelineShape,
        PipelineStep,
        pipeline_step,
    )
    from sweepmaster.runtime.scheduling.policies import (
        ModelParallel,
        RandomPolicy,
        RoundRobin,
        ShardedLRTF,
        ShortestRemainingFirst,
        TaskParallelFIFO,
        policy_names,
    )
    from sweepmaster.runtime.scheduling.residency import Residency
    from sweepmaster.runtime.scheduling.scheduler import Policy
    from sweepmaster.runtime.scheduling.sim_model import (
        Arrival,
        CostModel,
        GanttEntry,
        Removal,
        SimResult,
    )
    from sweepmaster.runtime.scheduling.simulate import simulate

__getattr__, __dir__, __all__ = lazy_exports(globals())
