"""No host round trip inside a training step: host syncs counted, mask bytes counted."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config

from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.devices.host_syncs import HostSyncCounter, host_resident
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.spill import SpilledJob
from tests.kit.fused import BUDGET, member
from tests.kit.fused import tiny_config as fusion_config
from tests.kit.spill import CUTS, MiB, tiny_plan, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def syncs_per_step(job, device, steps: int = 3) -> list[dict[str, int]]:
    """The host syncs of each training step after the first (a warm-up), by call."""
    counted: list[dict[str, int]] = [{} for _ in range(steps - 1)]
    while (task := job.next_task()) is not None and task.step < steps:
        if task.step == 0 or task.phase != "train":
            job.run(task, device, keep=True)
            continue
        with HostSyncCounter() as counter:
            job.run(task, device, keep=True)
        for name, num in counter.counts.items():
            step = counted[task.step - 1]
            step[name] = step.get(name, 0) + num
    return counted


def test_the_counter_counts_what_would_wait_for_a_gpu() -> None:
    x = torch.arange(4.0)
    resident = host_resident(torch.ones(2))
    with HostSyncCounter() as counter:
        x.sum().item()
        bool((x > 0).all())
        x.tolist()
        torch.nonzero(x)
        (x * 2).sum()  # queued work: no sync
        resident.tolist()  # host memory on any device: no sync
    assert counter.total == 4
    assert counter.counts["aten._local_scalar_dense.default"] == 2


def test_a_resident_step_syncs_the_host_once() -> None:
    spec = tiny_spec("adamw")
    device = VirtualDevice("cpu:0", budget_bytes=16 * MiB)
    job = SpilledJob(spec, tiny_plan(spec, cuts=[0, len(CUTS)], budget=16 * MiB))
    assert len(job.plan.shards) == 1
    for step in syncs_per_step(job, device):
        assert step == {"wait:results": 1}  # where the step reports its loss


@pytest.mark.parametrize("opt_name", ["adamw", "adamw-clip"])
def test_a_spilled_step_with_microbatches_syncs_the_host_once(opt_name: str) -> None:
    spec = tiny_spec(opt_name)  # dropout 0.2 everywhere, a tied LM head across shards
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    job = SpilledJob(spec, tiny_plan(spec, microbatch_size=2))
    assert len(job.plan.shards) == 4 and job.plan.num_microbatches(1) == 2
    for step in syncs_per_step(job, device):
        assert step == {"wait:results": 1}


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_fused_step_syncs_the_host_once(clip: float | None) -> None:
    specs = [member(seed, "adamw") for seed in (1, 2)]
    specs = [dataclasses.replace(s, optimizer=dataclasses.replace(s.optimizer, grad_clip=clip))
             for s in specs]
    device = VirtualDevice("cpu:0", budget_bytes=3 * MiB // 2)
    plan = plan_stacked(specs[0], 2, device, microbatch_size=1)
    assert len(plan.shards) > 1
    for step in syncs_per_step(SpilledFusedJob(specs, plan), device):
        assert step == {"wait:results": 1}


def test_the_layers_of_a_pass_share_one_causal_mask() -> None:
    config = GPT2Config(**{**tiny_spec().model.to_dict(), "attn_implementation": "eager"})
    spec = tiny_spec("adamw", model=config)  # eager attention: a mask tensor, not is_causal
    device = VirtualDevice("cpu:0", budget_bytes=16 * MiB)
    job = SpilledJob(spec, tiny_plan(spec, cuts=[0, len(CUTS)], budget=16 * MiB))
    masks: list[torch.Tensor] = []
    for block in job.members.model.transformer.h:
        block.register_forward_pre_hook(
            lambda module, args, kwargs: masks.append(kwargs["attention_mask"]), with_kwargs=True)
    while (task := job.next_task()) is not None and task.phase != "train":
        job.run(task, device)
    assert task is not None
    masks.clear()
    job.run(task, device)  # one shard, one microbatch: one pass (forward, loss, backward)
    assert len(masks) == 3 and masks[0] is not None
    assert all(mask is masks[0] for mask in masks)


class _MaskCopies(TorchDispatchMode):
    """Bytes of bool / uint8 tensors copied (masks), by op."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in ("aten.copy_.default", "aten._to_copy.default", "aten._foreach_copy_.default"):
            sources = args[1] if name != "aten._to_copy.default" else args[0]
            for source in sources if isinstance(sources, (list, tuple)) else [sources]:
                if source.dtype in (torch.bool, torch.uint8):
                    self.bytes += source.nbytes
        return func(*args, **kwargs)


def _step_swap_bytes(dropout: float, plan) -> tuple[list[int], int]:
    specs = [dataclasses.replace(member(seed), model=fusion_config(dropout=dropout))
             for seed in (4, 5)]
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    job = SpilledFusedJob(specs, plan)
    with _MaskCopies() as copies:
        job.run_to_end(device)
    return job.bookkeeping.step_swap_bytes, copies.bytes


def test_a_fused_array_with_dropout_moves_no_mask_bytes() -> None:
    plan = plan_stacked(member(4), 2, VirtualDevice("cpu:0", budget_bytes=BUDGET),
                        microbatch_size=1)
    assert len(plan.shards) > 1
    with_dropout, mask_bytes = _step_swap_bytes(0.1, plan)
    without, _ = _step_swap_bytes(0.0, plan)
    assert mask_bytes == 0  # no mask is made, packed or copied, on the host or the device
    assert with_dropout == without  # dropout moves nothing between host and device


# ------------------------------------------------------------------ on a GPU


def _cuda_steps_without_syncs(job, device) -> None:
    task = job.next_task()
    while task is not None and (task.step == 0 or task.phase != "train"):  # warm-up step
        job.run(task, device, keep=True)
        task = job.next_task()
    assert task is not None
    step = task.step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while task is not None and task.step == step and task.phase == "train":
            job.run(task, device, keep=True)
            task = job.next_task()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_a_spilled_step_on_cuda_never_waits_for_the_gpu_inside() -> None:
    from sweepmaster.runtime import CudaDevice

    spec = tiny_spec("adamw")
    device = CudaDevice("cuda:0", memory_cap_bytes=256 * MiB)
    from sweepmaster.runtime import make_plan, profile_model

    plan = make_plan(profile_model(spec, 2), spec.optimizer, CUTS, device)
    _cuda_steps_without_syncs(SpilledJob(spec, plan), device)


@pytest.mark.cuda
def test_a_fused_step_on_cuda_never_waits_for_the_gpu_inside() -> None:
    from sweepmaster.runtime import CudaDevice

    specs = [member(seed, "adamw") for seed in (1, 2)]
    device = CudaDevice("cuda:0", memory_cap_bytes=256 * MiB)
    plan = plan_stacked(specs[0], 2, device, microbatch_size=1, budget_bytes=3 * MiB // 2)
    assert len(plan.shards) > 1
    _cuda_steps_without_syncs(SpilledFusedJob(specs, plan), device)
