"""Where a spilled job updates: bytes and seconds of the device and the host update."""

from __future__ import annotations

import dataclasses

import pytest

from sweepmaster.runtime.planning.packing import copy_bytes_per_s
from sweepmaster.runtime.planning.update_site import host_optimizer_bytes_per_s, update_cost
from sweepmaster.workload import OptimizerSpec
from tests.kit.spill import OPTIMIZERS, tiny_plan, tiny_spec

GB = 1e9


def shards(opt_name: str = "adamw"):
    return tiny_plan(tiny_spec(opt_name)).shards


def test_bytes_each_way_are_the_shards_state_parameters_and_gradients() -> None:
    plan_shards = shards()
    cost = update_cost(plan_shards, OPTIMIZERS["adamw"], "cuda", bandwidth_bytes_per_s=GB,
                       host_bytes_per_s=GB)
    owned = sum(s.owned_param_bytes for s in plan_shards)
    state = sum(s.optimizer_bytes for s in plan_shards)
    assert state == 2 * owned  # AdamW: two moments
    assert cost.device_bytes == 2 * state + owned  # state up and down, parameters back
    assert cost.host_bytes == owned  # the gradients home
    assert cost.device_s == pytest.approx(cost.device_bytes / GB)


def test_auto_updates_on_the_host_where_it_moves_fewer_bytes_and_is_no_slower() -> None:
    fast = update_cost(shards(), OPTIMIZERS["adamw"], "cuda", bandwidth_bytes_per_s=GB,
                       host_bytes_per_s=100 * GB)
    assert (fast.update_on, fast.reason, fast.compared) == ("host", "fewer bytes, no slower",
                                                            True)
    assert fast.host_s <= fast.device_s and fast.host_bytes < fast.device_bytes
    slow = update_cost(shards(), OPTIMIZERS["adamw"], "cuda", bandwidth_bytes_per_s=GB,
                       host_bytes_per_s=GB / 100)
    assert (slow.update_on, slow.reason) == ("device", "host step slower")
    plain_sgd = OptimizerSpec(name="sgd", lr=0.1)  # no momentum: no state to save moving
    sgd_shards = [dataclasses.replace(s, optimizer_bytes=0) for s in shards("sgd")]
    same = update_cost(sgd_shards, plain_sgd, "cuda", bandwidth_bytes_per_s=GB,
                       host_bytes_per_s=100 * GB)
    assert (same.update_on, same.reason) == ("device", "no fewer bytes")


def test_fits_clipped_and_virtual_devices_update_on_the_device() -> None:
    adamw = OPTIMIZERS["adamw"]
    one = update_cost(shards()[:1], adamw, "cuda", host_bytes_per_s=100 * GB)
    assert (one.update_on, one.reason) == ("device", "fits: one resident shard keeps its state")
    clipped = update_cost(shards(), OPTIMIZERS["adamw-clip"], "cuda", host_bytes_per_s=100 * GB)
    assert (clipped.update_on, clipped.reason) == ("device", "grad_clip defers updates")
    virtual = update_cost(shards(), adamw, "cpu", host_bytes_per_s=100 * GB)
    assert (virtual.update_on, virtual.reason) == ("device", "virtual device: one CPU")
    assert not virtual.compared and virtual.host_s == pytest.approx(
        virtual.host_bytes / copy_bytes_per_s("cpu"))
    forced = update_cost(shards(), adamw, "cpu", "host", host_bytes_per_s=GB / 100)
    assert (forced.update_on, forced.reason) == ("host", "forced")
    with pytest.raises(ValueError, match="update_on must be one of auto, device, host"):
        update_cost(shards(), adamw, "cuda", "cpu")


def test_host_throughput_is_measured_once_per_optimizer_kind() -> None:
    adamw = host_optimizer_bytes_per_s(OPTIMIZERS["adamw"])
    assert adamw > 0
    assert host_optimizer_bytes_per_s(dataclasses.replace(OPTIMIZERS["adamw"], lr=1.0)) == adamw
