"""What a plan reads: the devices a sweep trains on, and the storage's plan and fusion caches.

``plan`` never creates or changes a database: ``read_only=True`` caches are read, never written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy.exc
from sqlalchemy.engine import make_url

from sweepmaster.config.schema import SweepConfig
from sweepmaster.errors import DeviceError, StorageError
from sweepmaster.runtime.devices.device import Device, parse_devices
from sweepmaster.runtime.planning.fusion_degree import FusionCache
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.partition import PlanCache
from sweepmaster.store.cache_counts import CacheCounts

__all__ = ["open_devices", "open_fusion_cache", "open_plan_cache"]



def open_devices(config: SweepConfig, devices: str | None = None,
                 device_memory: str | int | None = None) -> list[Device]:
    """Open the devices of a sweep: ``devices`` / ``device_memory`` or its ``resources``.

    Args:
        config: The sweep.
        devices: A device spec overriding ``resources.devices`` (the CLI's ``--devices``).
        device_memory: A budget cap overriding ``resources.device_memory``.

    Returns:
        The devices.

    Raises:
        DeviceError: A device is not on this machine (e.g. ``cuda:1`` with one GPU), or the spec
            is invalid; the message names the file or option and the key.
    """
    spec = devices if devices is not None else config.resources.devices
    memory = device_memory if device_memory is not None else config.resources.device_memory
    where = "--devices" if devices is not None else f"{config.source}: resources.devices"
    try:
        return parse_devices(spec, memory)
    except ValueError as err:
        raise DeviceError(f"{where}: {err}") from None


def open_plan_cache(storage: str, *,
                    read_only: bool = False) -> tuple[PlanCache | None, str]:
    """The partition cache of a storage, if its database exists at head; never creates one.

    Args:
        storage: A storage URL.
        read_only: Open the database read-only and never write to it: new plans are not kept.

    Returns:
        ``(cache, note)``: the cache (or ``None``) and a few words on why it is (not) used.
    """
    from sweepmaster.store.partitions import StorePlanCache

    engine, note = _open_store(storage, read_only)
    if engine is None:
        return None, note
    cache = StorePlanCache(engine)
    return (_ReadOnlyPlanCache(cache) if read_only else cache), note


def open_fusion_cache(storage: str, *,
                      read_only: bool = False) -> tuple[FusionCache | None, str]:
    """The fusion-degree cache of a storage, if its database exists at head; never creates one.

    Returns:
        ``(cache, note)``, as :func:`open_plan_cache`.
    """
    from sweepmaster.store.fusion import StoreFusionCache

    engine, note = _open_store(storage, read_only)
    if engine is None:
        return None, note
    cache = StoreFusionCache(engine)
    return (_ReadOnlyCache(cache) if read_only else cache), note


class _ReadOnlyCache:
    """A store cache (of plans, or of fusion degrees) that is read and never written (``plan``)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.counts: CacheCounts = cache.counts  # never written through this one: 0 saved

    def get(self, key: str, budget_bytes: int, device_kind: str) -> Any:
        return self._cache.get(key, budget_bytes, device_kind)

    def put(self, key: str, budget_bytes: int, device_kind: str, value: Any) -> None:
        pass


class _ReadOnlyPlanCache(_ReadOnlyCache):
    """A partition cache that is read and never written, its memory plans too."""

    def get_memory_plan(self, key: str, budget_bytes: int, device_kind: str) -> MemoryPlan | None:
        return self._cache.get_memory_plan(  # type: ignore[no-any-return]
            key, budget_bytes, device_kind)

    def put_memory_plan(self, key: str, budget_bytes: int, device_kind: str,
                        plan: MemoryPlan) -> None:
        pass


def _open_store(storage: str, read_only: bool = False) -> tuple[Any, str]:
    """An engine on a storage whose database exists at head (else ``None``), and a note."""
    from sweepmaster.store import create_store_engine, current_revision, head_revision
    from sweepmaster.store.engine import create_read_only_engine, masked_url

    shown = masked_url(storage)
    try:
        url = make_url(storage)
    except sqlalchemy.exc.ArgumentError:
        return None, f"not used: invalid storage URL {shown}"
    if url.get_backend_name() == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            return None, f"not used: {shown} is not a database file"
        if not Path(database).is_file():
            return None, f"not used: no database at {shown} (plan creates none)"
    try:
        engine = create_read_only_engine(storage) if read_only else create_store_engine(storage)
        revision = current_revision(engine)
    except (StorageError, sqlalchemy.exc.DBAPIError) as err:
        return None, f"not used: {err}".splitlines()[0]
    if revision != head_revision():
        return None, (f"not used: {shown} has no sweepmaster tables at revision "
                      f"{head_revision()} (sweepmaster db upgrade creates them)")
    return engine, f"{shown}" + (" (read only)" if read_only else "")
