"""Execution: the shard executor's jobs, their plans, its device workers and their shared state.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "PlanSettings": "sweepmaster.runtime.execution.job_plans",
    "MAX_REPLANS": "sweepmaster.runtime.execution.replan",
    "Replanner": "sweepmaster.runtime.execution.replan",
    "ExecutorState": "sweepmaster.runtime.execution.state",
    "JobCancelledError": "sweepmaster.runtime.execution.state",
    "DeviceWorkers": "sweepmaster.runtime.execution.device_workers",
    "WorkerThreads": "sweepmaster.runtime.execution.device_workers",
    "MeasureJob": "sweepmaster.runtime.execution.fused_jobs",
    "SpilledFusedRun": "sweepmaster.runtime.execution.fused_jobs",
    "check_fused_fits": "sweepmaster.runtime.execution.fused_jobs",
    "fused_name": "sweepmaster.runtime.execution.fused_jobs",
    "ExecutorJob": "sweepmaster.runtime.execution.jobs",
    "SpilledRun": "sweepmaster.runtime.execution.jobs",
    "TaskSink": "sweepmaster.runtime.execution.jobs",
    "shard_chain": "sweepmaster.runtime.execution.policy_chain",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
