"""Training: plain, spilled and fused trainers, layer decomposition, swap, replay, checkpoints.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "CHECKPOINT_VERSION": "sweepmaster.runtime.training.checkpoint",
    "TrainingState": "sweepmaster.runtime.training.checkpoint",
    "capture_rng": "sweepmaster.runtime.training.checkpoint",
    "checkpoint_files": "sweepmaster.runtime.training.checkpoint",
    "job_key": "sweepmaster.runtime.training.checkpoint",
    "load_latest": "sweepmaster.runtime.training.checkpoint",
    "load_optimizer_state_by_name": "sweepmaster.runtime.training.checkpoint",
    "optimizer_state_by_name": "sweepmaster.runtime.training.checkpoint",
    "restore_rng": "sweepmaster.runtime.training.checkpoint",
    "save_checkpoint": "sweepmaster.runtime.training.checkpoint",
    "FusedAdamW": "sweepmaster.runtime.training.fused_optim",
    "FusedOptimizer": "sweepmaster.runtime.training.fused_optim",
    "FusedSGD": "sweepmaster.runtime.training.fused_optim",
    "build_fused_optimizer": "sweepmaster.runtime.training.fused_optim",
    "clip_coefficients": "sweepmaster.runtime.training.fused_optim",
    "clip_grad_norm_per_member_": "sweepmaster.runtime.training.fused_optim",
    "member_grad_norms": "sweepmaster.runtime.training.fused_optim",
    "StackedLayerTooLargeError": "sweepmaster.runtime.training.fused_shards",
    "StackedLayers": "sweepmaster.runtime.training.fused_shards",
    "dropout_noise_bytes": "sweepmaster.runtime.training.fused_shards",
    "plan_stacked": "sweepmaster.runtime.training.fused_shards",
    "stacked_profile": "sweepmaster.runtime.training.fused_shards",
    "SpilledFusedJob": "sweepmaster.runtime.training.fused_spill",
    "train_fused_spilled": "sweepmaster.runtime.training.fused_spill",
    "FusedArray": "sweepmaster.runtime.training.fusion",
    "FusedMemberError": "sweepmaster.runtime.training.fusion",
    "FusedStep": "sweepmaster.runtime.training.fusion",
    "MemberEndHook": "sweepmaster.runtime.training.fusion",
    "train_fused": "sweepmaster.runtime.training.fusion",
    "LayerPass": "sweepmaster.runtime.training.layerpass",
    "LossFn": "sweepmaster.runtime.training.layerpass",
    "backward_layers": "sweepmaster.runtime.training.layerpass",
    "forward_layers": "sweepmaster.runtime.training.layerpass",
    "release_passes": "sweepmaster.runtime.training.layerpass",
    "DecoderLayer": "sweepmaster.runtime.training.layers",
    "Embedding": "sweepmaster.runtime.training.layers",
    "Head": "sweepmaster.runtime.training.layers",
    "LayerStack": "sweepmaster.runtime.training.layers",
    "UnsupportedModelError": "sweepmaster.runtime.training.layers",
    "decompose": "sweepmaster.runtime.training.layers",
    "build_optimizer": "sweepmaster.runtime.training.plain",
    "evaluate_loss": "sweepmaster.runtime.training.plain",
    "isolated_host_rng": "sweepmaster.runtime.training.plain",
    "lr_factor": "sweepmaster.runtime.training.plain",
    "minibatch_indices": "sweepmaster.runtime.training.plain",
    "train_plain": "sweepmaster.runtime.training.plain",
    "FullBatchAttention": "sweepmaster.runtime.training.replay",
    "JobRng": "sweepmaster.runtime.training.replay",
    "RandomReplay": "sweepmaster.runtime.training.replay",
    "pads_attention": "sweepmaster.runtime.training.replay",
    "replays_by_state": "sweepmaster.runtime.training.replay",
    "ShardTask": "sweepmaster.runtime.training.spill",
    "SpilledJob": "sweepmaster.runtime.training.spill",
    "after_step_phase": "sweepmaster.runtime.training.spill",
    "train_spilled": "sweepmaster.runtime.training.spill",
    "CopyEngine": "sweepmaster.runtime.training.swap",
    "LayerEntry": "sweepmaster.runtime.training.swap",
    "LayerPacker": "sweepmaster.runtime.training.swap",
    "Slot": "sweepmaster.runtime.training.swap",
    "SlotSource": "sweepmaster.runtime.training.swap",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
