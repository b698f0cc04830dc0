"""Execution: the executor, its device workers and their shared state, its jobs and events.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "EvalEvent": "sweepmaster.runtime.execution.events",
    "ReplanEvent": "sweepmaster.runtime.execution.events",
    "StartEvent": "sweepmaster.runtime.execution.events",
    "StepEvent": "sweepmaster.runtime.execution.events",
    "TaskRecord": "sweepmaster.runtime.execution.events",
    "TrainCallbacks": "sweepmaster.runtime.execution.events",
    "Executor": "sweepmaster.runtime.execution.executor",
    "PlanSettings": "sweepmaster.runtime.execution.job_plans",
    "MAX_REPLANS": "sweepmaster.runtime.execution.replan",
    "Replanner": "sweepmaster.runtime.execution.replan",
    "ExecutorState": "sweepmaster.runtime.execution.state",
    "JobCancelledError": "sweepmaster.runtime.execution.state",
    "DeviceWorkers": "sweepmaster.runtime.execution.worker",
    "WorkerThreads": "sweepmaster.runtime.execution.worker",
    "MeasureJob": "sweepmaster.runtime.execution.fused_jobs",
    "SpilledFusedRun": "sweepmaster.runtime.execution.fused_jobs",
    "check_fused_fits": "sweepmaster.runtime.execution.fused_jobs",
    "fused_name": "sweepmaster.runtime.execution.fused_jobs",
    "ExecutorJob": "sweepmaster.runtime.execution.jobs",
    "SpilledRun": "sweepmaster.runtime.execution.jobs",
    "TaskSink": "sweepmaster.runtime.execution.jobs",
    "shard_chain": "sweepmaster.runtime.execution.job_chain",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
