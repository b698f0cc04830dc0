"""Devices and their memory: CUDA GPUs and virtual devices, meters, budgets, the transfer engine.

Names are imported on first use (:mod:`sweepmaster.lazy`).
"""

from __future__ import annotations

from sweepmaster.lazy import lazy_exports

_EXPORTS = {
    "CudaBudget": "sweepmaster.runtime.devices.budget",
    "DEFAULT_HEADROOM_FRACTION": "sweepmaster.runtime.devices.budget",
    "HEADROOM_ENV": "sweepmaster.runtime.devices.budget",
    "headroom_from_env": "sweepmaster.runtime.devices.budget",
    "measure_cuda": "sweepmaster.runtime.devices.budget",
    "new_reservation_bytes": "sweepmaster.runtime.devices.budget",
    "plan_cuda_budget": "sweepmaster.runtime.devices.budget",
    "CudaDevice": "sweepmaster.runtime.devices.device",
    "Device": "sweepmaster.runtime.devices.device",
    "TransferStats": "sweepmaster.runtime.devices.device",
    "VirtualDevice": "sweepmaster.runtime.devices.device",
    "check_device_spec": "sweepmaster.runtime.devices.device",
    "executor_devices": "sweepmaster.runtime.devices.device",
    "parse_devices": "sweepmaster.runtime.devices.device",
    "parse_size": "sweepmaster.runtime.devices.device",
    "CudaMeter": "sweepmaster.runtime.devices.meter",
    "MemoryMeter": "sweepmaster.runtime.devices.meter",
    "VirtualMeter": "sweepmaster.runtime.devices.meter",
    "format_bytes": "sweepmaster.runtime.devices.meter",
    "DeviceEntry": "sweepmaster.runtime.devices.settings",
    "FusionMode": "sweepmaster.runtime.devices.settings",
    "check_fusion_mode": "sweepmaster.runtime.devices.settings",
    "parse_device_spec": "sweepmaster.runtime.devices.settings",
    "StagingPool": "sweepmaster.runtime.devices.staging",
    "Transfer": "sweepmaster.runtime.devices.transfer",
    "TransferEngine": "sweepmaster.runtime.devices.transfer",
    "engine_for": "sweepmaster.runtime.devices.transfer",
    "pack_offsets": "sweepmaster.runtime.devices.staging",
    "settle_all": "sweepmaster.runtime.devices.transfer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
