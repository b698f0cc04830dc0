"""Re-planning a job that ran out of device memory in its first step, with less memory.

After a failed task, the device's worker (:mod:`~sweepmaster.runtime.execution.device_workers`)
asks :meth:`Replanner.replanned` for a new attempt of the job and restarts it from its spec under
the same name and futures (the executor's module doc, :mod:`~sweepmaster.runtime.executor`, says
when, and why that is exact).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import format_bytes
from sweepmaster.runtime.events import ReplanEvent
from sweepmaster.runtime.execution.fused_jobs import SpilledFusedRun
from sweepmaster.runtime.execution.job_plans import PlanSettings
from sweepmaster.runtime.execution.jobs import ExecutorJob
from sweepmaster.runtime.execution.state import _released
from sweepmaster.runtime.planning.memplan import MemoryPlan, MemoryPlanError
from sweepmaster.runtime.planning.partition import plan_job
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.workload.spec import TrainSpec

__all__ = ["MAX_REPLANS", "Replanner"]

#: Re-plans of a job that runs out of device memory in its first step before the error stands.
MAX_REPLANS = 3
#: A re-plan's budget is the failed attempt's planned peak less what its refused allocation
#: lacked, and at least this fraction of that peak less.
_MIN_SHRINK = 0.125

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Replanner:
    """How an executor re-plans its jobs: its planning settings and its activation planner.

    Args:
        settings: The executor's planning settings: jobs re-plan only where every device is
            metered and ``spill`` is not ``"never"``; new plans are made for its planning
            device and microbatch size, their activations planned with ``plan_activations``
            (else recompute all, Hydra), their steps pipelined over its devices with
            ``pipeline``.
        plan_memory: mu-TWO's plan of a plan's activations for K stacked members
            ``(spec, K, plan)`` on the planning device; raises ``MemoryPlanError`` when none fits.
    """

    settings: PlanSettings
    plan_memory: Callable[[TrainSpec, int, JobPlan], MemoryPlan]

    def replanned(self, job: ExecutorJob, error: BaseException,
                   device: Device) -> tuple[ExecutorJob | None, BaseException]:
        """Re-plan ``job`` with less memory if ``error`` ran it out of memory in its first step.

        Only a job that restarts (:attr:`~sweepmaster.runtime.execution.jobs.ExecutorJob.\
restarts`) whose first step has not ended
        (:attr:`~sweepmaster.runtime.execution.jobs.ExecutorJob.first_step_pending`), where
        jobs may spill (metered devices, ``spill`` not ``"never"``), at most
        :data:`MAX_REPLANS` times. The new plan is made by Harmony's balanced packing
        (:func:`~sweepmaster.runtime.planning.partition.plan_job`) for the failed attempt's
        planned peak (or the budget, or its plain footprint, if smaller) less what the refused
        allocation lacked (:attr:`~sweepmaster.runtime.devices.meter.MemoryMeter.\
shortfall_bytes`), and at least :data:`_MIN_SHRINK` of it less: below a job's plain
        footprint, so a job of one shard spills; below a
        spilled job's peak, so its shards or microbatches shrink; below a fused array's
        estimate, so its K members spill as stacked shards, or smaller ones
        (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`). Its
        activations are planned like any spilled job's (:attr:`plan_memory`, :meth:`~sweepmaster.\
runtime.executor.ShardExecutor.memory_plan`). The job's
        receivers (a fused array's members') hear the
        :class:`~sweepmaster.runtime.events.ReplanEvent` here.

        Called by the device's worker after the failed task, outside the condition.

        Returns:
            The new job (built from the spec, not started) and ``error``; or ``None`` and the
            error the job fails with: ``error`` (logged as a warning when re-planning failed or
            ran out), or what the job's ``on_replan`` raised.
        """
        settings = self.settings
        if (not isinstance(error, torch.OutOfMemoryError) or not job.restarts
                or not job.first_step_pending or settings.spill == "never"
                or not settings.metered):
            return None, error
        if job.num_replans >= MAX_REPLANS:
            _log.warning("job %r ran out of memory on %s in its first step after %d re-plans",
                         job.job_id, device.name, job.num_replans)
            return None, error
        # below plain training's footprint too, so a job of one shard spills
        peak = min(job.planned_peak_bytes, job.plan.budget_bytes, job.plan.plain_bytes)
        shortfall = device.meter.shortfall_bytes if device.meter is not None else 0
        budget = peak - max(shortfall, int(peak * _MIN_SHRINK))
        try:
            if budget <= 0:
                raise ValueError(f"{device.name} lacked {format_bytes(shortfall)}, more than "
                                 f"the planned peak of {format_bytes(peak)}")
            if isinstance(job, SpilledFusedRun):  # K stacked members
                plan = plan_stacked(job.planned_spec, len(job.specs), settings.planning_device,
                                    microbatch_size=settings.microbatch_size,
                                    budget_bytes=budget)
                spec, num_members = job.planned_spec, len(job.specs)
            else:
                plan = plan_job(job.spec, settings.planning_device, budget_bytes=budget,
                                microbatch_size=settings.microbatch_size)
                spec, num_members = job.spec, 1
            plan = settings.placed(plan, spec)
            try:
                memory = (self.plan_memory(spec, num_members, plan)
                          if settings.plan_activations else None)
            except MemoryPlanError:  # no plan fits: recompute every activation (Hydra)
                memory = None
            replanned = job.replanned(plan, memory, settings.pipeline_devices)
        except Exception as exc:  # a layer too large for the budget, say: the error stands
            _log.warning("job %r ran out of memory on %s in its first step; re-planning it for "
                         "%s failed: %s", job.job_id, device.name,
                         format_bytes(max(budget, 0)), exc)
            return None, error
        replanned.num_replans = job.num_replans + 1
        rows = [shard.microbatch_size for shard in plan.shards]
        event = ReplanEvent(job.job_id, device.name, replanned.num_replans, budget,
                            len(plan.shards), max(rows), min(rows))
        try:
            for receiver in job.receivers:
                receiver.on_replan(event)
        except BaseException as exc:  # the job fails with it
            return None, _released(exc)
        return replanned, error
