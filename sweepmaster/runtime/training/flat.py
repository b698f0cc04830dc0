"""Flat shards: a shard's tensors of one kind as views into one contiguous host buffer per dtype.

DeepSpeed ZeRO (flattened parameter groups) and PyTorch FSDP2 (one buffer per parameter group)
keep a group's parameters, gradients and optimizer state in flat buffers whose views are the
module's tensors, so that moving the group is one copy per buffer. A spilled job lays out each
shard's owned parameters, its other promoted tensors (frozen parameters, buffers) and its
optimizer state (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``) so;
stacked ``(K, ...)`` tensors of a fused array alike, each view keeping its shape. The buffers are
pinned once on CUDA (the copy engine reads and writes them without staging). The transfer layer
recognises views that tile one buffer and copies the buffer once
(:func:`~sweepmaster.runtime.devices.transfer.coalesced_copies`); the device copies are views of
one device buffer laid out the same
(:meth:`~sweepmaster.runtime.devices.transfer.TransferEngine.allocate`), one storage for the
device's meter.

Example:
    >>> a, b = torch.ones(2, 3), torch.zeros(4)
    >>> views = flat_views([a, b], pin=False)
    >>> views[0].untyped_storage().nbytes(), torch.equal(views[0], a)
    (40, True)
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["flat_views", "flatten_slots"]


def flat_views(tensors: Sequence[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """Copies of ``tensors`` as views into one new contiguous host buffer per dtype.

    Args:
        tensors: Host tensors (any shapes and dtypes), copied in order; each dtype's views follow
            one another in its buffer.
        pin: Pin the buffers (CUDA hosts), else plain host memory.

    Returns:
        One view per tensor, shaped and typed like it, holding its values (detached).
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    views: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype, indices in by_dtype.items():
        numel = sum(tensors[i].numel() for i in indices)
        buffer = torch.empty(numel, dtype=dtype, pin_memory=pin)
        offset = 0
        for i in indices:
            tensor = tensors[i]
            view = buffer[offset : offset + tensor.numel()].view(tensor.shape)
            with torch.no_grad():
                view.copy_(tensor)
            views[i] = view
            offset += tensor.numel()
    return [view for view in views if view is not None]


def flatten_slots(slots: Sequence[tuple[MutableMapping[Any, Any], Any]], pin: bool) -> None:
    """Put the tensors of ``slots`` (``container[key]``) into one flat buffer per dtype.

    A shard's optimizer state (every kind: AdamW's two moments of every parameter), so that it
    moves as one copy per dtype. Values are kept.
    """
    views = flat_views([container[key] for container, key in slots], pin)
    for (container, key), view in zip(slots, views, strict=True):
        container[key] = view
