"""The memory budget of a CUDA device: what a job can really use, measured at start.

A GPU's ``total_memory`` is not what a job can allocate: the CUDA context, other processes, and
the workspaces cuBLAS / cuDNN keep in the caching allocator take their share before the first
tensor, and the caching allocator rounds block sizes and fragments. So the budget that plans
(Hydra's partitioner, mu-TWO's memory plan) and meters use is

    usable = min(cap, total - outside - workspace)
    budget = usable * (1 - headroom)

where ``outside`` is device memory not held by this process's caching allocator when the device
is opened (``total - free - reserved`` of ``torch.cuda.mem_get_info`` and
``torch.cuda.memory_reserved``, after a matmul has created the cuBLAS handle and workspace),
``workspace`` is what the caching allocator holds then, ``cap`` is the user's ``device_memory``
and ``headroom`` (default :data:`DEFAULT_HEADROOM_FRACTION`) is left to the driver and to what
is not this process's allocator (context growth, other libraries). The budget is a hard cap,
during compute too, not only at promotion: the caching allocator is limited to
``workspace + budget`` bytes (``torch.cuda.set_per_process_memory_fraction``), not to the usable
memory above it, so a job that outgrows its plan gets the allocator's
``torch.OutOfMemoryError`` rather than taking memory the other jobs of the device were promised
(with the limit at ``workspace + usable``, measured peaks went 41 and 111 MiB over budget).
Meters read reserved memory (what the allocator holds from the driver, cached free blocks
included), less ``workspace``.

The arithmetic (:func:`plan_cuda_budget`) is pure and tested on the CPU; :func:`measure_cuda`
reads a real GPU.

Example:
    >>> GiB = 2**30
    >>> budget = plan_cuda_budget(
    ...     total_bytes=80 * GiB, free_bytes=79 * GiB, reserved_bytes=GiB // 4,
    ...     cap_bytes=None, headroom_fraction=0.05,
    ... )
    >>> budget.usable_bytes / GiB, round(budget.budget_bytes / GiB, 4)
    (79.0, 75.05)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sweepmaster.runtime.devices.settings import (
    DEFAULT_HEADROOM_FRACTION,
    HEADROOM_ENV,
    headroom_from_env,
)

__all__ = [
    "DEFAULT_HEADROOM_FRACTION",
    "HEADROOM_ENV",
    "CudaBudget",
    "headroom_from_env",
    "measure_cuda",
    "new_reservation_bytes",
    "plan_cuda_budget",
]


@dataclass(frozen=True)
class CudaBudget:
    """The memory budget of one GPU (see the module doc); all sizes in bytes.

    Attributes:
        total_bytes: The GPU's total memory.
        outside_bytes: Memory in use outside this process's caching allocator at start
            (CUDA context, other processes).
        workspace_bytes: Memory the caching allocator held at start (cuBLAS workspaces).
        usable_bytes: ``min(cap, total - outside - workspace)``: what jobs may ever hold.
        budget_bytes: ``usable`` less the headroom: what plans and meters budget for.
        memory_fraction: The caching allocator's limit ``(workspace + budget) / total``, for
            ``torch.cuda.set_per_process_memory_fraction``: the budget is a hard cap.
    """

    total_bytes: int
    outside_bytes: int
    workspace_bytes: int
    usable_bytes: int
    budget_bytes: int
    memory_fraction: float


def plan_cuda_budget(
    total_bytes: int,
    free_bytes: int,
    reserved_bytes: int,
    cap_bytes: int | None = None,
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION,
) -> CudaBudget:
    """The budget of a GPU from what was measured when it was opened.

    Args:
        total_bytes: Total memory of the GPU (``torch.cuda.mem_get_info``'s second value).
        free_bytes: Free memory then (its first value).
        reserved_bytes: ``torch.cuda.memory_reserved`` then (the allocator's workspaces).
        cap_bytes: The user's cap on what jobs may use (``device_memory``), or ``None``.
        headroom_fraction: Share of the usable memory left out of the budget, in ``[0, 1)``.

    Returns:
        The budget.

    Raises:
        ValueError: A negative or inconsistent measurement, a headroom outside ``[0, 1)``, a
            cap that is not positive, or no memory left for jobs.
    """
    if not 0.0 <= headroom_fraction < 1.0:
        raise ValueError(f"device headroom must be a fraction in [0, 1), got {headroom_fraction}")
    if cap_bytes is not None and cap_bytes <= 0:
        raise ValueError(f"device memory cap must be > 0 bytes, got {cap_bytes}")
    if min(total_bytes, free_bytes, reserved_bytes) < 0 or free_bytes > total_bytes:
        raise ValueError(
            f"inconsistent GPU memory: total {total_bytes}, free {free_bytes}, "
            f"reserved {reserved_bytes} bytes"
        )
    outside = max(0, total_bytes - free_bytes - reserved_bytes)
    usable = total_bytes - outside - reserved_bytes
    if cap_bytes is not None:
        usable = min(usable, cap_bytes)
    budget = int(usable * (1.0 - headroom_fraction))
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for jobs: {total_bytes} bytes total, {outside} in use outside "
            f"this process, {reserved_bytes} held by its allocator"
        )
    fraction = min(1.0, (reserved_bytes + budget) / total_bytes)
    return CudaBudget(total_bytes, outside, reserved_bytes, usable, budget, fraction)


def use_expandable_segments() -> bool:
    """Let the caching allocator grow segments in place (``expandable_segments:True``).

    Spilling allocates and frees tensors of many sizes under a tight limit; with fixed
    segments the cached free blocks fragment until an allocation that fits the budget fails
    (PyTorch's CUDA semantics notes, "Memory management":
    https://pytorch.org/docs/stable/notes/cuda.html#memory-management). Applies only when
    ``PYTORCH_CUDA_ALLOC_CONF`` is unset: a user's own allocator settings win.

    Returns:
        Whether the setting was applied.
    """
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    setter("expandable_segments:True")
    return True


def measure_cuda(torch_device: torch.device) -> tuple[int, int, int]:
    """Open a GPU and measure it: ``(total, free, reserved)`` bytes after cuBLAS is set up.

    A small matmul creates the CUDA context, the cuBLAS handle and its workspace first, so they
    are part of the measurement rather than of the first job's memory.
    """
    with torch.cuda.device(torch_device):
        x = torch.ones(64, 64, device=torch_device)
        (x @ x).sum().item()
        del x
        torch.cuda.synchronize(torch_device)
        torch.cuda.empty_cache()  # the matmul's own blocks; cuBLAS keeps its workspace
        free, total = torch.cuda.mem_get_info(torch_device)
        reserved = torch.cuda.memory_reserved(torch_device)
    return int(total), int(free), int(reserved)


def new_reservation_bytes(num_bytes: int, reserved_bytes: int, allocated_bytes: int) -> int:
    """Bytes an allocation of ``num_bytes`` may add to the allocator's reserved memory.

    The caching allocator serves an allocation from its cached free blocks
    (``reserved - allocated``) before reserving more, so only the rest is new. It is a lower
    bound (a cached block may be too small or split), which is why the budget keeps a headroom
    and the allocator's own limit stays the hard stop.

    Example:
        >>> new_reservation_bytes(100, reserved_bytes=1000, allocated_bytes=960)
        60
    """
    cached_free = max(0, reserved_bytes - allocated_bytes)
    return max(0, num_bytes - cached_free)
