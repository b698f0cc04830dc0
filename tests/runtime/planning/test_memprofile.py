"""Shard memory profiles: the CPU dry run (fake tensors) and the pilot pass on a device."""

from __future__ import annotations

import pytest

from sweepmaster.runtime import VirtualDevice, make_plan, profile_model, train_plain
from sweepmaster.runtime.planning import memprofile
from sweepmaster.runtime.planning.memprofile import profile_shards
from tests.kit.spill import assert_weights, tiny_spec

MiB = 2**20
CUTS = [0, 1, 2, 4, 5]

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(spec, device, microbatch_size):
    return make_plan(profile_model(spec, microbatch_size), spec.optimizer, CUTS, device)


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_pilot_pass_on_a_device_sees_what_the_dry_run_sees_on_the_cpu(microbatch_size) -> None:
    spec = tiny_spec("adamw")  # dropout on: microbatches draw full-batch masks
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = _plan(spec, device, microbatch_size)
    profile = profile_model(spec, microbatch_size)
    fake = profile_shards(spec, plan, profile, device, bytes_per_s=1e9, on_device=False)
    real = profile_shards(spec, plan, profile, device, bytes_per_s=1e9, on_device=True)
    assert len(fake) == len(real) == 4
    for dry, pilot in zip(fake, real, strict=True):
        assert (dry.param_bytes, dry.grad_bytes, dry.update_peak_bytes) == (
            pilot.param_bytes,
            pilot.grad_bytes,
            pilot.update_peak_bytes,
        )
        for a, b in zip(dry.layers, pilot.layers, strict=True):
            # the same kernels save the same tensors (op times are roofline shares of the
            # layer's time, over the ops each pass dispatches: not compared)
            assert [(x.num_bytes, x.source, x.op) for x in a.activations] == [
                (x.num_bytes, x.source, x.op) for x in b.activations
            ]
            assert (a.input_bytes, a.output_bytes, a.swappable) == (
                b.input_bytes,
                b.output_bytes,
                b.swappable,
            )
            for peak in ("forward_peak_bytes", "grad_forward_peak_bytes", "backward_peak_bytes"):
                assert getattr(b, peak) == pytest.approx(getattr(a, peak), rel=0.02), peak
    assert sum(len(layer.activations) for shard in real for layer in shard.layers) > 10


def test_pilot_traces_are_cached_per_device_kind_and_layer_shape() -> None:
    spec = tiny_spec("sgd")
    device = VirtualDevice("cpu:1", budget_bytes=4 * MiB)
    plan = _plan(spec, device, None)
    profile = profile_model(spec, None)
    first = profile_shards(spec, plan, profile, device, bytes_per_s=1e9, on_device=True)
    cached = {key for key in memprofile._MEASURED if key[:2] == ("cpu", spec.batch_size)}
    assert cached  # one entry per distinct layer: embed, block, head
    again = profile_shards(spec, plan, profile, device, bytes_per_s=1e9, on_device=True)
    assert again == first
    assert {key for key in memprofile._MEASURED if key[:2] == ("cpu", spec.batch_size)} == cached


@pytest.mark.cuda
def test_memory_plan_measured_on_cuda_trains_exactly() -> None:
    import torch

    from sweepmaster.runtime import CudaDevice, plan_memory, train_spilled

    spec = tiny_spec("adamw")
    device = CudaDevice("cuda:0", memory_cap_bytes=64 * MiB)
    plan = _plan(spec, device, None)
    shards = profile_shards(spec, plan, profile_model(spec, None), device)  # on the GPU
    assert all(layer.activations for shard in shards for layer in shard.layers[1:])
    memory = plan_memory(spec, plan, device=device)
    result = train_spilled(spec, device, plan, memory_plan=memory)
    assert result.peak_device_bytes is not None
    assert result.peak_device_bytes <= device.budget_bytes
    expected = train_plain(spec, device)
    assert_weights(result.state_dict, expected.state_dict, exact=False)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_a_trace_beside_a_training_job_leaves_its_dropout_stream_alone() -> None:
    """A memory plan traced while a job with dropout trains on the device: weights unchanged.

    The interleaving is fixed by events, not timing: the trace stops inside its first layer's
    trace; the job then runs its first step and, inside its second (its dropout stream bound as
    the device's generator), lets the trace finish before it draws a mask.
    """
    import threading

    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    from sweepmaster.runtime import Device, plan_memory
    from sweepmaster.runtime.events import TrainCallbacks

    spec = tiny_spec("adamw", max_steps=3)  # dropout 0.2 everywhere
    other = tiny_spec("sgd", seed=11)
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = _plan(other, device, None)
    profile = profile_model(other, None)
    expected = train_plain(spec, Device("cpu"))

    trace_inside, job_inside, trace_done = (threading.Event() for _ in range(3))
    tracer = threading.current_thread()
    armed = {"trace": True, "job": False}

    def pause(module, args):  # a global forward hook: the first layer call of each side
        if threading.current_thread() is tracer and armed["trace"]:
            armed["trace"] = False
            trace_inside.set()
            assert job_inside.wait(60)
        elif threading.current_thread() is not tracer and armed["job"]:
            armed["job"] = False
            job_inside.set()
            assert trace_done.wait(60)

    class Steps(TrainCallbacks):
        def on_start(self, event):
            assert trace_inside.wait(60)

        def on_step(self, event):
            armed["job"] = event.step == 1

    results = []
    job = threading.Thread(target=lambda: results.append(train_plain(spec, device, Steps())))
    handle = register_module_forward_pre_hook(pause)
    try:
        job.start()
        plan_memory(other, plan, device=device, profile=profile, bandwidth=1e9)
        trace_done.set()
        job.join(120)
    finally:
        handle.remove()
        trace_done.set()
        job_inside.set()
    assert not job.is_alive() and len(results) == 1
    assert torch.is_tensor(next(iter(results[0].state_dict.values())))
    assert_weights(results[0].state_dict, expected.state_dict, exact=False)


def _attention_spec(dropout: float):
    import torch

    from tests.kit.spill import VOCAB, tiny_config

    config = tiny_config(n_layer=2, n_embd=64, n_head=4, n_positions=256, resid_pdrop=dropout,
                         attn_pdrop=dropout, embd_pdrop=dropout)
    blocks = torch.randint(0, VOCAB, (8, 256), generator=torch.Generator().manual_seed(0))
    return tiny_spec("adamw", model=config, train_data=blocks, batch_size=4)


def test_a_profile_for_cuda_traces_the_fused_attention_cuda_runs() -> None:
    """Dropout adds its masks, not the math path's (B, H, T, T) weights, to a CUDA estimate."""
    from sweepmaster.runtime.planning.profile import estimate_plain_bytes

    with_dropout, without = _attention_spec(0.1), _attention_spec(0.0)
    cuda = estimate_plain_bytes(with_dropout, "cuda")
    cpu = estimate_plain_bytes(with_dropout, "cpu")
    assert estimate_plain_bytes(without, "cuda") <= cuda <= 1.1 * estimate_plain_bytes(
        without, "cuda")
    assert cpu > 1.5 * cuda  # the CPU's math path keeps the attention weights and masks


@pytest.mark.cuda
def test_a_cuda_estimate_bounds_what_plain_training_takes_there() -> None:
    import torch

    from sweepmaster.runtime import CudaDevice
    from sweepmaster.runtime.planning.profile import estimate_plain_bytes
    from tests.kit.spill import VOCAB, tiny_config

    # wide enough that activations, not the allocator's workspaces, make the peak
    config = tiny_config(n_layer=4, n_embd=256, n_head=4, n_positions=256)  # dropout 0.2
    blocks = torch.randint(0, VOCAB, (16, 256), generator=torch.Generator().manual_seed(0))
    spec = tiny_spec("adamw", model=config, train_data=blocks, batch_size=8, max_steps=2,
                     eval_data=None, eval_every=None)
    device = CudaDevice("cuda:0")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    start = torch.cuda.memory_allocated(0)
    train_plain(spec, device)
    measured = torch.cuda.max_memory_allocated(0) - start
    estimate = estimate_plain_bytes(spec, "cuda")
    assert 0.75 * estimate <= measured <= 1.25 * estimate, (measured, estimate)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
