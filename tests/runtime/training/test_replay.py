"""Dropout replay per microbatch, attention dropout included (exact against plain training)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config

from sweepmaster.runtime import (
    Device,
    SpilledJob,
    VirtualDevice,
    make_plan,
    plan_memory,
    profile_model,
    train_plain,
)
from sweepmaster.runtime.training.replay import JobRng, RandomReplay, pads_attention
from sweepmaster.workload import OptimizerSpec, TrainSpec
from tests.kit.models import random_blocks, tiny_gpt2

MiB = 2**20
VOCAB = 97

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pads_attention_only_for_microbatches_and_by_default_off_the_cpu() -> None:
    assert not pads_attention("cuda", slice(0, 4), 4, None)
    assert not pads_attention("cuda", slice(0, 4), 4, True)
    assert pads_attention("cuda", slice(2, 4), 4, None)
    assert not pads_attention("cpu", slice(2, 4), 4, None)
    assert pads_attention("cpu", slice(2, 4), 4, True)
    assert not pads_attention("cuda", slice(2, 4), 4, False)


def _attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.3)


@pytest.mark.parametrize("with_mask", [False, True])
def test_padded_attention_draws_the_full_batch_masks_forward_and_backward(with_mask) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 6, 4, generator=generator) for _ in range(3))
    mask = torch.rand(5, 1, 6, 6, generator=generator) > 0.3 if with_mask else None
    if mask is not None:
        mask[..., 0] = True  # no row masked entirely
    grad_out = torch.randn(5, 2, 6, 4, generator=generator)
    start = torch.Generator().manual_seed(11).get_state()

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    reference = torch.Generator()
    reference.set_state(start)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(reference.get_state())
        out_full = _attention(*full, mask)
        end = torch.get_rng_state()
    out_full.backward(grad_out)

    rng = JobRng("cpu", start)
    tape: list[torch.Tensor] = []
    for index, rows in enumerate([slice(0, 2), slice(2, 4), slice(4, 5)]):
        part = [t[rows].clone().requires_grad_(True) for t in (q, k, v)]
        part_mask = mask[rows] if mask is not None else None
        replay = RandomReplay(rng, tape, index == 0, rows, 5, restore=False, pad_attention=True)
        with replay:
            out = _attention(*part, part_mask)
        assert replay.site == 1  # one random op, drawn at the full batch's shape
        out.backward(grad_out[rows])
        torch.testing.assert_close(out, out_full[rows], rtol=0, atol=1e-6)
        for mine, theirs in zip(part, full, strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad[rows], rtol=0, atol=1e-6)
    assert torch.equal(rng.saved_state(), end)  # the stream advanced as plain's single pass


def test_calls_without_dropout_pass_through_unpadded() -> None:
    rng = JobRng("cpu", torch.Generator().manual_seed(1).get_state())
    q = torch.randn(2, 2, 3, 4)
    with RandomReplay(rng, [], True, slice(0, 2), 4, restore=False, pad_attention=True) as r:
        out = F.scaled_dot_product_attention(q, q, q)
    assert out.shape == q.shape and r.site == 0


def tiny_spec(**overrides) -> TrainSpec:
    config = tiny_gpt2(dropout=0.0, n_positions=32, vocab_size=VOCAB, attn_pdrop=0.3)
    kwargs = {
        "model": config,
        "train_data": random_blocks(8, seed=5, vocab_size=VOCAB),
        "optimizer": OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1),
        "batch_size": 4,
        "max_steps": 3,
        "seed": 3,
    }
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


def _run(job: SpilledJob, device: Device) -> dict[str, torch.Tensor]:
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)
        job.run(task, device)
    return job.result().state_dict


@pytest.mark.parametrize("memory", [False, True])
def test_spilled_microbatches_with_attention_dropout_equal_plain_training(memory) -> None:
    spec = tiny_spec()
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    profile = profile_model(spec, 2)
    plan = make_plan(profile, spec.optimizer, [0, 1, 2, 3, 4], device)
    assert plan.num_microbatches(1) == 2
    memory_plan = plan_memory(spec, plan, device=device) if memory else None
    job = SpilledJob(spec, plan, memory_plan=memory_plan)
    # the path CUDA's fused attention kernels take, run on the CPU
    job.members.pad_attention = True
    actual = _run(job, device)
    expected = train_plain(spec, Device("cpu")).state_dict
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():  # 2 microbatches: float sums reordered
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-5, msg=name)
    assert device.meter.live_bytes == 0


@pytest.mark.cuda
def test_spilled_microbatches_with_fused_attention_dropout_equal_plain_training_on_cuda() -> None:
    from sweepmaster.runtime import CudaDevice

    config = GPT2Config(**{**tiny_spec().model.to_dict(), "attn_pdrop": 0.1})
    spec = tiny_spec(model=config)  # GPT-2's default attn_pdrop, inside the fused SDPA kernel
    device = CudaDevice("cuda:0", memory_cap_bytes=256 * MiB)
    profile = profile_model(spec, 2)
    plan = make_plan(profile, spec.optimizer, [0, 1, 2, 3, 4], device)
    assert plan.num_microbatches(1) == 2
    actual = _run(SpilledJob(spec, plan), device)  # pads attention by default on CUDA
    expected = train_plain(spec, device).state_dict
    for name, tensor in expected.items():  # 2 microbatches: float sums reordered (H200: 1.1e-5)
        torch.testing.assert_close(actual[name].cpu(), tensor.cpu(), rtol=1e-4, atol=5e-5)


def test_microbatches_without_attention_dropout_run_the_fused_cpu_kernel() -> None:
    # attn_pdrop 0: CPU SDPA picks its flash kernel, a seeded op that draws nothing
    config = GPT2Config(**{**tiny_spec().model.to_dict(), "attn_pdrop": 0.0, "resid_pdrop": 0.2})
    spec = tiny_spec(model=config)
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = make_plan(profile_model(spec, 2), spec.optimizer, [0, 1, 2, 3, 4], device)
    actual = _run(SpilledJob(spec, plan), device)
    expected = train_plain(spec, Device("cpu")).state_dict
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_full_batch_passes_of_a_device_stream_replay_by_state_without_a_mode() -> None:
    from sweepmaster.runtime.training.replay import replays_by_state

    assert replays_by_state("cuda", slice(0, 4), 4, metered=False)
    assert not replays_by_state("cuda", slice(0, 2), 4, metered=False)  # per-op full-batch masks
    assert not replays_by_state("cuda", slice(0, 4), 4, metered=True)
    assert not replays_by_state("cpu", slice(0, 4), 4, metered=False)  # generator argument


class _DefaultGeneratorStream(JobRng):
    """A device-like stream: ops draw from the default generator (as CUDA's do), here the CPU's."""

    def __init__(self) -> None:
        super().__init__("cpu", torch.default_generator.get_state())
        self.device_type = "device"
        self.generator = torch.default_generator


def test_replay_by_state_recomputes_from_a_layer_and_restores_the_stream() -> None:
    layers = [torch.nn.Dropout(0.5), torch.nn.Linear(8, 8), torch.nn.Dropout(0.3)]
    x = torch.randn(4, 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        rng = _DefaultGeneratorStream()
        tape: list[torch.Tensor] = []
        outputs, sites = [], []
        with RandomReplay(rng, tape, True, slice(0, 4), 4, restore=False) as replay:
            assert replay.by_state
            y = x
            for layer in layers:
                sites.append(replay.site)
                y = layer(y)
                outputs.append(y)
        after = torch.get_rng_state()
        torch.manual_seed(99)  # the stream moved on (e.g. another layer's pass)
        for position in (0, 2):
            moved = torch.get_rng_state()
            recompute = RandomReplay(rng, tape, False, slice(0, 4), 4, restore=True)
            recompute.site = sites[position]  # before entering, as a layer's recompute does
            with recompute:
                y = outputs[position - 1] if position else x
                for layer in layers[position:]:
                    y = layer(y)
            assert torch.equal(y, outputs[-1])  # the same masks from the layer on
            assert torch.equal(torch.get_rng_state(), moved)  # restored
        with RandomReplay(rng, tape, False, slice(0, 4), 4, restore=False):
            pass
        assert torch.equal(torch.get_rng_state(), after)  # a full replay ends where plain did
