"""Devices and their memory: CUDA GPUs and virtual devices, meters, budgets, the transfer engine.

Names are imported on first use (:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.runtime.devices.budget import (
        DEFAULT_HEADROOM_FRACTION,
        HEADROOM_ENV,
        CudaBudget,
        headroom_from_env,
        measure_cuda,
        new_reservation_bytes,
        plan_cuda_budget,
    )
    from sweepmaster.runtime.devices.device import (
        CudaDevice,
        Device,
        TransferStats,
        VirtualDevice,
        check_device_spec,
        executor_devices,
        parse_devices,
        parse_size,
    )
    from sweepmaster.runtime.devices.meter import (
        CudaMeter,
        MemoryMeter,
        VirtualMeter,
        format_bytes,
    )
    from sweepmaster.runtime.devices.settings import (
        DeviceEntry,
        FusionMode,
        check_fusion_mode,
        parse_device_spec,
    )
    from sweepmaster.runtime.devices.staging import StagingPool, pack_offsets
    from sweepmaster.runtime.devices.transfer import (
        Transfer,
        TransferEngine,
        engine_for,
        settle_all,
    )

__getattr__, __dir__, __all__ = lazy_exports(globals())
