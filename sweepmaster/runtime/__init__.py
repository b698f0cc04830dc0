"""The executor: trains jobs on devices; knows nothing of Optuna, YAML or the database.

The names below are imported on first use, so ``import sweepmaster.runtime.events``
(which the store and the terminal display need) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

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

__getattr__, __dir__, __all__ = lazy_exports(globals())
