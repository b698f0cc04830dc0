"""Planning: layer profiles, shard partitions, pipeline packs, memory plans, fusion degrees.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_MODULES = {
    "fusion_degree": (
        "FUSION_FORMAT_VERSION", "FusionCache", "FusionChoice", "FusionDegrees",
        "FusionMeasurement", "FusionMode", "MAX_AUTO_FUSION_DEGREE", "auto_degrees",
        "check_fusion_mode", "choose_fusion_degree", "fixed_choice", "fused_bytes_estimate",
        "fusion_cache_key", "measure_fusion", "measured_choice", "with_step_seconds"
    ),
    "memplan": (
        "MemoryPlan", "MemoryPlanCache", "MemoryPlanError", "MemoryPlanRow", "ShardMemoryPlan",
        "cached_memory_plan", "greedy_shard_decisions", "memory_plan_key", "plan_memory",
        "plan_shard"
    ),
    "memplan_milp": ("optimal_shard_decisions", "random_shard_profile"),
    "memprofile": (
        "ActivationProfile", "LayerActivations", "ShardMemoryProfile", "TracedLayers",
        "measure_copy_bandwidth", "profile_shards", "trace_layer"
    ),
    "memsim": (
        "LayerDecision", "ShardSimulation", "offload_items", "simulate_shard", "stage_item_bytes"
    ),
    "partition": (
        "PlanCache", "cached_plan", "device_kind", "estimate_partition", "make_plan",
        "optimizer_key", "pilot_partition", "plan_cache_key", "plan_job"
    ),
    "pipeline_plan": (
        "pipeline_packs", "pipeline_reserve_bytes", "pipeline_resident_bytes", "pipeline_shape",
        "pipeline_state_stays", "pipeline_wrap"
    ),
    "plans": ("JobPlan", "KeyedCache", "LayerTooLargeError", "ShardPlan", "TaskBytes"),
    "profile": (
        "LayerProfile", "ModelProfile", "build_fake_model", "build_host_model",
        "device_flops_per_s", "estimate_plain_bytes", "optimizer_state_bytes", "pilot_pass",
        "plain_footprint_bytes", "profile_model"
    ),
}
_EXPORTS = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
