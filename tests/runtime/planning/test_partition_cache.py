"""The partition cache: cached_plan over the store's sm_partitions table."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
import torch

from sweepmaster.config import load_sweep_config
from sweepmaster.config.train_specs import TokenData, train_spec_from_config
from sweepmaster.runtime import VirtualDevice
from sweepmaster.runtime.planning.memplan import MemoryPlan, memory_plan_key
from sweepmaster.runtime.planning.partition import (
    PLAN_FORMAT_VERSION,
    cached_plan,
    device_kind,
    plan_cache_key,
)
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.store import create_store_engine, upgrade_to_head
from sweepmaster.store.partitions import (
    StorePlanCache,
    count_partitions,
    load_partition,
    save_partition,
)
from sweepmaster.workload import load_tokenizer
from sweepmaster.workload.architecture import architecture_key
from tests.kit.caches import KeyedCacheSuite
from tests.kit.spill import tiny_plan, tiny_spec
from tests.kit.sweeps import EXAMPLES
from tests.kit.threads import start_and_join

MiB = 2**20
SPILL_EXAMPLE = EXAMPLES / "spill-cpu.yaml"


def example_spec(batch_size: int):
    """The TrainSpec launch builds for one cell of examples/spill-cpu.yaml (data: zeros)."""
    trial = load_sweep_config(SPILL_EXAMPLE).with_params({"train.batch_size": batch_size})
    vocab = len(load_tokenizer(trial.data.tokenizer))
    blocks = torch.zeros((batch_size, trial.data.block_size), dtype=torch.int64)
    return train_spec_from_config(trial, TokenData(blocks, None, vocab))


class TestStorePlanCache(KeyedCacheSuite):
    """The partition cache on the store keeps the contract of every cache."""

    @pytest.fixture
    def cache(self, store_engine: sa.Engine) -> StorePlanCache:
        return StorePlanCache(store_engine)

    @pytest.fixture
    def values(self) -> tuple[JobPlan, JobPlan]:
        return tiny_plan(tiny_spec()), tiny_plan(tiny_spec(), budget=8 * MiB)


def test_cached_plan_is_keyed_by_budget_and_renamed_for_the_device(
        sqlite_url: str, counted_plans: list[str]) -> None:
    upgrade_to_head(sqlite_url)
    cache = StorePlanCache(create_store_engine(sqlite_url))
    spec = example_spec(8)
    first = cached_plan(spec, VirtualDevice("cpu:0", budget_bytes=256 * MiB), cache)
    other = cached_plan(spec, VirtualDevice("cpu:1", budget_bytes=256 * MiB), cache)
    smaller = cached_plan(spec, VirtualDevice("cpu:0", budget_bytes=240 * MiB), cache)
    counts = cache.counts
    assert counted_plans == ["cpu:0", "cpu:0"] and (counts.num_hits, counts.num_saved) == (1, 2)
    assert other.device == "cpu:1" and other.shards == first.shards
    assert len(smaller.shards) >= len(first.shards) and smaller.budget_bytes == 240 * MiB
    key = plan_cache_key(spec)
    assert key == f"{architecture_key(spec)}/mb8/adamw/estimate/p{PLAN_FORMAT_VERSION}"
    stored = load_partition(create_store_engine(sqlite_url), key, 256 * MiB, "cpu")
    assert stored is not None and JobPlan.from_json(stored).shards == first.shards


def test_two_writers_of_one_partition_leave_one_row(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    barrier = threading.Barrier(4)
    wrote: list[bool] = []
    failures: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            barrier.wait()
            wrote.append(save_partition(engine, "k/mb8/adamw/estimate/p1", 1024, "cpu",
                                        f'{{"writer": {index}}}'))
        except BaseException as err:  # noqa: BLE001 - reported below
            failures.append(err)

    start_and_join([threading.Thread(target=writer, args=(i,)) for i in range(4)])
    assert not failures
    assert sorted(wrote) == [False, False, False, True]
    assert count_partitions(engine) == 1
    assert not save_partition(engine, "k/mb8/adamw/estimate/p1", 1024, "cpu", "{}")  # idempotent


def test_an_unreadable_cached_plan_is_replaced(sqlite_url: str) -> None:
    upgrade_to_head(sqlite_url)
    engine = create_store_engine(sqlite_url)
    spec = example_spec(8)
    device = VirtualDevice("cpu:0", budget_bytes=256 * MiB)
    key = plan_cache_key(spec)
    save_partition(engine, key, device.budget_bytes, device_kind(device), '{"old": "format"}')
    cache = StorePlanCache(engine)
    plan = cached_plan(spec, device, cache)
    assert (cache.counts.num_misses, cache.counts.num_saved) == (1, 1)
    assert JobPlan.from_json(load_partition(engine, key, device.budget_bytes, "cpu")) == plan


def test_a_second_executor_reads_the_stacked_memory_plans_from_the_store(
        sqlite_url: str) -> None:
    """A spilled fused array's memory plan is kept per K beside its stacked partition, so a
    later process reads it instead of tracing the K members' shards again."""

    from sweepmaster.runtime import ShardExecutor
    from tests.kit.fused import BUDGET, member

    upgrade_to_head(sqlite_url)
    engine = create_store_engine(sqlite_url)
    spec = member(71)
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always",
                  plan_cache=StorePlanCache(engine)) as first:
        planned = {k: first.memory_plan(spec, k) for k in (2, 3)}
        stacked = {k: first.stacked_plan(spec, k) for k in (2, 3)}
    assert all(memory is not None for memory in planned.values())
    assert planned[2] != planned[3]
    key = plan_cache_key(spec)
    assert key is not None
    for k in (2, 3):  # a row per K: the stacked partition and its memory plan
        entry = (memory_plan_key(key, k), BUDGET, "cpu")
        assert entry[0] == f"{key}/x{k}"
        assert JobPlan.from_json(load_partition(engine, *entry) or "") == stacked[k]
        memory_json = load_partition(engine, *entry, "memory_plan_json")
        assert MemoryPlan.from_json(memory_json or "") == planned[k]
    rows = count_partitions(engine)
    assert rows == 2

    cache = StorePlanCache(engine)
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always", plan_cache=cache) as second:
        assert second.memory_plan(spec, 3) == planned[3]
        assert second.memory_plan(spec, 2) == planned[2]
        assert second.memory_plan(spec, 3) is second.memory_plan(spec, 3)  # kept in memory
    assert cache.num_memory_hits == 2  # each read from the store once, neither traced again
    assert count_partitions(engine) == rows
