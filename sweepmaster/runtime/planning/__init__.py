"""Planning: layer profiles, the shard partition, swap/recompute memory plans, fusion degrees.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "FUSION_FORMAT_VERSION": "sweepmaster.runtime.planning.fusion_degree",
    "FusionCache": "sweepmaster.runtime.planning.fusion_degree",
    "FusionChoice": "sweepmaster.runtime.planning.fusion_degree",
    "FusionDegrees": "sweepmaster.runtime.planning.fusion_degree",
    "FusionMeasurement": "sweepmaster.runtime.planning.fusion_degree",
    "FusionMode": "sweepmaster.runtime.planning.fusion_degree",
    "MAX_AUTO_FUSION_DEGREE": "sweepmaster.runtime.planning.fusion_degree",
    "auto_degrees": "sweepmaster.runtime.planning.fusion_degree",
    "check_fusion_mode": "sweepmaster.runtime.planning.fusion_degree",
    "choose_fusion_degree": "sweepmaster.runtime.planning.fusion_degree",
    "fixed_choice": "sweepmaster.runtime.planning.fusion_degree",
    "fused_bytes_estimate": "sweepmaster.runtime.planning.fusion_degree",
    "fusion_cache_key": "sweepmaster.runtime.planning.fusion_degree",
    "measure_fusion": "sweepmaster.runtime.planning.fusion_degree",
    "measured_choice": "sweepmaster.runtime.planning.fusion_degree",
    "with_step_seconds": "sweepmaster.runtime.planning.fusion_degree",
    "MemoryPlan": "sweepmaster.runtime.planning.memplan",
    "MemoryPlanCache": "sweepmaster.runtime.planning.memplan",
    "MemoryPlanError": "sweepmaster.runtime.planning.memplan",
    "MemoryPlanRow": "sweepmaster.runtime.planning.memplan",
    "ShardMemoryPlan": "sweepmaster.runtime.planning.memplan",
    "greedy_shard_decisions": "sweepmaster.runtime.planning.memplan",
    "plan_memory": "sweepmaster.runtime.planning.memplan",
    "plan_shard": "sweepmaster.runtime.planning.memplan",
    "optimal_shard_decisions": "sweepmaster.runtime.planning.memplan_milp",
    "random_shard_profile": "sweepmaster.runtime.planning.memplan_milp",
    "ActivationProfile": "sweepmaster.runtime.planning.memprofile",
    "LayerActivations": "sweepmaster.runtime.planning.memprofile",
    "ShardMemoryProfile": "sweepmaster.runtime.planning.memprofile",
    "measure_copy_bandwidth": "sweepmaster.runtime.planning.memprofile",
    "profile_shards": "sweepmaster.runtime.planning.memprofile",
    "trace_layer": "sweepmaster.runtime.planning.memprofile",
    "LayerDecision": "sweepmaster.runtime.planning.memsim",
    "ShardSimulation": "sweepmaster.runtime.planning.memsim",
    "offload_items": "sweepmaster.runtime.planning.memsim",
    "simulate_shard": "sweepmaster.runtime.planning.memsim",
    "stage_item_bytes": "sweepmaster.runtime.planning.memsim",
    "JobPlan": "sweepmaster.runtime.planning.plans",
    "LayerTooLargeError": "sweepmaster.runtime.planning.plans",
    "PlanCache": "sweepmaster.runtime.planning.partition",
    "ShardPlan": "sweepmaster.runtime.planning.plans",
    "TaskBytes": "sweepmaster.runtime.planning.plans",
    "cached_plan": "sweepmaster.runtime.planning.partition",
    "device_kind": "sweepmaster.runtime.planning.partition",
    "estimate_partition": "sweepmaster.runtime.planning.partition",
    "make_plan": "sweepmaster.runtime.planning.partition",
    "pilot_partition": "sweepmaster.runtime.planning.partition",
    "plan_cache_key": "sweepmaster.runtime.planning.partition",
    "plan_job": "sweepmaster.runtime.planning.partition",
    "LayerProfile": "sweepmaster.runtime.planning.profile",
    "ModelProfile": "sweepmaster.runtime.planning.profile",
    "build_fake_model": "sweepmaster.runtime.planning.profile",
    "build_host_model": "sweepmaster.runtime.planning.profile",
    "device_flops_per_s": "sweepmaster.runtime.planning.profile",
    "estimate_plain_bytes": "sweepmaster.runtime.planning.profile",
    "optimizer_state_bytes": "sweepmaster.runtime.planning.profile",
    "pilot_pass": "sweepmaster.runtime.planning.profile",
    "plain_footprint_bytes": "sweepmaster.runtime.planning.profile",
    "profile_model": "sweepmaster.runtime.planning.profile",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
