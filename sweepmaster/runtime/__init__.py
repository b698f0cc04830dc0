"""The executor: trains jobs on devices; knows nothing of Optuna, YAML or the database.

The names below are imported on first use, so ``import sweepmaster.runtime.events``
(which the store and the terminal display need) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "CudaDevice": "sweepmaster.runtime.devices.device",
    "Device": "sweepmaster.runtime.devices.device",
    "TransferStats": "sweepmaster.runtime.devices.device",
    "VirtualDevice": "sweepmaster.runtime.devices.device",
    "parse_devices": "sweepmaster.runtime.devices.device",
    "parse_size": "sweepmaster.runtime.devices.device",
    "EvalEvent": "sweepmaster.runtime.events",
    "ReplanEvent": "sweepmaster.runtime.events",
    "StartEvent": "sweepmaster.runtime.events",
    "StepEvent": "sweepmaster.runtime.events",
    "TaskRecord": "sweepmaster.runtime.events",
    "TrainCallbacks": "sweepmaster.runtime.events",
    "ShardExecutor": "sweepmaster.runtime.executor",
    "JobCancelledError": "sweepmaster.runtime.execution.state",
    "SpilledFusedJob": "sweepmaster.runtime.training.fused_spill",
    "train_fused_spilled": "sweepmaster.runtime.training.fused_spill",
    "plan_stacked": "sweepmaster.runtime.training.fused_shards",
    "FusionCache": "sweepmaster.runtime.planning.fusion_degree",
    "FusionChoice": "sweepmaster.runtime.planning.fusion_degree",
    "FusionMeasurement": "sweepmaster.runtime.planning.fusion_degree",
    "choose_fusion_degree": "sweepmaster.runtime.planning.fusion_degree",
    "measure_fusion": "sweepmaster.runtime.planning.fusion_degree",
    "LayerStack": "sweepmaster.runtime.training.layers",
    "UnsupportedModelError": "sweepmaster.runtime.training.layers",
    "decompose": "sweepmaster.runtime.training.layers",
    "MemoryPlan": "sweepmaster.runtime.planning.memplan",
    "MemoryPlanError": "sweepmaster.runtime.planning.memplan",
    "MemoryPlanRow": "sweepmaster.runtime.planning.memplan",
    "ShardMemoryPlan": "sweepmaster.runtime.planning.memplan",
    "plan_memory": "sweepmaster.runtime.planning.memplan",
    "LayerDecision": "sweepmaster.runtime.planning.memsim",
    "CudaMeter": "sweepmaster.runtime.devices.meter",
    "MemoryMeter": "sweepmaster.runtime.devices.meter",
    "VirtualMeter": "sweepmaster.runtime.devices.meter",
    "JobPlan": "sweepmaster.runtime.planning.plans",
    "LayerTooLargeError": "sweepmaster.runtime.planning.plans",
    "ShardPlan": "sweepmaster.runtime.planning.plans",
    "estimate_partition": "sweepmaster.runtime.planning.packing",
    "make_plan": "sweepmaster.runtime.planning.packing",
    "pilot_partition": "sweepmaster.runtime.planning.pilot",
    "plan_job": "sweepmaster.runtime.planning.partition",
    "build_optimizer": "sweepmaster.runtime.training.plain",
    "evaluate_loss": "sweepmaster.runtime.training.plain",
    "lr_factor": "sweepmaster.runtime.training.plain",
    "minibatch_indices": "sweepmaster.runtime.training.plain",
    "train_plain": "sweepmaster.runtime.training.plain",
    "LayerProfile": "sweepmaster.runtime.planning.profile",
    "ModelProfile": "sweepmaster.runtime.planning.profile",
    "estimate_plain_bytes": "sweepmaster.runtime.planning.profile",
    "profile_model": "sweepmaster.runtime.planning.profile",
    "ShardTask": "sweepmaster.runtime.training.tasks",
    "SpilledJob": "sweepmaster.runtime.training.spill",
    "train_spilled": "sweepmaster.runtime.training.spill",
    "PipelinedRun": "sweepmaster.runtime.training.pipelined",
    "train_pipelined": "sweepmaster.runtime.training.pipelined",
}

if TYPE_CHECKING:
    from sweepmaster.runtime.devices.device import (
        CudaDevice,
        Device,
        TransferStats,
        VirtualDevice,
        parse_devices,
        parse_size,
    )
    from sweepmaster.runtime.devices.meter import CudaMeter, MemoryMeter, VirtualMeter
    from sweepmaster.runtime.events import (
        EvalEvent,
        ReplanEvent,
        StartEvent,
        StepEvent,
        TaskRecord,
        TrainCallbacks,
    )
    from sweepmaster.runtime.execution.state import JobCancelledError
    from sweepmaster.runtime.executor import ShardExecutor
    from sweepmaster.runtime.planning.fusion_degree import (
        FusionCache,
        FusionChoice,
        FusionMeasurement,
        choose_fusion_degree,
        measure_fusion,
    )
    from sweepmaster.runtime.planning.memplan import (
        MemoryPlan,
        MemoryPlanError,
        MemoryPlanRow,
        ShardMemoryPlan,
        plan_memory,
    )
    from sweepmaster.runtime.planning.memsim import LayerDecision
    from sweepmaster.runtime.planning.packing import estimate_partition, make_plan
    from sweepmaster.runtime.planning.partition import plan_job
    from sweepmaster.runtime.planning.pilot import pilot_partition
    from sweepmaster.runtime.planning.plans import JobPlan, LayerTooLargeError, ShardPlan
    from sweepmaster.runtime.planning.profile import (
        LayerProfile,
        ModelProfile,
        estimate_plain_bytes,
        profile_model,
    )
    from sweepmaster.runtime.training.fused_shards import plan_stacked
    from sweepmaster.runtime.training.fused_spill import SpilledFusedJob, train_fused_spilled
    from sweepmaster.runtime.training.layers import LayerStack, UnsupportedModelError, decompose
    from sweepmaster.runtime.training.pipelined import PipelinedRun, train_pipelined
    from sweepmaster.runtime.training.plain import (
        build_optimizer,
        evaluate_loss,
        lr_factor,
        minibatch_indices,
        train_plain,
    )
    from sweepmaster.runtime.training.spill import SpilledJob, train_spilled
    from sweepmaster.runtime.training.tasks import ShardTask

__all__ = [
    "CudaDevice",
    "CudaMeter",
    "Device",
    "EvalEvent",
    "FusionCache",
    "FusionChoice",
    "FusionMeasurement",
    "JobCancelledError",
    "JobPlan",
    "LayerProfile",
    "LayerDecision",
    "LayerStack",
    "LayerTooLargeError",
    "MemoryMeter",
    "MemoryPlan",
    "MemoryPlanError",
    "MemoryPlanRow",
    "ModelProfile",
    "PipelinedRun",
    "ShardMemoryPlan",
    "ShardExecutor",
    "ShardPlan",
    "ShardTask",
    "SpilledFusedJob",
    "SpilledJob",
    "ReplanEvent",
    "StartEvent",
    "StepEvent",
    "TaskRecord",
    "TrainCallbacks",
    "TransferStats",
    "UnsupportedModelError",
    "VirtualDevice",
    "VirtualMeter",
    "build_optimizer",
    "choose_fusion_degree",
    "decompose",
    "estimate_partition",
    "estimate_plain_bytes",
    "evaluate_loss",
    "lr_factor",
    "make_plan",
    "measure_fusion",
    "minibatch_indices",
    "parse_devices",
    "parse_size",
    "pilot_partition",
    "plan_job",
    "plan_memory",
    "plan_stacked",
    "profile_model",
    "train_fused_spilled",
    "train_pipelined",
    "train_plain",
    "train_spilled",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
