from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM

from sweepmaster.runtime import (
    CudaDevice,
    Device,
    ShardExecutor,
    VirtualDevice,
    VirtualMeter,
    parse_devices,
    parse_size,
)
from sweepmaster.runtime.training.plain import build_optimizer
from sweepmaster.workload import OptimizerSpec, TrainSpec, causal_lm_loss, lm_logits
from tests.kit.models import MiB, random_blocks
from tests.kit.models import tiny_gpt2 as tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("1.5KiB", 1536),
        ("2GiB", 2 * 2**30),
        ("64MB", 64 * MiB),
        ("10B", 10),
    ],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["", "MiB", "-1MiB", "0", "12 parsecs", "1.5.2KiB", True, 8.5, None])
def test_parse_size_rejects(bad) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_parse_devices_specs() -> None:
    assert parse_devices("cpu") == [Device("cpu")]
    virtual = parse_devices("cpu:2x512MiB")
    assert [type(d) for d in virtual] == [VirtualDevice, VirtualDevice]
    assert [d.name for d in virtual] == ["cpu:0", "cpu:1"]
    assert [d.budget_bytes for d in virtual] == [512 * MiB] * 2
    assert all(d.torch_device == torch.device("cpu") for d in virtual)
    assert virtual[0].meter is not virtual[1].meter
    mixed = parse_devices("cpu:1x1KiB, cpu:2GiB, cpu")
    assert [d.name for d in mixed] == ["cpu:0", "cpu:1", "cpu"]
    assert [d.budget_bytes for d in mixed[:2]] == [1024, 2 * 2**30]
    assert isinstance(mixed[2], Device) and mixed[2].meter is None
    assert mixed[2].budget_bytes > 0  # the host: available RAM
    capped = parse_devices("cpu:2x512MiB", device_memory="256MiB")
    assert [d.budget_bytes for d in capped] == [256 * MiB] * 2
    host_capped = parse_devices("cpu", device_memory=64 * MiB)
    assert isinstance(host_capped[0], VirtualDevice) and host_capped[0].budget_bytes == 64 * MiB
    if not torch.cuda.is_available():
        assert parse_devices("auto") == [Device("cpu")]
        assert parse_devices("auto", device_memory="1GiB")[0].budget_bytes == 2**30
    else:
        assert isinstance(parse_devices("auto")[0], CudaDevice)
        assert parse_devices("cuda:0", device_memory="1GiB")[0].budget_bytes == 2**30


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("tpu", "unknown device"),
        ("", "empty"),
        ("cpu,,cpu", "empty"),
        ("cpu,cpu", "twice"),
        ("cuda:x", "unknown device"),
        ("cpu:0x1MiB", "no device"),
        ("cpu:2xfoo", "not a number of bytes"),
        ("cpu:2x", "unknown device|not a number"),
    ],
)

def test_parse_devices_errors(bad, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_devices(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_parse_devices_missing_cuda() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        parse_devices("cuda:0")


def test_devices_equal_by_name() -> None:
    a, b = VirtualDevice("cpu:0", budget_bytes=MiB), VirtualDevice("cpu:0", budget_bytes=2 * MiB)
    assert a == b and hash(a) == hash(b) and a != VirtualDevice("cpu:1", budget_bytes=MiB)
    with pytest.raises(ValueError, match="budget"):
        VirtualDevice("cpu:9", budget_bytes=0)


# ---------------------------------------------------------------- meter


def test_meter_counts_storages_once_and_releases_them() -> None:
    meter = VirtualMeter(MiB, "cpu:0")
    with meter.metering():
        x = torch.zeros(1024)  # 4 KiB
        view = x.view(32, 32)
        x.add_(1)  # in place: no new storage
        y = x * 2  # new storage
    assert meter.live_bytes == 8192 and meter.peak_bytes == 8192
    outside = torch.ones(256)  # not metered
    assert meter.live_bytes == 8192
    del y
    gc.collect()
    assert meter.live_bytes == 4096
    del x
    assert meter.live_bytes == 4096  # the view keeps the storage alive
    del view
    assert meter.live_bytes == 0 and meter.peak_bytes == 8192
    meter.reset_peak()
    assert meter.peak_bytes == 0
    meter.track(outside)
    meter.track(outside[:8])
    assert meter.live_bytes == 1024


def test_meter_raises_oom_and_stays_within_budget() -> None:
    meter = VirtualMeter(64 * 1024, "cpu:0")
    kept = []
    with pytest.raises(torch.OutOfMemoryError, match=r"cpu:0 out of memory.*budget of 0\.062 MiB"):
        with meter.metering():
            for _ in range(100):
                kept.append(torch.empty(4096))  # 16 KiB each
    assert len(kept) == 4 and meter.peak_bytes == 64 * 1024 <= meter.budget_bytes
    assert meter.num_ooms == 1 and meter.shortfall_bytes == 16 * 1024  # the fifth lacked it all
    with pytest.raises(torch.OutOfMemoryError):
        meter.reserve(1)
    assert meter.shortfall_bytes == 1
    kept.clear()
    assert meter.live_bytes == 0
    meter.reserve(64 * 1024)


def test_meter_unmetered_and_threads() -> None:
    meter = VirtualMeter(MiB)
    with meter.metering():
        with meter.unmetered():
            host = torch.empty(1000)
        device = torch.empty(10)
    assert meter.live_bytes == 40 and not meter.is_tracked(host)
    results = []

    def other_thread() -> None:  # the mode is per thread: another thread is not metered
        results.append(torch.empty(1000))

    with meter.metering():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert meter.live_bytes == 40
    del device


def test_transfers_are_real_copies_and_counted() -> None:
    device = VirtualDevice("cpu:0", budget_bytes=MiB)
    host = torch.arange(1000, dtype=torch.float32)
    copy = device.to_device(host)
    assert torch.equal(copy, host) and copy.data_ptr() != host.data_ptr()
    assert device.meter.live_bytes == 4000
    copy.mul_(2)
    back = device.to_host(copy)
    assert torch.equal(back, host * 2) and not device.meter.is_tracked(back)
    device.to_host(copy, out=host)
    assert torch.equal(host, back)
    stats = device.transfers
    assert (stats.promote_bytes, stats.demote_bytes) == (4000, 8000)
    assert (stats.num_promotes, stats.num_demotes, stats.swap_bytes) == (1, 2, 12000)
    with pytest.raises(torch.OutOfMemoryError):
        device.to_device(torch.empty(MiB // 4))
    del copy
    assert device.meter.live_bytes == 0


def test_meter_agrees_with_memtracker_on_a_plain_step() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(resid_pdrop=0.1, n_layer=3))
    model.train()
    params = list(model.parameters())
    optimizer = build_optimizer(params, OptimizerSpec(name="adamw", weight_decay=0.1))
    input_ids_BT = random_blocks(4, 32)

    def step() -> None:
        loss = causal_lm_loss(lm_logits(model, input_ids_BT), input_ids_BT)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # creates the optimizer state
    meter = VirtualMeter(1 << 40)
    meter.track(input_ids_BT)  # MemTracker counts module inputs too
    for param in params:
        meter.track(param)
    for state in optimizer.state.values():
        for value in state.values():
            meter.track(value)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker, meter.metering():
        step()
    tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert meter.peak_bytes == tracked
    state_bytes = sum(v.nbytes for s in optimizer.state.values() for v in s.values())
    assert meter.peak_bytes > sum(p.nbytes for p in params) + state_bytes


# ---------------------------------------------------------------- executor


def test_plain_oom_on_a_virtual_device_fails_alone() -> None:
    spec = TrainSpec(model=tiny_config(), train_data=random_blocks(4), batch_size=2, max_steps=1)
    with ShardExecutor("cpu:1x256KiB", spill="never") as executor:
        with pytest.raises(torch.OutOfMemoryError, match="cpu:0 out of memory"):
            executor.fit(spec)
        assert executor.devices[0].meter.live_bytes == 0
    with ShardExecutor("cpu:1x64MiB") as executor:  # fits: one shard, metered, promoted once
        result = executor.fit(spec)
    assert result.steps == 1 and result.num_promotes == 1
    assert result.peak_device_bytes is not None and 0 < result.peak_device_bytes <= 64 * MiB
