"""How a job's trials fuse in a plan: the fusion degree K and the fused arrays launch forms."""

from __future__ import annotations

import functools

from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.train_specs import widest_member
from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning import fusion_degree
from sweepmaster.runtime.planning.fusion_degree import (
    FusionDegrees,
    FusionMeasurement,
    auto_degrees,
    bounded_degrees,
    measure_fusion,
)
from sweepmaster.runtime.planning.memplan import cached_memory_plan
from sweepmaster.runtime.planning.partition import PlanCache, device_kind, plan_cache_key, plan_job
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.sweep.plan_results import PlannedArray, PlannedFusion
from sweepmaster.workload import TrainSpec

__all__ = ["FusionPlanner", "NotMeasured"]



class NotMeasured(Exception):
    """``auto`` needs a measurement that ``plan`` was not asked to make."""


class FusionPlanner:
    """How a job's trials fuse: :class:`FusionDegrees` as launch uses it; measures if asked."""

    def __init__(self, config: SweepConfig, degrees: FusionDegrees, measure: bool,
                 cache: PlanCache | None) -> None:
        self.config = config
        self.grid = config.study.sampler.type == "grid"
        self.degrees = degrees
        self.measure = measure
        self.cache = cache
        #: Per (plan key, device kind, budget, K): a spilled fused array, planned once.
        self.arrays: dict[tuple[str, str, int, int], PlannedArray] = {}

    def plan(self, spec: TrainSpec, device: Device, plan: JobPlan | None,
             num_configs: int) -> PlannedFusion | None:
        """The job's fusion on ``device`` (``plan``: its plan there; ``None`` on the host).

        Sized like launch sizes it: for the widest trial of the job's group
        (:func:`~sweepmaster.config.train_specs.widest_member`).
        """
        if self.degrees.mode == "off":
            return None
        widest = widest_member(self.config, spec)
        if widest is not spec and plan is not None:
            plan = plan_job(widest, device)
        spec = widest
        if plan is None and FusionDegrees.entry(spec, device) is not None:
            plan = plan_job(spec, device)  # the host: not cached, its budget (free RAM) moves

        def measure(spec: TrainSpec, ks: list[int],
                    budget_bytes: int | None) -> list[FusionMeasurement]:
            if not self.measure:
                raise NotMeasured
            return measure_fusion(spec, device, ks, budget_bytes=budget_bytes)

        try:
            choice = self.degrees.choose(spec, plan, device, plan is not None and plan.spill,
                                         measure, functools.partial(plan_stacked, spec,
                                                                    device=device))
        except NotMeasured:
            assert plan is not None
            ks, _ = bounded_degrees(auto_degrees(plan, device.budget_bytes,
                                                 device.meter is not None),
                                    plan.step_s, spec.total_steps,
                                    fusion_degree.FUSION_MEASURE_SHARE)
            return PlannedFusion(None, "unmeasured", "not measured: launch measures K = "
                                 f"{', '.join(map(str, ks))} on {device.name} "
                                 "(or plan --measure-fusion)")
        sizes: tuple[int, ...] = ()
        if self.grid and choice.k > 1:
            sizes = tuple(min(choice.k, num_configs - start)
                          for start in range(0, num_configs, choice.k))
        arrays: tuple[PlannedArray, ...] = ()
        if choice.stacked_plan is not None:
            ks = sorted({choice.k, *(size for size in sizes if size > 1)}, reverse=True)
            arrays = tuple(self.array(spec, device, k, choice.stacked_plan if k == choice.k
                                      else None) for k in ks)
        return PlannedFusion(choice.k, choice.source, choice.note, sizes, arrays)

    def array(self, spec: TrainSpec, device: Device, k: int,
              stacked: JobPlan | None) -> PlannedArray:
        """A spilled fused array of K members of ``spec`` on ``device``, as launch plans it.

        Its stacked shards (``stacked``, else planned) and their memory plan, read from the
        partition cache or planned (and kept there unless read only); once per plan key,
        device class and K.
        """
        key = plan_cache_key(spec)
        entry = None if key is None else (key, device_kind(device), device.budget_bytes, k)
        if entry is not None and entry in self.arrays:
            return self.arrays[entry]
        if stacked is None:
            stacked = plan_stacked(spec, k, device=device)
        memory = cached_memory_plan(
            self.cache, key, device_kind(device), stacked,
            functools.partial(plan_stacked_memory, spec, k, stacked, device=device),
            num_members=k) if stacked.spill else None
        array = PlannedArray(k, stacked, memory)
        if entry is not None:
            self.arrays[entry] = array
        return array
