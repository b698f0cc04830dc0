from __future__ import annotations

import resource

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config

from sweepmaster.runtime import (
    JobPlan,
    LayerTooLargeError,
    ModelProfile,
    UnsupportedModelError,
    VirtualDevice,
    decompose,
    make_plan,
    pilot_partition,
    plan_job,
    profile_model,
)
from sweepmaster.workload import OptimizerSpec, TrainSpec, lm_logits
from tests.kit.models import VOCAB, MiB, random_blocks, tiny_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")



def tiny_config(**overrides) -> GPT2Config:
    return tiny_gpt2(dropout=0.1, **{"n_layer": 3, **overrides})


def tiny_spec(**overrides) -> TrainSpec:
    kwargs = {"model": tiny_config(), "train_data": random_blocks(8), "batch_size": 4}
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


# ---------------------------------------------------------------- layers


def test_gpt2_decomposes_into_embedding_blocks_and_tied_head() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config())
    stack = decompose(model)
    assert stack.names == ("embed", "block.0", "block.1", "block.2", "head")
    wte = model.transformer.wte.weight
    assert any(p is wte for p in stack.layer_parameters(0))
    assert any(p is wte for p in stack.layer_parameters(4))  # tied: both ends use it
    names = stack.parameter_names()
    assert {names[id(p)] for i in range(len(stack)) for p in stack.layer_parameters(i)} == {
        name for name, _ in model.named_parameters()
    }
    input_ids_BT = random_blocks(3)
    for train in (False, True):
        model.train(train)
        torch.manual_seed(5)
        expected = lm_logits(model, input_ids_BT)
        torch.manual_seed(5)
        assert torch.equal(stack.forward(input_ids_BT), expected)  # same ops, same numbers


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)

    def forward(self, ids):
        return self.emb(ids)


def test_sequential_list_and_spill_layers_decompose() -> None:
    layers = [Embed(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, VOCAB)]
    sequential = nn.Sequential(*layers)
    assert decompose(sequential).names == ("0", "1", "2", "3")
    assert decompose(sequential).model is sequential
    stack = decompose(layers)
    assert stack.names == ("0:Embed", "1:Linear", "2:ReLU", "3:Linear")
    ids = random_blocks(2)
    assert torch.equal(stack.forward(ids), sequential(ids))

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleList(layers)

        def spill_layers(self):
            return list(self.parts)

    assert len(decompose(Custom())) == 4


def test_unsupported_model_says_how_to_supply_layers() -> None:
    with pytest.raises(UnsupportedModelError, match="nn.Sequential.*spill_layers"):
        decompose(nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="no layers"):
        decompose([])
    spec = tiny_spec(model=lambda: nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError):
        plan_job(spec, VirtualDevice("cpu:0", budget_bytes=MiB))


# ---------------------------------------------------------------- profile


def test_profile_counts_bytes_of_each_layer() -> None:
    spec = tiny_spec()
    profile = profile_model(spec, microbatch_size=2)
    assert [layer.name for layer in profile.layers] == ["embed", "block.0", "block.1", "block.2",
                                                        "head"]
    model = AutoModelForCausalLM.from_config(tiny_config())
    assert profile.total_param_bytes == sum(p.nbytes for p in model.parameters())
    embed, block, head = profile.layers[0], profile.layers[1], profile.layers[-1]
    assert embed.input_bytes == 2 * 16 * 8  # int64 ids of one microbatch
    assert embed.output_bytes == block.input_bytes == block.output_bytes == 2 * 16 * 32 * 4
    assert head.output_bytes == 2 * 16 * VOCAB * 4
    assert "transformer.wte.weight" in embed.param_names and "transformer.wte.weight" in (
        head.param_names
    )
    for layer in profile.layers:
        assert layer.saved_bytes >= layer.output_bytes or layer is head
        assert layer.backward_peak_bytes >= layer.saved_bytes
        assert layer.forward_s >= 0 and layer.backward_s >= 0
    assert ModelProfile.from_json(profile.to_json()) == profile
    measured = profile_model(spec, microbatch_size=2, measure=True)
    assert measured.source == "measured" and all(layer.forward_s > 0 for layer in measured.layers)
    assert [layer.saved_bytes for layer in measured.layers] == [
        layer.saved_bytes for layer in profile.layers
    ]


def test_an_estimated_profile_is_made_once_per_architecture_microbatch_and_device() -> None:
    first = profile_model(tiny_spec(), microbatch_size=2)
    # another spec of the architecture (seed, learning rate): the same profile
    same = tiny_spec(seed=7, optimizer=OptimizerSpec(lr=1e-3))
    assert profile_model(same, microbatch_size=2) is first
    assert profile_model(tiny_spec(), microbatch_size=1) is not first
    virtual = VirtualDevice("cpu:1", 8 * MiB)
    assert profile_model(tiny_spec(), microbatch_size=2, device=virtual) is not first
    other = profile_model(tiny_spec(model=tiny_config(n_embd=16)), microbatch_size=2)
    assert other.total_param_bytes < first.total_param_bytes
    measured = profile_model(tiny_spec(), microbatch_size=2, measure=True)
    assert measured is not profile_model(tiny_spec(), microbatch_size=2, measure=True)

    def factory() -> nn.Module:  # no architecture key: no stable identity
        return nn.Sequential(Embed(), nn.Linear(8, VOCAB))

    unkeyed = tiny_spec(model=factory)
    assert profile_model(unkeyed) is not profile_model(unkeyed)
    assert profile_model(unkeyed) == profile_model(unkeyed)


def test_gpt2_xl_is_estimated_without_allocating() -> None:
    spec = TrainSpec(
        model=GPT2Config(n_layer=48, n_embd=1600, n_head=25),
        train_data=torch.zeros(1, 1024, dtype=torch.int64),
        batch_size=1,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    profile = profile_model(spec)
    grown_bytes = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert 1.5e9 < profile.total_param_bytes / 4 < 1.6e9  # 1.5B float32 parameters
    assert grown_bytes < 1 * 2**30  # far less than the 6 GiB of weights
    plan = plan_job(spec, VirtualDevice("cpu:0", budget_bytes=2 * 2**30), profile=profile)
    assert plan.spill and len(plan.shards) > 3
    assert plan.plain_bytes > 4 * profile.total_param_bytes  # grads, AdamW state, activations
    assert max(s.backward_peak_bytes for s in plan.shards) <= 2 * 2**30


# ---------------------------------------------------------------- partition


def test_estimate_partition_fits_the_budget() -> None:
    spec = tiny_spec()
    profile = profile_model(spec)
    previous = None
    for budget in (500_000, 800_000, 1_600_000, 64 * MiB):
        device = VirtualDevice("cpu:0", budget_bytes=budget)
        plan = plan_job(spec, device, profile=profile)
        assert plan.shards[0].start == 0 and plan.shards[-1].stop == 5
        assert all(a.stop == b.start for a, b in zip(plan.shards, plan.shards[1:], strict=False))
        assert all(s.backward_peak_bytes <= budget for s in plan.shards)
        assert all(s.forward_peak_bytes <= budget for s in plan.shards)
        assert plan.peak_bytes <= budget
        assert plan.num_tasks_per_step == 2 * len(plan.shards) - 1
        assert len(plan.prefetch) == plan.num_tasks_per_step and not plan.prefetch[-1]
        assert plan.swap_bytes_per_step > 0 and plan.step_s > 0
        assert plan.shards[-1].forward_peak_bytes == 0  # the last shard has no forward task
        if previous is not None:
            assert len(plan.shards) <= len(previous.shards)
        previous = plan
    assert len(previous.shards) == 1 and not previous.spill
    assert JobPlan.from_json(previous.to_json()) == previous
    # a budget given (an executor's re-plan) plans as a device of that budget
    large = VirtualDevice("cpu:0", budget_bytes=64 * MiB)
    given = plan_job(spec, large, profile=profile, budget_bytes=500_000)
    assert given == plan_job(spec, VirtualDevice("cpu:0", budget_bytes=500_000), profile=profile)
    with pytest.raises(ValueError, match="budget_bytes needs method='estimate'"):
        plan_job(spec, large, profile=profile, budget_bytes=500_000, method="pilot")


def test_tied_weight_belongs_to_the_first_shard() -> None:
    spec = tiny_spec()
    profile = profile_model(spec)
    device = VirtualDevice("cpu:0", budget_bytes=MiB)
    plan = make_plan(profile, spec.optimizer, [0, 1, 4, 5], device)
    embed, head = plan.shards[0], plan.shards[-1]
    wte = profile.param_bytes["transformer.wte.weight"]
    assert embed.owned_param_bytes == embed.param_bytes >= wte
    assert head.param_bytes - head.owned_param_bytes == wte  # borrowed, updated by shard 0
    assert head.optimizer_bytes == 2 * head.owned_param_bytes  # step counters stay on the host


def test_layer_too_large_names_layer_bytes_and_budget() -> None:
    spec = tiny_spec()
    device = VirtualDevice("cpu:0", budget_bytes=200_000)
    message = r"layer 'block.0' needs 0\.\d+ MiB to train.*budget of 0\.191 MiB"
    with pytest.raises(LayerTooLargeError, match=message) as info:
        plan_job(spec, device)
    assert isinstance(info.value, ValueError)
    assert info.value.layer == "block.0" and info.value.budget_bytes == 200_000
    assert info.value.num_bytes > 200_000


def test_pilot_partition_cuts_where_the_pilot_runs_out_of_memory() -> None:
    sizes = [3, 4, 2, 5, 1]

    def oracle(limit: int):
        def fits(start: int, stop: int) -> int:
            need = sum(sizes[start:stop])
            if need > limit:
                raise torch.OutOfMemoryError("pilot")
            return need

        return fits

    assert pilot_partition(5, oracle(6), list("abcde"), 6) == [0, 1, 3, 5]
    assert pilot_partition(5, oracle(100), list("abcde"), 100) == [0, 5]
    with pytest.raises(LayerTooLargeError, match="'d'"):
        pilot_partition(5, oracle(4), list("abcde"), 4)


def test_pilot_pass_plan_fits_and_matches_estimate() -> None:
    spec = tiny_spec(optimizer=OptimizerSpec(name="sgd", momentum=0.9))
    device = VirtualDevice("cpu:0", budget_bytes=700_000)
    pilot = plan_job(spec, device, method="pilot")
    estimate = plan_job(spec, device)
    assert pilot.method == "pilot" and pilot.spill
    assert all(s.backward_peak_bytes <= 700_000 * 1.15 for s in pilot.shards)
    assert abs(len(pilot.shards) - len(estimate.shards)) <= 1
