"""Pinned host staging for the transfer layer: blocks bounded by what is in flight.

A CUDA copy between pageable host memory and a GPU goes through a pinned block (the copy engine
reads and writes only page-locked memory asynchronously). :class:`StagingPool` hands out such
blocks to :class:`~sweepmaster.runtime.devices.transfer.TransferEngine` batches, one per batch
with the batch's tensors packed in it (:func:`pack_offsets`, :func:`packed_views`), and takes
them back once the batch's copies completed, so pinned memory is bounded by the transfers in
flight, not by the state of every submitted job.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sweepmaster.runtime.devices.transfer import Transfer

__all__ = ["ALIGN_BYTES", "DEFAULT_STAGING_BYTES", "StagingPool", "pack_offsets", "packed_views"]

#: Byte alignment of each tensor packed into a staging block (any dtype's alignment divides it).
ALIGN_BYTES = 64
#: Default bound on the pinned staging memory of one GPU (bytes).
DEFAULT_STAGING_BYTES = 512 * 2**20


def pack_offsets(num_bytes: Sequence[int], align: int = ALIGN_BYTES) -> tuple[list[int], int]:
    """Byte offsets of tensors packed one after another into one block, each aligned.

    Args:
        num_bytes: Bytes of each tensor, in order.
        align: Alignment of every offset (bytes; a power of two).

    Returns:
        The offset of each tensor and the block's total bytes.

    Example:
        >>> pack_offsets([10, 64, 3])
        ([0, 64, 128], 131)
    """
    offsets = []
    end = 0
    for size in num_bytes:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + size
    return offsets, end


class StagingPool:
    """Pinned host blocks for copies in flight, bounded by ``capacity_bytes``.

    A block is handed out by :meth:`acquire` and comes back with :meth:`release` once the copy
    that used it has completed (the transfers given to :meth:`track` release their blocks when
    waited on; :meth:`acquire` waits on those that completed). Free blocks are reused (the
    smallest that fits); a request that would take the allocated bytes past the capacity first
    frees unused blocks, then waits for the oldest transfers in flight; a single request
    larger than the capacity gets a block of its own, freed on release.

    Args:
        capacity_bytes: Bound on the bytes of blocks kept (bytes).
        pin: Pin the blocks (CUDA); ``False`` for plain host memory (tests, CPU).
    """

    def __init__(self, capacity_bytes: int, pin: bool) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.pin = pin
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._in_flight: deque[Transfer] = deque()
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def track(self, transfer: Transfer) -> None:
        """Remember a transfer that holds blocks, so a full pool can wait for it."""
        with self._lock:
            self._in_flight.append(transfer)

    def acquire(self, num_bytes: int) -> torch.Tensor:
        """A ``uint8`` block of at least ``num_bytes`` (rounded up to a power of two >= 4 KiB)."""
        size = max(4096, 1 << (max(num_bytes, 1) - 1).bit_length())
        while True:
            with self._lock:
                finished = [t for t in self._in_flight if t.query()]
            for transfer in finished:  # their blocks come back
                transfer.wait()
            with self._lock:
                fits = [b for b in self._free if b.numel() >= size]
                if fits:
                    block = min(fits, key=torch.Tensor.numel)
                    self._free = [b for b in self._free if b is not block]
                    return self._use(block)
                while self._free and self.allocated_bytes + size > self.capacity_bytes:
                    self.allocated_bytes -= self._free.pop().numel()
                if self.allocated_bytes + size <= self.capacity_bytes or not self._in_flight:
                    self.allocated_bytes += size
                    block = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                    return self._use(block)
                oldest = self._in_flight.popleft()
            oldest.wait()  # its blocks come back; then try again

    def release(self, block: torch.Tensor) -> None:
        """Give a block back (its copy completed)."""
        with self._lock:
            self.in_use_bytes -= block.numel()
            if self.allocated_bytes <= self.capacity_bytes:
                self._free.append(block)
            else:
                self.allocated_bytes -= block.numel()
            self._in_flight = deque(t for t in self._in_flight if not t.done)

    def _use(self, block: torch.Tensor) -> torch.Tensor:
        self.in_use_bytes += block.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return block


def packed_views(block: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``block`` shaped and typed like ``tensors``, packed by :func:`pack_offsets`."""
    offsets, _ = pack_offsets([t.nbytes for t in tensors])
    return [
        block[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        for offset, t in zip(offsets, tensors, strict=True)
    ]
