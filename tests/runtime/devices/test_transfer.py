"""The transfer layer: batched, counted host <-> device copies and the pinned staging pool."""

from __future__ import annotations

import pytest
import torch

from sweepmaster.runtime import Device, VirtualDevice
from sweepmaster.runtime.devices.staging import StagingPool, pack_offsets
from sweepmaster.runtime.devices.transfer import (
    Transfer,
    TransferEngine,
    engine_for,
    settle_all,
)

MiB = 2**20


def test_pack_offsets_align_every_tensor() -> None:
    assert pack_offsets([]) == ([], 0)
    assert pack_offsets([10, 64, 3]) == ([0, 64, 128], 131)
    assert pack_offsets([4, 4], align=8) == ([0, 8], 12)


class _Event:
    """Stands in for a CUDA event: complete once ``fire`` ran."""

    def __init__(self) -> None:
        self.fired = False
        self.num_waits = 0

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.num_waits += 1
        self.fired = True


def test_staging_pool_reuses_blocks_and_waits_for_transfers_in_flight_when_full() -> None:
    pool = StagingPool(capacity_bytes=64 * 1024, pin=False)
    first = pool.acquire(5000)  # rounded to 8 KiB
    assert first.numel() == 8192 and pool.in_use_bytes == 8192
    pool.release(first)
    again = pool.acquire(6000)
    assert again.data_ptr() == first.data_ptr()  # reused, not reallocated
    assert pool.allocated_bytes == 8192
    big = pool.acquire(40_000)  # 64 KiB: the pool is full with ``again`` in use
    event = _Event()
    pool.track(Transfer(event, lambda: pool.release(big)))
    pool.release(again)
    third = pool.acquire(20_000)  # frees the idle 8 KiB block, waits for the big one, reuses it
    assert event.num_waits == 1 and third.data_ptr() == big.data_ptr()
    assert pool.allocated_bytes <= pool.capacity_bytes
    assert pool.peak_in_use_bytes == 8192 + 65536


def test_staging_pool_serves_one_request_larger_than_its_capacity() -> None:
    pool = StagingPool(capacity_bytes=4096, pin=False)
    block = pool.acquire(10_000)
    assert block.numel() >= 10_000
    pool.release(block)
    assert pool.allocated_bytes == 0  # over capacity: freed, not kept


def test_completed_transfers_return_their_blocks_on_the_next_acquire() -> None:
    pool = StagingPool(capacity_bytes=1 * MiB, pin=False)
    block = pool.acquire(4096)
    event = _Event()
    pool.track(Transfer(event, lambda: pool.release(block)))
    event.fired = True  # the copy completed; nobody waited yet
    assert pool.acquire(4096).data_ptr() == block.data_ptr()
    assert event.num_waits == 1


def test_engine_promotes_and_demotes_batches_counted_per_tensor() -> None:
    device = VirtualDevice("cpu:0", budget_bytes=1 * MiB)
    engine = engine_for(device)
    assert engine is device.transfer and engine.stream is None
    hosts = [torch.arange(6.0).reshape(2, 3), torch.arange(4, dtype=torch.int64)]
    copies = engine.promote(hosts)
    assert [torch.equal(c, h) for c, h in zip(copies, hosts, strict=True)] == [True, True]
    assert all(c.data_ptr() != h.data_ptr() for c, h in zip(copies, hosts, strict=True))
    assert device.meter.live_bytes == 24 + 32  # allocated on the device, metered
    stats = device.transfers
    assert (stats.promote_bytes, stats.num_promotes) == (56, 2)
    copies[0].add_(1)
    outs, transfer = engine.demote(copies, [hosts[0], None])
    transfer.wait()
    assert transfer.done and outs[0] is hosts[0]
    assert torch.equal(hosts[0], torch.arange(1.0, 7.0).reshape(2, 3))
    assert torch.equal(outs[1], hosts[1]) and not outs[1].is_pinned()
    assert (stats.demote_bytes, stats.num_demotes) == (56, 2)
    assert stats.swap_bytes == 112
    del copies
    assert device.meter.live_bytes == 0  # host copies are not on the device
    settle_all()


def test_the_host_cpu_transfers_in_place() -> None:
    host = Device("cpu")
    virtual = VirtualDevice("cpu:0", budget_bytes=MiB)
    assert host.transfer.in_place and not virtual.transfer.in_place
    tensors = [torch.ones(4), torch.zeros(2, dtype=torch.int64)]
    promoted = host.transfer.promote(tensors)
    assert all(p is t for p, t in zip(promoted, tensors, strict=True))  # no copy
    promoted[0].add_(1)
    hosts, transfer = host.transfer.demote(promoted, [t.data for t in tensors])  # the same memory
    assert transfer.done and torch.equal(hosts[0], torch.full((4,), 2.0))
    assert host.to_host(promoted[0]) is promoted[0]
    boundary = torch.empty(4)
    assert host.to_host(promoted[0], boundary) is boundary  # other host memory: copied
    assert torch.equal(boundary, torch.full((4,), 2.0))
    stats = host.transfers
    assert (stats.promote_bytes, stats.demote_bytes, stats.num_promotes, stats.num_demotes) == (
        0, 0, 0, 0)


def test_a_promotion_past_the_budget_raises_before_copying() -> None:
    device = VirtualDevice("cpu:1", budget_bytes=1000)
    with pytest.raises(torch.OutOfMemoryError, match="cpu:1 out of memory"):
        TransferEngine(device).promote([torch.zeros(200), torch.zeros(200)])
    assert device.transfers.num_promotes == 0


def test_devices_of_one_name_have_their_own_engines() -> None:
    first = VirtualDevice("cpu:0", budget_bytes=MiB)
    second = VirtualDevice("cpu:0", budget_bytes=2 * MiB)
    assert first == second and first.transfer is not second.transfer
    second.to_device(torch.zeros(8))
    assert first.transfers.num_promotes == 0 and second.transfers.num_promotes == 1


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_transfers_stage_pageable_state_through_a_bounded_pinned_pool() -> None:
    from sweepmaster.runtime import CudaDevice

    device = CudaDevice("cuda:0")
    engine = TransferEngine(device, staging_bytes=4 * MiB)
    hosts = [torch.randn(256, 1024) for _ in range(8)]  # 1 MiB each, pageable
    assert not any(h.is_pinned() for h in hosts)
    copies = engine.promote(hosts)
    for copy, host in zip(copies, hosts, strict=True):
        assert copy.is_cuda and torch.equal(copy.cpu(), host)
    assert engine.staging.allocated_bytes <= 8 * MiB  # one batch block at most
    for copy in copies:
        copy.mul_(2)
    outs, transfer = engine.demote(copies, hosts)
    del copies  # record_stream keeps the sources until the copy stream is done
    transfer.wait()
    for out, host in zip(outs, hosts, strict=True):
        assert out is host and not host.is_pinned()
    engine.promote(hosts)  # the demote's hosts are complete before they are read again
    assert device.transfers.num_promotes == 16 and device.transfers.num_demotes == 8


@pytest.mark.cuda
def test_cuda_demote_is_asynchronous_and_settled_before_host_reads() -> None:
    from sweepmaster.runtime import CudaDevice

    device = CudaDevice("cuda:0")
    engine = engine_for(device)
    value = torch.full((1024, 1024), 3.0, device="cuda")
    host = torch.zeros(1024, 1024)
    _, transfer = engine.demote([value], [host])
    settle_all()
    assert transfer.done and torch.equal(host, torch.full((1024, 1024), 3.0))


def _tiny_spilled_job():
    from sweepmaster.workload import OptimizerSpec, TrainSpec
    from tests.kit.models import random_blocks, tiny_gpt2

    return TrainSpec(
        model=tiny_gpt2(n_positions=32, vocab_size=97),
        train_data=random_blocks(8, seed=2, vocab_size=97),
        optimizer=OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1),
        batch_size=4,
        max_steps=3,
        seed=3,
    )


@pytest.mark.cuda
def test_cuda_spilled_job_moves_the_bytes_of_a_virtual_device_without_pinning_its_state() -> None:
    from sweepmaster.runtime import CudaDevice, make_plan, profile_model, train_plain
    from sweepmaster.runtime.training.spill import SpilledJob

    spec = _tiny_spilled_job()
    profile = profile_model(spec, 2)
    virtual = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    gpu = CudaDevice("cuda:0", memory_cap_bytes=256 * MiB)
    results = {}
    for device in (virtual, gpu):
        plan = make_plan(profile, spec.optimizer, [0, 1, 2, 3, 4], device)
        job = SpilledJob(spec, plan)
        while (task := job.next_task()) is not None:
            job.prefetch(job.peek_task(), device)
            job.run(task, device)
        assert not any(p.is_pinned() for p in job.members.model.parameters())
        results[device.name] = job.result()
    cpu, cuda = results["cpu:0"], results["cuda:0"]
    assert cuda.swap_bytes == cpu.swap_bytes
    assert gpu.transfers.promote_bytes == virtual.transfers.promote_bytes
    assert gpu.transfers.demote_bytes == virtual.transfers.demote_bytes
    staging = gpu.transfer.staging
    assert staging.allocated_bytes <= staging.capacity_bytes
    expected = train_plain(spec, gpu).state_dict
    for name, tensor in expected.items():
        torch.testing.assert_close(cuda.state_dict[name].cpu(), tensor.cpu(), rtol=1e-4, atol=1e-5)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


@pytest.mark.cuda
def test_a_promote_through_another_engine_waits_for_the_demote_writing_its_host() -> None:
    from sweepmaster.runtime import CudaDevice

    first, second = TransferEngine(CudaDevice("cuda:0")), TransferEngine(CudaDevice("cuda:0"))
    value = torch.full((2048, 1024), 5.0, device="cuda")
    host = torch.zeros(2048, 1024)  # pageable: written from staging once the copy is done
    first.demote([value], [host])
    (back,) = second.promote([host])
    assert torch.equal(back.cpu(), torch.full((2048, 1024), 5.0))


@pytest.mark.usefixtures("late_copy_thread")
def test_a_background_copy_frees_its_device_tensors_when_their_holder_drops_them() -> None:
    # the copy thread keeps nothing once a copy is done: metered bytes never depend on when
    # that thread runs again (a prefetched shard, a swapped activation)
    device = VirtualDevice("cpu:0", budget_bytes=MiB)
    engine = engine_for(device)
    hosts = [torch.arange(1024, dtype=torch.float32), torch.ones(256)]
    outs = engine.allocate(hosts)
    copies = engine.copy_in(outs, hosts, background=True).wait_device()
    assert [torch.equal(c, h) for c, h in zip(copies, hosts, strict=True)] == [True, True]
    assert device.meter.live_bytes == 5 * 1024
    del outs, copies
    assert device.meter.live_bytes == 0
    (source,) = engine.allocate([hosts[0]])
    source.fill_(2.0)
    (host,), transfer = engine.demote([source], [None], background=True)
    transfer.wait()
    assert torch.equal(host, torch.full((1024,), 2.0)) and transfer.done
    del source
    assert device.meter.live_bytes == 0
    assert device.transfers.promote_bytes == device.transfers.demote_bytes + 1024 == 5 * 1024
