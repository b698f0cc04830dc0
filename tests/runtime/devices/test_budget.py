"""The CUDA memory budget: arithmetic on given numbers (CPU), and the real GPU (``cuda``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sweepmaster.runtime.devices.budget import (
    DEFAULT_HEADROOM_FRACTION,
    HEADROOM_ENV,
    headroom_from_env,
    new_reservation_bytes,
    plan_cuda_budget,
)

GiB = 2**30
MiB = 2**20


def test_budget_leaves_out_the_context_the_workspaces_and_a_headroom() -> None:
    # an 80 GiB GPU: 0.5 GiB context, 1 GiB another process, 64 MiB cuBLAS workspace
    total, free, reserved = 80 * GiB, 80 * GiB - 1536 * MiB - 64 * MiB, 64 * MiB
    budget = plan_cuda_budget(total, free, reserved, None, headroom_fraction=0.1)
    assert budget.outside_bytes == 1536 * MiB
    assert budget.workspace_bytes == 64 * MiB
    assert budget.usable_bytes == free
    assert budget.budget_bytes == int(free * 0.9)
    assert budget.memory_fraction == pytest.approx((budget.budget_bytes + reserved) / total)
    assert budget.budget_bytes < budget.usable_bytes < total - budget.outside_bytes


def test_a_cap_below_the_usable_memory_bounds_budget_and_allocator_limit() -> None:
    budget = plan_cuda_budget(16 * GiB, 15 * GiB, 0, cap_bytes=4 * GiB, headroom_fraction=0.05)
    assert budget.usable_bytes == 4 * GiB
    assert budget.budget_bytes == int(4 * GiB * 0.95)
    assert budget.memory_fraction == pytest.approx(0.25 * 0.95)
    above = plan_cuda_budget(16 * GiB, 15 * GiB, 0, cap_bytes=64 * GiB, headroom_fraction=0.0)
    assert above.usable_bytes == above.budget_bytes == 15 * GiB  # the cap does not add memory


def test_the_allocator_is_capped_at_the_budget_not_above_it() -> None:
    # what the allocator may hold is the workspace plus the budget, to the byte
    total, free, reserved = 80 * GiB, 79 * GiB, 300 * MiB
    budget = plan_cuda_budget(total, free, reserved, cap_bytes=20 * GiB)
    allocator_bytes = budget.memory_fraction * total
    assert allocator_bytes == pytest.approx(reserved + budget.budget_bytes, abs=1)
    assert allocator_bytes < reserved + budget.usable_bytes - 1 * GiB


def test_default_headroom_is_between_five_and_ten_percent() -> None:
    assert 0.05 <= DEFAULT_HEADROOM_FRACTION <= 0.10
    budget = plan_cuda_budget(GiB, GiB, 0)
    assert budget.budget_bytes == int(GiB * (1 - DEFAULT_HEADROOM_FRACTION))


@pytest.mark.parametrize(
    ("total", "free", "reserved", "cap", "headroom", "match"),
    [
        (GiB, GiB, 0, None, 1.0, "fraction"),
        (GiB, GiB, 0, None, -0.1, "fraction"),
        (GiB, GiB, 0, 0, 0.1, "cap"),
        (GiB, 2 * GiB, 0, None, 0.1, "inconsistent"),
        (GiB, 0, 0, None, 0.1, "no GPU memory left"),
    ],
)
def test_impossible_budgets_are_refused(total, free, reserved, cap, headroom, match) -> None:
    with pytest.raises(ValueError, match=match):
        plan_cuda_budget(total, free, reserved, cap, headroom)


def test_headroom_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HEADROOM_ENV, raising=False)
    assert headroom_from_env() == DEFAULT_HEADROOM_FRACTION
    monkeypatch.setenv(HEADROOM_ENV, "0.05")
    assert headroom_from_env() == 0.05
    for bad in ("lots", "1.5"):
        monkeypatch.setenv(HEADROOM_ENV, bad)
        with pytest.raises(ValueError, match=HEADROOM_ENV):
            headroom_from_env()


def test_cached_free_blocks_are_reused_before_new_reservations() -> None:
    assert new_reservation_bytes(100, reserved_bytes=1000, allocated_bytes=960) == 60
    assert new_reservation_bytes(10, reserved_bytes=1000, allocated_bytes=500) == 0
    assert new_reservation_bytes(10, reserved_bytes=0, allocated_bytes=0) == 10


# ---------------------------------------------------------------------------- CUDA


@pytest.fixture
def gpu_limit_reset() -> Iterator[None]:
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


@pytest.mark.cuda
@pytest.mark.usefixtures("gpu_limit_reset")
def test_cuda_budget_is_measured_below_total_memory() -> None:
    from sweepmaster.runtime import CudaDevice

    device = CudaDevice("cuda:0", headroom_fraction=0.1)
    budget = device.cuda_budget
    total = torch.cuda.get_device_properties(0).total_memory
    assert budget.total_bytes == total
    assert budget.outside_bytes > 0  # the CUDA context at least
    assert device.budget_bytes == budget.budget_bytes < 0.9 * (total - budget.outside_bytes) + 1
    free, _ = torch.cuda.mem_get_info(0)
    assert budget.budget_bytes <= free + torch.cuda.memory_reserved(0)


@pytest.mark.cuda
@pytest.mark.usefixtures("gpu_limit_reset")
def test_cuda_meter_reads_reserved_memory() -> None:
    from sweepmaster.runtime import CudaDevice

    device = CudaDevice("cuda:0", memory_cap_bytes=1 * GiB)
    meter = device.meter
    meter.reset_peak()
    before = meter.live_bytes
    # the allocator may serve part of it from blocks it already holds (an expandable segment)
    cached_free = torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    assert meter.live_bytes >= before + 64 * MiB - cached_free
    assert meter.live_bytes >= torch.cuda.memory_allocated(0) - meter.baseline_bytes
    del x  # freed to the cache, still reserved: other jobs cannot have it
    assert meter.live_bytes >= before + 64 * MiB - cached_free
    assert meter.peak_bytes >= 64 * MiB - cached_free
    torch.cuda.empty_cache()
    assert meter.live_bytes == before
    with pytest.raises(torch.OutOfMemoryError):
        meter.reserve(2 * GiB)


@pytest.mark.cuda
@pytest.mark.usefixtures("gpu_limit_reset")
def test_cuda_cap_holds_during_compute() -> None:
    from sweepmaster.runtime import CudaDevice

    device = CudaDevice("cuda:0", memory_cap_bytes=512 * MiB, headroom_fraction=0.05)
    assert device.budget_bytes == int(512 * MiB * 0.95)
    x = torch.ones(1024, 1024, device="cuda:0")
    with pytest.raises(torch.OutOfMemoryError):  # not a promotion: compute past the cap
        torch.cat([x] * 200)  # 800 MiB
    y = torch.cat([x] * 100)  # 400 MiB fits
    assert y.shape[0] == 102400


def test_device_specs_take_a_headroom_for_their_gpus() -> None:
    from sweepmaster.runtime import parse_devices

    assert [d.name for d in parse_devices("cpu:2x1MiB", device_headroom=0.1)] == ["cpu:0", "cpu:1"]
    with pytest.raises(ValueError, match="headroom"):
        parse_devices("cpu", device_headroom=1.0)


@pytest.mark.cuda
@pytest.mark.usefixtures("gpu_limit_reset")
def test_a_gpu_parsed_with_a_headroom_budgets_by_it() -> None:
    from sweepmaster.runtime import CudaDevice, parse_devices

    (device,) = parse_devices("cuda:0", device_memory="1GiB", device_headroom=0.1)
    assert isinstance(device, CudaDevice) and device.headroom_fraction == 0.1
    assert device.budget_bytes == int(1 * GiB * 0.9)
