"""One conformance suite over every causal LM family that spills: each path equals train_plain.

Tiny random models (no weights), dropout on where the family has it, a tied LM head where the
family ties by default (GPT-2, OPT) and for one Llama; over >= 2 shards on a virtual device.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from sweepmaster.config import parse_sweep_config
from sweepmaster.config.preflight import check_sweep
from sweepmaster.runtime import (
    Device,
    VirtualDevice,
    make_plan,
    profile_model,
    train_plain,
    train_spilled,
)
from sweepmaster.runtime.planning.memplan import plan_memory
from sweepmaster.runtime.planning.memprofile import profile_shards
from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.runtime.training.fused_shards import dropout_noise_bytes, stacked_profile
from sweepmaster.runtime.training.fused_spill import train_fused_spilled
from sweepmaster.runtime.training.layers import UnsupportedModelError, decompose
from sweepmaster.workload import OptimizerSpec, TrainSpec, build_model, lm_logits
from sweepmaster.workload.architecture import fusion_group_key, group_for_fusion
from sweepmaster.workload.families import FAMILIES
from tests.kit.fused import MARKS
from tests.kit.spill import MiB, Recorder
from tests.kit.sweeps import tiny_sweep
from tests.runtime.training.test_spill_resume import Crash, CrashAfter, _steps

pytestmark = MARKS

VOCAB = 101
CPU = Device("cpu")
CUTS = [0, 1, 3, 4]  # embed | block.0 block.1 | head: 3 shards
_DECODER = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 32, "vocab_size": VOCAB}

#: Per family (and one tied Llama): a tiny config with every dropout the family has.
CONFIGS: dict[str, dict] = {
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32,
             "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0,
             "resid_pdrop": 0.2, "attn_pdrop": 0.2, "embd_pdrop": 0.2},
    "llama": {"model_type": "llama", **_DECODER, "num_key_value_heads": 2,
              "attention_dropout": 0.2},
    "llama-tied": {"model_type": "llama", **_DECODER, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", **_DECODER, "num_key_value_heads": 2,
                "sliding_window": 8, "attention_dropout": 0.2},
    "qwen2": {"model_type": "qwen2", **_DECODER, "num_key_value_heads": 2,
              "attention_dropout": 0.2},
    "gpt_neox": {"model_type": "gpt_neox", **_DECODER,  # rotary on a quarter of each head
                 "hidden_dropout": 0.2, "attention_dropout": 0.2},
    "opt": {"model_type": "opt", "num_hidden_layers": 2, "hidden_size": 32,
            "num_attention_heads": 4, "ffn_dim": 64, "max_position_embeddings": 32,
            "vocab_size": VOCAB, "word_embed_proj_dim": 16, "dropout": 0.2,
            "attention_dropout": 0.2},
}
FAMILY_IDS = list(CONFIGS)


def config(family: str, **overrides) -> PretrainedConfig:
    kwargs = {**CONFIGS[family], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def blocks(num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_blocks, 16), generator=generator)


def spec(family: str, seed: int = 7, **overrides) -> TrainSpec:
    kwargs = {
        "model": config(family),
        "train_data": blocks(8, 123),  # batch 4: 2 steps per epoch
        "eval_data": blocks(3, 9),
        "optimizer": OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1, grad_clip=0.5,
                                   warmup_steps=1, schedule="cosine"),
        "batch_size": 4,
        "max_steps": 3,
        "eval_every": 2,
        "seed": seed,
        "name": f"{family}-{seed}",
    }
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


def plain(family: str):
    """Plain training's result, cached per intra-op thread count (it changes float sums)."""
    return _plain(family, torch.get_num_threads())


@functools.cache
def _plain(family: str, threads: int):
    return train_plain(spec(family), CPU)


@functools.cache
def profile(family: str):
    return profile_model(spec(family))


def job_plan(family: str, job: TrainSpec):
    device = VirtualDevice("cpu:plan", budget_bytes=4 * MiB)
    return make_plan(profile(family), job.optimizer, CUTS, device)


def assert_same_weights(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=atol,
                                   msg=lambda detail, name=name: f"{name}: {detail}")


def assert_same_run(result, expected) -> None:
    assert_same_weights(result.state_dict, expected.state_dict)
    for name in ("train_loss", "eval_loss"):
        assert result.history(name) == expected.history(name), name


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_the_layers_compose_to_the_model_forward(family: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(family))
    stack = decompose(model)
    assert stack.names == ("embed", "block.0", "block.1", "head")
    ids_BT = blocks(3, 1)
    for training in (False, True):
        model.train(training)
        torch.manual_seed(5)
        expected_BTV = lm_logits(model, ids_BT)
        torch.manual_seed(5)
        assert torch.equal(stack.forward(ids_BT), expected_BTV)
    tied = model.config.tie_word_embeddings
    head, embed = stack.layer_parameters(3), stack.layer_parameters(0)
    assert (head[-1] is embed[0]) == tied  # one nn.Parameter in two layers


def test_the_table_names_every_family_tested() -> None:
    assert {CONFIGS[f]["model_type"] for f in FAMILY_IDS} == set(FAMILIES)


def test_an_unsupported_family_names_the_supported_ones() -> None:
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gptj", n_layer=1, n_embd=32, n_head=2, rotary_dim=8, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModelError,
                       match=r"a 'gptj' model is not a supported causal LM family \(gpt2, "):
        decompose(model)


def test_layerdrop_is_refused() -> None:
    model = AutoModelForCausalLM.from_config(config("opt", layerdrop=0.1))
    with pytest.raises(UnsupportedModelError, match="layerdrop=0.1"):
        decompose(model)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_spilled_training_equals_plain_training(family: str) -> None:
    job = spec(family)
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = job_plan(family, job)
    result = train_spilled(job, device, plan)
    assert len(plan.shards) == 3 and result.num_promotes > 3 and result.swap_bytes > 0
    assert_same_run(result, plain(family))
    assert device.meter.live_bytes == 0


def mixed_memory_plan(family: str, job: TrainSpec, plan):
    """Swap and recompute in every shard, keep and swap mixed in the last one."""
    shards = profile_shards(job, plan, profile(family), bytes_per_s=1e9)
    decisions = []
    for shard_index, shard in enumerate(shards):
        row = []
        for layer_index, layer in enumerate(shard.layers):
            num_activations = len(layer.activations)
            if shard_index == len(shards) - 1:
                row.append(LayerDecision(False, tuple(i % 2 == 0 for i in range(num_activations))))
            elif (shard_index + layer_index) % 2:
                row.append(LayerDecision.recomputed(num_activations))
            else:
                row.append(LayerDecision.swap_all(num_activations))
        decisions.append(row)
    memory = plan_memory(job, plan, profile=profile(family), bandwidth=1e9,
                         budget_bytes=1 << 40, decisions=decisions)
    assert any("R" in s.codes for s in memory.shards) and any("S" in s.codes
                                                             for s in memory.shards)
    return memory


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_memory_planned_training_equals_plain_training(family: str) -> None:
    job = spec(family)
    plan = job_plan(family, job)
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    with warnings.catch_warnings():  # every layer saves what the profile's dry run counted
        warnings.filterwarnings("error", message=".*activations where the memory plan profiled")
        result = train_spilled(job, device, plan,
                               memory_plan=mixed_memory_plan(family, job, plan))
    assert_same_run(result, plain(family))
    assert device.meter.live_bytes == 0


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILY_IDS)
def test_memory_planned_training_on_cuda_equals_plain_training(family: str) -> None:
    from sweepmaster.runtime import CudaDevice

    job = spec(family)
    device = CudaDevice("cuda:0", memory_cap_bytes=64 * MiB)
    plan = make_plan(profile(family), job.optimizer, CUTS, device)
    result = train_spilled(job, device, plan, memory_plan=mixed_memory_plan(family, job, plan))
    expected = train_plain(job, device)
    assert_same_weights(result.state_dict, expected.state_dict, atol=1e-5)


#: OPT's token embedding has a padding row (``pad_token_id=1``): under ``vmap`` its zero gradient
#: holds for the first member only (PyTorch 2.13), so OPT trials never fuse (see below).
FUSING_FAMILIES = [f for f in FAMILY_IDS if f != "opt"]


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_a_model_with_a_padding_row_never_fuses(family: str) -> None:
    members = [spec(family, seed) for seed in (1, 2)]
    padded = FAMILIES[CONFIGS[family]["model_type"]].padded_tokens and (
        members[0].model.pad_token_id is not None)
    assert padded == (family == "opt")
    assert (fusion_group_key(members[0]) is None) == padded
    assert group_for_fusion(members, 2) == ([[0], [1]] if padded else [[0, 1]])
    if FAMILIES[CONFIGS[family]["model_type"]].padded_tokens:  # a pad token makes it padded
        config = copy.deepcopy(members[0].model)
        config.pad_token_id = 0
        assert fusion_group_key(dataclasses.replace(members[0], model=config)) is None


@pytest.mark.parametrize("path", ["resident", "spilled"])
@pytest.mark.parametrize("family", FUSING_FAMILIES)
def test_fused_pair_equals_each_member_trained_alone(family: str, path: str) -> None:
    members = [spec(family, seed, optimizer=OptimizerSpec(name="sgd", lr=lr, momentum=0.9))
               for seed, lr in ((1, 0.1), (2, 0.05))]
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    stacked = stacked_profile(profile(family), 2, dropout_noise_bytes(members[0]))
    # resident: one stacked shard holding the whole array (what the executor runs when it fits)
    cuts = [0, len(stacked.layers)] if path == "resident" else CUTS
    plan = make_plan(stacked, members[0].optimizer, cuts, device)
    results = train_fused_spilled(members, device, plan)
    assert device.meter.live_bytes == 0
    for member, result in zip(members, results, strict=True):
        assert result is not None
        expected = train_plain(member, CPU)
        assert_same_weights(result.state_dict, expected.state_dict, atol=1e-6)
        torch.testing.assert_close(torch.tensor(result.history("eval_loss")),
                                   torch.tensor(expected.history("eval_loss")),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_spilled_resume_equals_uninterrupted(family: str, tmp_path: Path) -> None:
    job = spec(family, state_dir=tmp_path / "state", checkpoint_every=2)
    with pytest.raises(Crash):
        train_spilled(job, VirtualDevice("cpu:0", budget_bytes=4 * MiB), job_plan(family, job),
                      CrashAfter(3))
    assert _steps(job.state_dir)[0] == 2
    torch.manual_seed(1234)  # the process's generator moved on meanwhile
    recorder = Recorder()
    resumed = train_spilled(job, VirtualDevice("cpu:0", budget_bytes=4 * MiB),
                            job_plan(family, job), recorder)
    assert recorder.starts[0].resumed_from_step == 2
    assert_same_run(resumed, plain(family))


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_a_sweep_of_every_family_passes_the_pre_launch_checks(family: str,
                                                              tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path)
    raw["model"] = {"config": {k: v for k, v in CONFIGS[family].items() if k != "vocab_size"}}
    check_sweep(parse_sweep_config(raw, "sweep.yaml"))


def test_a_pretrained_directory_picks_its_family(tmp_path: Path) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config("gpt_neox")).save_pretrained(tmp_path / "pythia")
    job = spec("gpt_neox", model=tmp_path / "pythia")
    stack = decompose(build_model(job.model))
    assert type(stack.model).__name__ == "GPTNeoXForCausalLM"
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    plan = make_plan(profile_model(job), job.optimizer, CUTS, device)
    assert_same_run(train_spilled(job, device, plan), train_plain(job, CPU))
