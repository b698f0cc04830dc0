"""Execution: the shard executor's jobs, their plans, its device workers and their shared state.

Names are imported on first use (:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.runtime.execution.device_workers import DeviceWorkers, WorkerThreads
    from sweepmaster.runtime.execution.fused_jobs import (
        MeasureJob,
        SpilledFusedRun,
        check_fused_fits,
        fused_name,
    )
    from sweepmaster.runtime.execution.job_plans import PlanSettings
    from sweepmaster.runtime.execution.jobs import ExecutorJob, SpilledRun, TaskSink
    from sweepmaster.runtime.execution.policy_chain import shard_chain
    from sweepmaster.runtime.execution.replan import MAX_REPLANS, Replanner
    from sweepmaster.runtime.execution.state import ExecutorState, JobCancelledError

__getattr__, __dir__, __all__ = lazy_exports(globals())
