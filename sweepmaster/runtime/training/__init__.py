"""Training: plain and the one spilled trainer (its parts, one member or K), layers, checkpoints.

Names are imported on first use (:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.runtime.training.bookkeeping import TrialBookkeeping
    from sweepmaster.runtime.training.boundaries import HostBoundaries, metering
    from sweepmaster.runtime.training.compute import ShardCompute
    from sweepmaster.runtime.training.fused_members import StackedMembers
    from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
    from sweepmaster.runtime.training.fused_noise import draw_states, member_noises
    from sweepmaster.runtime.training.fused_optim import (
        FusedAdamW,
        FusedLion,
        FusedOptimizer,
        FusedSGD,
        build_fused_optimizer,
        clip_coefficients,
        member_grad_norms,
    )
    from sweepmaster.runtime.training.fused_shards import (
        StackedLayers,
        StackedLayerTooLargeError,
        dropout_noise_bytes,
        members_losses,
        plan_stacked,
        stacked_profile,
        stacked_spec,
    )
    from sweepmaster.runtime.training.fused_spill import (
        FusedMembers,
        SpilledFusedJob,
        train_fused_spilled,
    )
    from sweepmaster.runtime.training.layerpass import (
        LayerPass,
        LossFn,
        backward_layers,
        forward_layers,
        release_passes,
    )
    from sweepmaster.runtime.training.layers import (
        DecoderLayer,
        Embedding,
        Head,
        LayerStack,
        UnsupportedModelError,
        decompose,
    )
    from sweepmaster.runtime.training.member_dropout import (
        DropoutReplay,
        NoiseSite,
        SeededOpDetector,
        marking_adapter_dropout,
        member_noise,
    )
    from sweepmaster.runtime.training.member_runs import (
        MemberEndHook,
        MemberRun,
        MemberSource,
        RefillHook,
    )
    from sweepmaster.runtime.training.members import (
        Member,
        SharedBases,
        build_member,
        load_member,
        lora_layers,
        lora_scale,
        lora_scaling,
        meta_template,
        padded_adapter,
        same_tensors,
        tied_aliases,
        unpad,
        zero_pad,
    )
    from sweepmaster.runtime.training.optimizers import OPTIMIZERS, OptimizerEntry, optimizer_entry
    from sweepmaster.runtime.training.pipeline_lanes import PipelineLanes
    from sweepmaster.runtime.training.pipeline_step import PipelinedStep
    from sweepmaster.runtime.training.pipeline_swaps import PackSwaps
    from sweepmaster.runtime.training.pipelined import PipelinedRun, train_pipelined
    from sweepmaster.runtime.training.plain import (
        build_optimizer,
        evaluate_loss,
        isolated_host_rng,
        lr_factor,
        minibatch_indices,
        train_plain,
    )
    from sweepmaster.runtime.training.planned import PlannedPasses
    from sweepmaster.runtime.training.replay import (
        FullBatchAttention,
        JobRng,
        RandomReplay,
        pads_attention,
        replays_by_state,
    )
    from sweepmaster.runtime.training.shard_members import ShardMembers
    from sweepmaster.runtime.training.shard_store import ShardStore, ShardTensors
    from sweepmaster.runtime.training.shard_trainer import ShardTrainer
    from sweepmaster.runtime.training.spill import ModuleMember, SpilledJob, train_spilled
    from sweepmaster.runtime.training.swap import (
        CopyEngine,
        LayerEntry,
        LayerPacker,
        Slot,
        SlotSource,
    )
    from sweepmaster.runtime.training.tasks import (
        ShardTask,
        StepRange,
        TaskChain,
        after_step_phase,
    )
    from sweepmaster.runtime.training.training_state import (
        CHECKPOINT_VERSION,
        TrainingState,
        capture_rng,
        checkpoint_files,
        job_key,
        load_latest,
        load_optimizer_state_by_name,
        optimizer_state_by_name,
        restore_rng,
        save_checkpoint,
    )

__getattr__, __dir__, __all__ = lazy_exports(globals())
