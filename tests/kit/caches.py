"""What the plan caches are asked: the real planning calls behind ``cached_plan``."""

from __future__ import annotations

import pytest

__all__ = ["counted_plans"]


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
