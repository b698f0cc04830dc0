"""The executor: trains jobs on devices; knows nothing of Optuna, YAML or the database.

The names below are imported on first use, so ``import sweepmaster.runtime.events`` (which the
store and the terminal display need) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "CudaDevice": "sweepmaster.runtime.device",
    "Device": "sweepmaster.runtime.device",
    "TransferStats": "sweepmaster.runtime.device",
    "VirtualDevice": "sweepmaster.runtime.device",
    "parse_devices": "sweepmaster.runtime.device",
    "parse_size": "sweepmaster.runtime.device",
    "EvalEvent": "sweepmaster.runtime.events",
    "StartEvent": "sweepmaster.runtime.events",
    "StepEvent": "sweepmaster.runtime.events",
    "TaskRecord": "sweepmaster.runtime.events",
    "TrainCallbacks": "sweepmaster.runtime.events",
    "Executor": "sweepmaster.runtime.executor",
    "JobCancelledError": "sweepmaster.runtime.executor",
    "FusedArray": "sweepmaster.runtime.fusion",
    "FusedMemberError": "sweepmaster.runtime.fusion",
    "train_fused": "sweepmaster.runtime.fusion",
    "FusionCache": "sweepmaster.runtime.fusion_degree",
    "FusionChoice": "sweepmaster.runtime.fusion_degree",
    "FusionMeasurement": "sweepmaster.runtime.fusion_degree",
    "choose_fusion_degree": "sweepmaster.runtime.fusion_degree",
    "measure_fusion": "sweepmaster.runtime.fusion_degree",
    "LayerStack": "sweepmaster.runtime.layers",
    "UnsupportedModelError": "sweepmaster.runtime.layers",
    "decompose": "sweepmaster.runtime.layers",
    "MemoryPlan": "sweepmaster.runtime.memplan",
    "MemoryPlanError": "sweepmaster.runtime.memplan",
    "MemoryPlanRow": "sweepmaster.runtime.memplan",
    "ShardMemoryPlan": "sweepmaster.runtime.memplan",
    "plan_memory": "sweepmaster.runtime.memplan",
    "LayerDecision": "sweepmaster.runtime.memsim",
    "CudaMeter": "sweepmaster.runtime.meter",
    "MemoryMeter": "sweepmaster.runtime.meter",
    "VirtualMeter": "sweepmaster.runtime.meter",
    "JobPlan": "sweepmaster.runtime.partition",
    "LayerTooLargeError": "sweepmaster.runtime.partition",
    "ShardPlan": "sweepmaster.runtime.partition",
    "estimate_partition": "sweepmaster.runtime.partition",
    "make_plan": "sweepmaster.runtime.partition",
    "pilot_partition": "sweepmaster.runtime.partition",
    "plan_job": "sweepmaster.runtime.partition",
    "build_optimizer": "sweepmaster.runtime.plain",
    "evaluate_loss": "sweepmaster.runtime.plain",
    "lr_factor": "sweepmaster.runtime.plain",
    "minibatch_indices": "sweepmaster.runtime.plain",
    "train_plain": "sweepmaster.runtime.plain",
    "LayerProfile": "sweepmaster.runtime.profile",
    "ModelProfile": "sweepmaster.runtime.profile",
    "estimate_plain_bytes": "sweepmaster.runtime.profile",
    "profile_model": "sweepmaster.runtime.profile",
    "ShardTask": "sweepmaster.runtime.spill",
    "SpilledJob": "sweepmaster.runtime.spill",
    "train_spilled": "sweepmaster.runtime.spill",
}

if TYPE_CHECKING:
    from sweepmaster.runtime.device import (
        CudaDevice,
        Device,
        TransferStats,
        VirtualDevice,
        parse_devices,
        parse_size,
    )
    from sweepmaster.runtime.events import (
        EvalEvent,
        StartEvent,
        StepEvent,
        TaskRecord,
        TrainCallbacks,
    )
    from sweepmaster.runtime.executor import Executor, JobCancelledError
    from sweepmaster.runtime.fusion import FusedArray, FusedMemberError, train_fused
    from sweepmaster.runtime.fusion_degree import (
        FusionCache,
        FusionChoice,
        FusionMeasurement,
        choose_fusion_degree,
        measure_fusion,
    )
    from sweepmaster.runtime.layers import LayerStack, UnsupportedModelError, decompose
    from sweepmaster.runtime.memplan import (
        MemoryPlan,
        MemoryPlanError,
        MemoryPlanRow,
        ShardMemoryPlan,
        plan_memory,
    )
    from sweepmaster.runtime.memsim import LayerDecision
    from sweepmaster.runtime.meter import CudaMeter, MemoryMeter, VirtualMeter
    from sweepmaster.runtime.partition import (
        JobPlan,
        LayerTooLargeError,
        ShardPlan,
        estimate_partition,
        make_plan,
        pilot_partition,
        plan_job,
    )
    from sweepmaster.runtime.plain import (
        build_optimizer,
        evaluate_loss,
        lr_factor,
        minibatch_indices,
        train_plain,
    )
    from sweepmaster.runtime.profile import (
        LayerProfile,
        ModelProfile,
        estimate_plain_bytes,
        profile_model,
    )
    from sweepmaster.runtime.spill import ShardTask, SpilledJob, train_spilled

__all__ = [
    "CudaDevice",
    "CudaMeter",
    "Device",
    "EvalEvent",
    "Executor",
    "FusedArray",
    "FusedMemberError",
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
    "ShardMemoryPlan",
    "ShardPlan",
    "ShardTask",
    "SpilledJob",
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
    "profile_model",
    "train_fused",
    "train_plain",
    "train_spilled",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
