"""The fusion-degree cache and fused-array membership in the store (SQLite and PostgreSQL)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import sqlalchemy as sa

from sweepmaster.runtime.planning.fusion_degree import FusionMeasurement, with_step_seconds
from sweepmaster.store import create_store_engine, get_or_create_sweep, upgrade_to_head
from sweepmaster.store.fusion import (
    StoreFusionCache,
    count_fusion_measurements,
    fusion_groups,
    load_fusion_measurements,
    record_fusion_group,
    save_fusion_measurements,
)
from tests.kit.caches import KeyedCacheSuite
from tests.kit.threads import start_and_join

KEY = "3f9c0e1d2b4a5c6d/adamw/f1"
MEASURED = [
    FusionMeasurement(1, 1000.0, 90_000_000, True, 0.128),
    FusionMeasurement(2, 1700.5, 190_000_000, True, 0.301),
    FusionMeasurement(4, 0.0, 0, False, 0.0),
]


class TestStoreFusionCache(KeyedCacheSuite):
    """The fusion-degree cache on the store keeps the contract of every cache."""

    @pytest.fixture
    def cache(self, store_engine: sa.Engine) -> StoreFusionCache:
        return StoreFusionCache(store_engine)

    @pytest.fixture
    def values(self) -> tuple[list[FusionMeasurement], list[FusionMeasurement]]:
        stored = [dataclasses.replace(m, step_seconds=0.0) for m in MEASURED]  # as kept
        return stored, stored[:1]


def test_measurements_round_trip_and_the_first_saved_is_kept(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    cache = StoreFusionCache(engine)
    assert cache.get(KEY, 256 * 2**20, "cpu") is None
    cache.put(KEY, 256 * 2**20, "cpu", MEASURED)
    cache.put(KEY, 256 * 2**20, "cpu", MEASURED[:1])  # a later writer: kept as it was
    stored = cache.get(KEY, 256 * 2**20, "cpu")
    counts = cache.counts
    assert stored is not None
    assert (counts.num_hits, counts.num_misses, counts.num_saved) == (1, 1, 1)
    assert [(m.k, m.trials_tokens_per_s, m.peak_bytes, m.fits) for m in stored] == [
        (m.k, m.trials_tokens_per_s, m.peak_bytes, m.fits) for m in MEASURED]
    assert all(m.step_seconds == 0 for m in stored)  # not stored: it follows from the rate
    restored = with_step_seconds(stored, 64)
    assert [m.step_seconds for m in restored] == pytest.approx([0.064, 2 * 64 / 1700.5, 0.0])
    # other budgets, kinds and keys are other entries
    assert load_fusion_measurements(engine, KEY, 128 * 2**20, "cpu") is None
    assert load_fusion_measurements(engine, KEY, 256 * 2**20, "cuda:NVIDIA H100") is None
    assert count_fusion_measurements(engine) == 3


def test_concurrent_writers_leave_one_measurement(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    wrote: list[bool] = []
    lock = threading.Lock()

    def save() -> None:
        result = save_fusion_measurements(engine, KEY, 0, "cpu", MEASURED)
        with lock:
            wrote.append(result)

    start_and_join([threading.Thread(target=save) for _ in range(4)])
    assert sorted(wrote) == [False, False, False, True]
    assert count_fusion_measurements(engine) == len(MEASURED)


def test_fused_arrays_are_recorded_per_member(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    sweep = get_or_create_sweep(engine, "s", "s", "{}")
    record_fusion_group(engine, sweep.id, "trials-0+2", "3f9c0e1d2b4a5c6d", [2, 0])
    record_fusion_group(engine, sweep.id, "trials-1+3+4", "0123456789abcdef", [1, 3, 4])
    assert fusion_groups(engine, sweep.id) == {"trials-0+2": [0, 2], "trials-1+3+4": [1, 3, 4]}
    assert fusion_groups(engine, sweep.id + 1) == {}
