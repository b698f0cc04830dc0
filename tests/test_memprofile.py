"""Shard memory profiles: the CPU dry run (fake tensors) and the pilot pass on a device."""

from __future__ import annotations

import pytest
from test_spill import assert_weights, tiny_spec

from sweepmaster.runtime import VirtualDevice, make_plan, profile_model, train_plain
from sweepmaster.runtime.planning import memprofile
from sweepmaster.runtime.planning.memprofile import profile_shards

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
