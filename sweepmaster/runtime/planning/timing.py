"""Where a plan's seconds come from: FLOPs, a device's calibrated rates, timed calls.

A layer's estimated time is its FLOPs (counted per op by ``torch.utils.flop_counter``'s
formulas) at the device's calibrated matmul rate (:func:`device_flops_per_s`); a copy's is its
bytes at the measured host -> device bandwidth (:func:`measure_copy_bandwidth`). Both rates are
measured once per process per device, each the best of a few calls timed from a synchronized
device until its work has finished. Passes measured on a device (a layer's real seconds, a pilot
pass's bytes) hold their parameters there only for the pass.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from sweepmaster.runtime.devices.device import Device

__all__ = ["device_flops_per_s", "measure_copy_bandwidth"]

#: Cache of calibrated FLOP rates per device name.
_FLOPS_PER_S: dict[str, float] = {}
#: Measured host -> device copy bandwidths (bytes/s) per device name.
_BANDWIDTHS: dict[str, float] = {}


def device_flops_per_s(device: Device) -> float:
    """Calibrated float32 matmul rate of a device (FLOP/s), measured once per process.

    A 512 x 512 x 2048 matmul, best of 3; an optimistic rate for a transformer layer, whose
    softmax and normalizations run below matmul speed.
    """
    if device.name not in _FLOPS_PER_S:
        a = torch.ones(512, 2048, device=device.torch_device)
        b = torch.ones(2048, 512, device=device.torch_device)
        seconds = _best_seconds(device.torch_device, lambda: torch.mm(a, b), 3)
        _FLOPS_PER_S[device.name] = 2 * 512 * 2048 * 512 / seconds
    return _FLOPS_PER_S[device.name]


def _best_seconds(torch_device: torch.device, run: Callable[[], object], repeats: int) -> float:
    """Fewest wall seconds (at least 1e-9) of ``repeats`` calls of ``run`` on a device.

    Each call is timed from a synchronized device until its work has finished; its result is
    freed after the timing.
    """
    best = float("inf")
    for _ in range(repeats):
        _synchronize(torch_device)
        start = time.perf_counter()
        result = run()
        _synchronize(torch_device)
        best = min(best, time.perf_counter() - start)
        del result
    return max(best, 1e-9)


def measure_copy_bandwidth(device: Device, num_bytes: int = 8 << 20) -> float:
    """Host -> device copy bandwidth of a device (bytes/s), measured once per process.

    Copies of ``num_bytes`` (the size of a typical saved activation), best of 5: on a virtual
    device a fresh allocation and a copy (what a fetch does), on CUDA a pinned host -> device
    copy.
    """
    if device.name not in _BANDWIDTHS:
        torch_device = device.torch_device
        host = torch.ones(num_bytes // 4, pin_memory=torch_device.type == "cuda")
        seconds = _best_seconds(
            torch_device, lambda: torch.empty_like(host, device=torch_device).copy_(host), 5
        )
        _BANDWIDTHS[device.name] = num_bytes / seconds
    return _BANDWIDTHS[device.name]


@contextlib.contextmanager
def _on_device(params: Iterable[nn.Parameter], torch_device: torch.device) -> Iterator[None]:
    """Copy parameters to the device for the block, then back to their host data; drop grads."""
    params = list(params)
    host = [p.data for p in params]
    try:
        for param in params:
            param.data = param.data.to(torch_device, copy=True)
        yield
    finally:
        for param, data in zip(params, host, strict=True):
            param.data = data
            param.grad = None


def _synchronize(torch_device: torch.device) -> None:
    if torch_device.type == "cuda":
        torch.cuda.synchronize(torch_device)


class _FlopCount(TorchDispatchMode):
    """FLOPs of the ops the calling thread runs, by ``torch.utils.flop_counter``'s formulas.

    ``FlopCounterMode`` also attributes FLOPs to modules through global module hooks, which fire
    for every thread's modules and hook their tensors (keeping them, and their device memory, alive
    while other jobs train); this mode sees only its own thread's ops.

    Attributes:
        total: FLOPs counted so far.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out
