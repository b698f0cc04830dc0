"""Scheduling: SHARP's Sharded-LRTF and baselines, pipelined mode, the simulator, exact makespans.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_MODULES = {
    "chains": ("JobSpec", "ShardKey", "TaskKind", "TaskSpec"),
    "durations": ("TimedTask", "recorded_durations"),
    "optimal": ("OptimalSchedule", "Placement", "optimal_makespan"),
    "pipeline": ("PipelineDecision", "PipelineShape", "PipelineStep", "pipeline_step"),
    "policies": (
        "ModelParallel", "RandomPolicy", "RoundRobin", "ShardedLRTF", "ShortestRemainingFirst",
        "TaskParallelFIFO", "policy_names"
    ),
    "residency": ("Residency",),
    "scheduler": ("Policy",),
    "sim_model": ("Arrival", "CostModel", "GanttEntry", "Removal", "SimResult"),
    "simulate": ("simulate",),
}
_EXPORTS = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
