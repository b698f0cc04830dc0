"""How a store cache was used: its reads that found an entry or not, and its writes.

The partition cache (:class:`~sweepmaster.store.partitions.StorePlanCache`) and the
fusion-degree cache (:class:`~sweepmaster.store.fusion.StoreFusionCache`) each hold one;
``sweepmaster plan`` reports them.
"""

from __future__ import annotations

import threading

__all__ = ["CacheCounts"]


class CacheCounts:
    """Counts of a cache's reads and writes; thread-safe (the caches are read from workers).

    Attributes:
        num_hits: Reads that found an entry.
        num_misses: Reads that found none.
        num_saved: Writes that stored a new entry.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0
        self.num_saved = 0

    def count_read(self, found: bool) -> None:
        """Count a read that found an entry (``found``) or none."""
        with self._lock:
            if found:
                self.num_hits += 1
            else:
                self.num_misses += 1

    def count_write(self, saved: bool) -> None:
        """Count a write that stored a new entry (``saved``; one that kept an entry is not)."""
        if saved:
            with self._lock:
                self.num_saved += 1
