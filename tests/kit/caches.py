"""The plan and measurement caches: one suite every :class:`KeyedCache` passes, a dict double.

A cache's tests subclass :class:`KeyedCacheSuite` as ``Test<Cache>`` and give it two fixtures:
``cache`` (an empty cache) and ``values`` (two different values it can hold, as it returns
them). :class:`DictCache` is the in-memory double the executor's tests hand in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.kit.threads import start_and_join

__all__ = ["DictCache", "KeyedCacheSuite", "counted_plans"]


class DictCache:
    """A :class:`KeyedCache` on a dict; ``stored`` is what it keeps of a value (as a store would).

    Attributes:
        entries: The values by (key, budget bytes, device kind).
        num_gets: :meth:`get` calls.
        num_puts: :meth:`put` calls.
    """

    def __init__(self, stored: Callable[[Any], Any] = lambda value: value) -> None:
        self.stored = stored
        self.entries: dict[tuple[str, int, str], Any] = {}
        self.num_gets = self.num_puts = 0

    def get(self, key: str, budget_bytes: int, device_kind: str) -> Any:
        self.num_gets += 1
        return self.entries.get((key, budget_bytes, device_kind))

    def put(self, key: str, budget_bytes: int, device_kind: str, value: Any) -> None:
        self.num_puts += 1
        self.entries.setdefault((key, budget_bytes, device_kind), self.stored(value))


class KeyedCacheSuite:
    """The contract of :class:`~sweepmaster.runtime.planning.plans.KeyedCache`, per cache."""

    KEY = "3f9c0e1d2b4a5c6d/adamw/p1"

    @pytest.fixture
    def cache(self) -> Any:
        raise NotImplementedError("a Test<Cache> class gives its empty cache")

    @pytest.fixture
    def values(self) -> tuple[Any, Any]:
        raise NotImplementedError("a Test<Cache> class gives two values its cache holds")

    def test_a_miss_is_none(self, cache: Any) -> None:
        assert cache.get(self.KEY, 1024, "cpu") is None

    def test_a_value_put_is_got_back(self, cache: Any, values: tuple[Any, Any]) -> None:
        cache.put(self.KEY, 1024, "cpu", values[0])
        assert cache.get(self.KEY, 1024, "cpu") == values[0]

    def test_the_first_value_put_is_kept(self, cache: Any, values: tuple[Any, Any]) -> None:
        cache.put(self.KEY, 1024, "cpu", values[0])
        cache.put(self.KEY, 1024, "cpu", values[1])
        assert cache.get(self.KEY, 1024, "cpu") == values[0]

    def test_entries_differ_by_key_budget_and_device_kind(self, cache: Any,
                                                         values: tuple[Any, Any]) -> None:
        cache.put(self.KEY, 1024, "cpu", values[0])
        cache.put(self.KEY, 2048, "cuda", values[1])
        assert cache.get(self.KEY, 2048, "cuda") == values[1]
        assert cache.get(self.KEY, 2048, "cpu") is None
        assert cache.get(self.KEY, 1024, "cuda") is None
        assert cache.get("another/adamw/p1", 1024, "cpu") is None

    def test_concurrent_puts_of_one_entry_keep_one_value(self, cache: Any,
                                                         values: tuple[Any, Any]) -> None:
        failures: list[BaseException] = []

        def put(index: int) -> None:
            try:
                cache.put(self.KEY, 1024, "cpu", values[index % 2])
            except BaseException as err:  # noqa: BLE001 - reported below
                failures.append(err)

        start_and_join([threading.Thread(target=put, args=(i,)) for i in range(4)])
        assert not failures
        assert cache.get(self.KEY, 1024, "cpu") in values


@pytest.fixture
def counted_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count the real ``plan_job`` calls made through ``cached_plan`` (profiling runs)."""
    from sweepmaster.runtime.planning import partition

    calls: list[str] = []
    real = partition.plan_job

    def counting(spec, device, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(device.name)
        return real(spec, device, **kwargs)

    monkeypatch.setattr(partition, "plan_job", counting)
    return calls
