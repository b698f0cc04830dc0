"""The partition cache: shard plans per (plan key, budget, device kind) in ``sm_partitions``.

Profiling and partitioning an architecture takes seconds (FakeTensor passes, a calibration
run); a sweep plans each architecture once per budget and every later launch, worker or
``sweepmaster plan`` reads the stored plan. The table's unique constraint on
``(architecture_key, budget_bytes, device_kind)`` makes saving idempotent and safe for writers in
several processes: the first plan saved is kept. Reads and writes are retried through a short
database outage (:mod:`sweepmaster.store.retry`).

:class:`StorePlanCache` is the store's implementation of the runtime's
:class:`~sweepmaster.runtime.planning.partition.PlanCache`, for
:func:`~sweepmaster.runtime.planning.partition.cached_plan`, and of its
:class:`~sweepmaster.runtime.planning.memplan.MemoryPlanCache`: a row's memory plan is the
keep / swap / recompute plan of its partition's activations. A spilled fused array of K stacked
members has rows of its own, keyed by
:func:`~sweepmaster.runtime.planning.memplan.memory_plan_key` (the plan key and ``/x{K}``):
its stacked partition and their memory plan.

Example:
    >>> cache = StorePlanCache(create_store_engine(url))  # doctest: +SKIP
    >>> plan = cached_plan(spec, device, cache)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

import sqlalchemy.exc
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Engine

from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.store.cache_counts import CacheCounts
from sweepmaster.store.models import Partition, utcnow
from sweepmaster.store.retry import run_with_retry

__all__ = [
    "StorePlanCache",
    "count_partitions",
    "delete_partition",
    "load_partition",
    "save_memory_plan",
    "save_partition",
]

_log = logging.getLogger(__name__)


def _where(key: str, budget_bytes: int, device_kind: str):  # noqa: ANN202
    return (
        Partition.architecture_key == key,
        Partition.budget_bytes == budget_bytes,
        Partition.device_kind == device_kind,
    )


def load_partition(engine: Engine, key: str, budget_bytes: int, device_kind: str,
                   column: Literal["plan_json", "memory_plan_json"] = "plan_json") -> str | None:
    """Return the stored plan JSON of an entry (or its memory plan's), or ``None``.

    Retried through a short database outage.

    Args:
        engine: An engine on a database at head (:func:`~sweepmaster.store.upgrade_to_head`).
        key: The plan key (:func:`~sweepmaster.runtime.planning.partition.plan_cache_key`).
        budget_bytes: The device budget in bytes.
        device_kind: :func:`~sweepmaster.runtime.planning.partition.device_kind` of the device.
        column: ``"plan_json"``: the shard plan; ``"memory_plan_json"``: the memory plan kept
            beside it (:func:`save_memory_plan`).

    Raises:
        StorageError: The database cannot be read.
    """
    query = select(getattr(Partition, column)).where(*_where(key, budget_bytes, device_kind))

    def read() -> str | None:
        with engine.connect() as connection:
            return connection.execute(query).scalar_one_or_none()

    return run_with_retry(read, "read the partition cache")


def save_partition(
    engine: Engine, key: str, budget_bytes: int, device_kind: str, plan_json: str
) -> bool:
    """Store a plan's JSON for an entry unless one is stored already (idempotent).

    Two processes saving the same entry at once leave one row; neither raises.

    Args:
        engine: An engine on a database at head.
        key: The plan key (at most 64 characters).
        budget_bytes: The device budget in bytes.
        device_kind: The device kind (at most 32 characters).
        plan_json: :meth:`~sweepmaster.runtime.planning.plans.JobPlan.to_json` of the plan.

    Returns:
        Whether this call wrote the row (``False``: an entry existed; it is kept).

    Raises:
        StorageError: The database rejected the write for another reason.
    """
    row = {"architecture_key": key, "budget_bytes": budget_bytes, "device_kind": device_kind,
           "plan_json": plan_json, "created_at": utcnow()}

    def write() -> bool:
        try:
            with engine.begin() as connection:
                connection.execute(insert(Partition).values(**row))
        except sqlalchemy.exc.IntegrityError:
            return False  # the unique constraint: another writer saved this entry first
        return True

    return run_with_retry(write, "write the partition cache")


def delete_partition(engine: Engine, key: str, budget_bytes: int, device_kind: str) -> bool:
    """Remove an entry (e.g. one an older version wrote and this one cannot read).

    Returns:
        Whether a row was removed.

    Raises:
        StorageError: The database rejected the write.
    """
    def write() -> bool:
        with engine.begin() as connection:
            return bool(connection.execute(
                delete(Partition).where(*_where(key, budget_bytes, device_kind))
            ).rowcount)

    return run_with_retry(write, "write the partition cache")


def save_memory_plan(
    engine: Engine, key: str, budget_bytes: int, device_kind: str, plan_json: str
) -> bool:
    """Store a memory plan's JSON beside the entry's partition (the last writer wins).

    Returns:
        Whether the entry exists (a memory plan is only kept beside its partition).

    Raises:
        StorageError: The database rejected the write.
    """
    statement = (update(Partition).where(*_where(key, budget_bytes, device_kind))
                 .values(memory_plan_json=plan_json))

    def write() -> bool:
        with engine.begin() as connection:
            return bool(connection.execute(statement).rowcount)

    return run_with_retry(write, "write the partition cache")


def count_partitions(engine: Engine) -> int:
    """Number of cached plans in the database."""
    with engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(Partition)).scalar_one())


class StorePlanCache:
    """A :class:`~sweepmaster.runtime.planning.partition.PlanCache` on the ``sm_partitions`` table.

    Thread-safe (each call is its own transaction) and safe across processes (see
    :func:`save_partition`). A row it cannot read (written by another plan format) counts as a
    miss and is replaced by the next :meth:`put`.

    Args:
        engine: An engine on a database at head.

    Attributes:
        counts: Its :meth:`get` calls that returned a plan (hits) or ``None`` (misses), and its
            :meth:`put` calls that wrote a row (saved).
        num_memory_hits: :meth:`get_memory_plan` calls that returned a memory plan.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._unreadable: set[tuple[str, int, str]] = set()
        self.counts = CacheCounts()
        self.num_memory_hits = 0

    def get(self, key: str, budget_bytes: int, device_kind: str) -> JobPlan | None:
        """Return the cached plan of an entry, or ``None`` (see the class doc).

        Raises:
            StorageError: The database cannot be read.
        """
        text = load_partition(self._engine, key, budget_bytes, device_kind)
        plan = None
        if text is not None:
            try:
                plan = JobPlan.from_json(text)
            except (TypeError, ValueError, KeyError) as err:
                _log.warning("ignoring an unreadable cached plan for %s: %s", key, err)
                with self._lock:
                    self._unreadable.add((key, budget_bytes, device_kind))
        self.counts.count_read(plan is not None)
        return plan

    def put(self, key: str, budget_bytes: int, device_kind: str, plan: JobPlan) -> None:
        """Store a plan for an entry; an existing readable entry is kept.

        Raises:
            StorageError: The database rejected the write.
        """
        entry = (key, budget_bytes, device_kind)
        with self._lock:
            stale = entry in self._unreadable
            self._unreadable.discard(entry)
        if stale:
            delete_partition(self._engine, *entry)
        self.counts.count_write(save_partition(self._engine, *entry, plan.to_json()))

    def get_memory_plan(self, key: str, budget_bytes: int, device_kind: str) -> MemoryPlan | None:
        """Return the memory plan kept beside an entry's partition, or ``None``.

        Raises:
            StorageError: The database cannot be read.
        """
        text = load_partition(self._engine, key, budget_bytes, device_kind, "memory_plan_json")
        if text is None:
            return None
        try:
            plan = MemoryPlan.from_json(text)
        except (TypeError, ValueError, KeyError) as err:
            _log.warning("ignoring an unreadable memory plan for %s: %s", key, err)
            return None
        with self._lock:
            self.num_memory_hits += 1
        return plan

    def put_memory_plan(
        self, key: str, budget_bytes: int, device_kind: str, plan: MemoryPlan
    ) -> None:
        """Keep a memory plan beside the entry's partition (replacing an older one).

        Raises:
            StorageError: The database rejected the write.
        """
        save_memory_plan(self._engine, key, budget_bytes, device_kind, plan.to_json())
