"""Planning: layer profiles, shard partitions, pipeline packs, memory plans, fusion degrees.

Names are imported on first use (:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.runtime.planning.attention import FusedAttention, attention_kernel
    from sweepmaster.runtime.planning.fusion_degree import (
        FUSION_FORMAT_VERSION,
        MAX_AUTO_FUSION_DEGREE,
        FusionCache,
        FusionChoice,
        FusionDegrees,
        FusionMeasurement,
        FusionMode,
        auto_degrees,
        check_fusion_mode,
        choose_fusion_degree,
        fixed_choice,
        fused_bytes_estimate,
        fusion_cache_key,
        measure_fusion,
        measured_choice,
        with_step_seconds,
    )
    from sweepmaster.runtime.planning.memgreedy import MemoryPlanError, greedy_shard_decisions
    from sweepmaster.runtime.planning.memplan import (
        MemoryPlan,
        MemoryPlanCache,
        MemoryPlanRow,
        ShardMemoryPlan,
        cached_memory_plan,
        memory_plan_key,
        plan_memory,
        plan_shard,
    )
    from sweepmaster.runtime.planning.memplan_milp import (
        optimal_shard_decisions,
        random_shard_profile,
    )
    from sweepmaster.runtime.planning.memprofile import (
        ShardMemoryProfile,
        TracedLayers,
        profile_shards,
    )
    from sweepmaster.runtime.planning.memsim import (
        LayerDecision,
        ShardSimulation,
        offload_items,
        simulate_shard,
        stage_item_bytes,
    )
    from sweepmaster.runtime.planning.memtrace import (
        ActivationProfile,
        LayerActivations,
        trace_layer,
        trace_rng,
    )
    from sweepmaster.runtime.planning.packing import estimate_partition, make_plan
    from sweepmaster.runtime.planning.partition import (
        PlanCache,
        cached_plan,
        device_kind,
        optimizer_key,
        plan_cache_key,
        plan_job,
    )
    from sweepmaster.runtime.planning.pilot import pilot_partition, pilot_pass
    from sweepmaster.runtime.planning.pipeline_plan import (
        pipeline_packs,
        pipeline_reserve_bytes,
        pipeline_resident_bytes,
        pipeline_shape,
        pipeline_state_stays,
        pipeline_wrap,
    )
    from sweepmaster.runtime.planning.plans import (
        JobPlan,
        KeyedCache,
        LayerTooLargeError,
        ShardPlan,
    )
    from sweepmaster.runtime.planning.profile import (
        LayerProfile,
        ModelProfile,
        build_fake_model,
        build_host_model,
        estimate_plain_bytes,
        foreach_by_default,
        optimizer_state_bytes,
        optimizer_step_bytes,
        plain_footprint_bytes,
        profile_model,
    )
    from sweepmaster.runtime.planning.task_bytes import TaskBytes, steady_task_bytes, task_order
    from sweepmaster.runtime.planning.timing import device_flops_per_s, measure_copy_bandwidth

__getattr__, __dir__, __all__ = lazy_exports(globals())
