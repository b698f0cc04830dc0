"""The executor's planning settings: one value its plans, its jobs and re-planning all read."""

from __future__ import annotations

import pytest

from sweepmaster.runtime import ShardExecutor, VirtualDevice, parse_devices
from sweepmaster.runtime.execution.job_plans import PlanSettings
from sweepmaster.runtime.planning.partition import plan_job
from tests.kit.spill import tiny_spec

MiB = 2**20
BUDGET = 500_000  # bytes: the tiny GPT-2 needs 2.5x this and more to train plainly


def test_settings_keep_their_devices_and_plan_for_the_smallest_budget() -> None:
    large = VirtualDevice("cpu:0", budget_bytes=64 * MiB)
    small = VirtualDevice("cpu:1", budget_bytes=BUDGET)
    given = [large, small]
    settings = PlanSettings(given, pipeline=True)
    given.append(VirtualDevice("cpu:2", budget_bytes=BUDGET))  # not shared with the settings
    assert settings.devices == (large, small)
    assert settings.planning_device is small
    assert settings.metered
    assert settings.pipeline_devices == 2
    assert PlanSettings([large, small]).pipeline_devices == 0
    assert not PlanSettings(parse_devices("cpu")).metered


def test_spills_follows_the_spill_setting_and_never_on_the_host_cpu_by_default() -> None:
    spec = tiny_spec()
    small = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    spilled = plan_job(spec, small)
    whole = plan_job(spec, VirtualDevice("cpu:1", budget_bytes=64 * MiB))
    assert spilled.spill and not whole.spill
    metered = PlanSettings([small])
    assert metered.spills(spilled) and not metered.spills(whole)
    assert PlanSettings([small], spill="always").spills(whole)
    assert not PlanSettings([small], spill="never").spills(spilled)
    host = parse_devices("cpu")
    assert not PlanSettings(host).spills(spilled)
    assert PlanSettings(host, spill="always").spills(whole)


def test_invalid_settings_are_refused_as_the_executor_refuses_them() -> None:
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    with pytest.raises(ValueError, match="at least one device"):
        PlanSettings([])
    with pytest.raises(ValueError, match=r"devices must be distinct, got \['cpu:0', 'cpu:0'\]"):
        PlanSettings([device, device])
    with pytest.raises(ValueError, match="spill must be 'auto', 'always' or 'never', got 'no'"):
        PlanSettings([device], spill="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="devices must be distinct"):
        ShardExecutor([device, device])
    with pytest.raises(ValueError, match="spill must be"):
        ShardExecutor([device], spill="no")  # type: ignore[arg-type]


def test_update_on_places_every_plan_and_is_checked_up_front() -> None:
    spec = tiny_spec()
    small = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    spilled = plan_job(spec, small)
    assert len(spilled.shards) > 1 and spilled.update_on == "device"  # a virtual device's
    host = PlanSettings([small], update_on="host").placed(spilled, spec)
    assert host.update_on == "host" and host.swap_bytes_per_step < spilled.swap_bytes_per_step
    assert PlanSettings([small], update_on="host").placed(host, spec) == host
    assert PlanSettings([small]).placed(host, spec) == host  # auto: as planned
    assert PlanSettings([small], update_on="device").placed(host, spec).update_on == "device"
    with pytest.raises(ValueError, match="update_on must be one of"):
        ShardExecutor([small], update_on="cpu")
