"""Scheduling: SHARP's Sharded-LRTF and baselines, pipelined mode, the simulator, exact makespans.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "OptimalSchedule": "sweepmaster.runtime.scheduling.optimal",
    "Placement": "sweepmaster.runtime.scheduling.optimal",
    "optimal_makespan": "sweepmaster.runtime.scheduling.optimal",
    "PipelineDecision": "sweepmaster.runtime.scheduling.pipeline",
    "PipelineShape": "sweepmaster.runtime.scheduling.pipeline",
    "PipelineStep": "sweepmaster.runtime.scheduling.pipeline",
    "pipeline_step": "sweepmaster.runtime.scheduling.pipeline",
    "JobSpec": "sweepmaster.runtime.scheduling.chains",
    "ModelParallel": "sweepmaster.runtime.scheduling.policies",
    "Policy": "sweepmaster.runtime.scheduling.scheduler",
    "RandomPolicy": "sweepmaster.runtime.scheduling.policies",
    "Residency": "sweepmaster.runtime.scheduling.scheduler",
    "RoundRobin": "sweepmaster.runtime.scheduling.policies",
    "ShardKey": "sweepmaster.runtime.scheduling.chains",
    "ShardedLRTF": "sweepmaster.runtime.scheduling.policies",
    "ShortestRemainingFirst": "sweepmaster.runtime.scheduling.policies",
    "TaskKind": "sweepmaster.runtime.scheduling.chains",
    "TaskParallelFIFO": "sweepmaster.runtime.scheduling.policies",
    "TaskSpec": "sweepmaster.runtime.scheduling.chains",
    "policy_names": "sweepmaster.runtime.scheduling.policies",
    "Arrival": "sweepmaster.runtime.scheduling.simulate",
    "CostModel": "sweepmaster.runtime.scheduling.simulate",
    "GanttEntry": "sweepmaster.runtime.scheduling.simulate",
    "Removal": "sweepmaster.runtime.scheduling.simulate",
    "SimResult": "sweepmaster.runtime.scheduling.simulate",
    "TimedTask": "sweepmaster.runtime.scheduling.simulate",
    "recorded_durations": "sweepmaster.runtime.scheduling.simulate",
    "simulate": "sweepmaster.runtime.scheduling.simulate",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
