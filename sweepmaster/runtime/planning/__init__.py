"""Planning: layer profiles, shard partitions, pipeline packs, memory plans, fusion degrees.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_MODULES = {
    "attention": ("FusedAttention", "attention_kernel"),
    "fusion_degree": (
        "FUSION_FORMAT_VERSION", "FusionCache", "FusionChoice", "FusionDegrees",
        "FusionMeasurement", "FusionMode", "MAX_AUTO_FUSION_DEGREE", "auto_degrees",
        "check_fusion_mode", "choose_fusion_degree", "fixed_choice", "fused_bytes_estimate",
        "fusion_cache_key", "measure_fusion", "measured_choice", "with_step_seconds"
    ),
    "memgreedy": ("MemoryPlanError", "greedy_shard_decisions"),
    "memplan": (
        "MemoryPlan", "MemoryPlanCache", "MemoryPlanRow", "ShardMemoryPlan", "cached_memory_plan",
        "memory_plan_key", "plan_memory", "plan_shard"
    ),
    "memplan_milp": ("optimal_shard_decisions", "random_shard_profile"),
    "memprofile": ("ShardMemoryProfile", "TracedLayers", "profile_shards"),
    "memtrace": ("ActivationProfile", "LayerActivations", "trace_layer", "trace_rng"),
    "memsim": (
        "LayerDecision", "ShardSimulation", "offload_items", "simulate_shard", "stage_item_bytes"
    ),
    "packing": ("estimate_partition", "make_plan"),
    "partition": (
        "PlanCache", "cached_plan", "device_kind", "optimizer_key", "plan_cache_key", "plan_job"
    ),
    "pilot": ("pilot_partition", "pilot_pass"),
    "pipeline_plan": (
        "pipeline_packs", "pipeline_reserve_bytes", "pipeline_resident_bytes", "pipeline_shape",
        "pipeline_state_stays", "pipeline_wrap"
    ),
    "plans": ("JobPlan", "KeyedCache", "LayerTooLargeError", "ShardPlan"),
    "profile": (
        "LayerProfile", "ModelProfile", "build_fake_model", "build_host_model",
        "estimate_plain_bytes", "foreach_by_default", "optimizer_state_bytes",
        "optimizer_step_bytes", "plain_footprint_bytes", "profile_model"
    ),
    "task_bytes": ("TaskBytes", "steady_task_bytes", "task_order"),
    "timing": ("device_flops_per_s", "measure_copy_bandwidth"),
}
_EXPORTS = {name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
