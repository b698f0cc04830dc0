"""The executor: trains jobs on devices; knows nothing of Optuna, YAML or the database."""

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
