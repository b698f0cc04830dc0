"""Fused arrays that fit their device (one stacked shard): per-member exactness against separate
training, members leaving, grouping, the fusion degree."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.planning import fusion_degree
from sweepmaster.runtime.planning.fusion_degree import (
    FusionMeasurement,
    choose_fusion_degree,
    fusion_cache_key,
    measure_fusion,
)
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.plain import train_plain
from sweepmaster.workload import OptimizerSpec
from sweepmaster.workload.architecture import architecture_key, group_for_fusion
from sweepmaster.workload.causal_lm import build_base
from tests.kit.fused import (
    CPU,
    MARKS,
    TIGHT,
    VOCAB,
    Recorder,
    assert_close_states,
    assert_same_events,
    random_blocks,
    spec,
    tiny_config,
    train_array,
)
from tests.kit.spill import OPTIMIZERS as SPILL_OPTIMIZERS

pytestmark = MARKS


def assert_same_history(actual, expected) -> None:
    """Same metric names at the same steps; values close (tokens_per_s is wall clock)."""
    assert [(p.step, p.name) for p in actual.metrics] == [
        (p.step, p.name) for p in expected.metrics
    ]
    for name in ("train_loss", "eval_loss", "eval_perplexity"):
        got, want = actual.history(name), expected.history(name)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert actual.history("lr") == expected.history("lr")
    assert actual.steps == expected.steps and actual.tokens == expected.tokens
    assert actual.pruned == expected.pruned
    assert actual.objective == pytest.approx(expected.objective, rel=1e-5)


# ---------------------------------------------------------------- whole runs vs train_plain


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fused_array_equals_train_plain_per_member(opt_name: str, tmp_path: Path) -> None:
    if opt_name == "sgd":
        opts = [
            dataclasses.replace(SPILL_OPTIMIZERS["sgd"], warmup_steps=2),
            OptimizerSpec(name="sgd", lr=0.1, grad_clip=0.3),
            OptimizerSpec(name="sgd", lr=0.02, momentum=0.5, schedule="cosine"),
        ]
    else:
        opts = [
            SPILL_OPTIMIZERS["adamw-clip"],
            OptimizerSpec(lr=1e-2),
            OptimizerSpec(lr=5e-3, betas=(0.9, 0.99), schedule="linear"),
        ]
    specs = [
        spec(7, opts[0], checkpoint_dir=tmp_path / "trial-7"),
        spec(8, opts[1], max_steps=3, eval_every=None),  # finishes early and leaves
        spec(9, opts[2], eval_every=None, metric="train_loss", max_steps=6),
    ]
    recorders = [Recorder() for _ in specs]
    results = train_array(specs, recorders)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trial-7", local_files_only=True)
    assert results[0].checkpoint_path == tmp_path / "trial-7"
    assert_close_states(reloaded.state_dict(), results[0].state_dict, rtol=0, atol=0)
    assert results[1].checkpoint_path is None
    for member, result, recorder in zip(specs, results, recorders, strict=True):
        plain_recorder = Recorder()
        expected = train_plain(
            dataclasses.replace(member, checkpoint_dir=None), CPU, plain_recorder
        )
        assert_same_events(recorder.events, plain_recorder.events)
        # AdamW divides by sqrt(v): where a gradient is rounding noise (attention key biases,
        # which softmax ignores) 1e-9 differences become lr-sized steps; observed <= 0.003 lr.
        atol = 1e-6 if opt_name == "sgd" else 1e-2 * member.optimizer.lr
        assert_close_states(result.state_dict, expected.state_dict, rtol=0, atol=atol)
        assert_same_history(result, expected)
        assert torch.equal(
            result.state_dict["lm_head.weight"], result.state_dict["transformer.wte.weight"]
        )


def test_dropout_is_per_member_and_equals_plain_dropout() -> None:
    config = tiny_config(dropout=0.2)
    specs = [spec(seed, model=config, max_steps=4) for seed in (1, 2)]
    results = train_array(specs)
    for member, result in zip(specs, results, strict=True):
        expected = train_plain(member, CPU)  # the member's own dropout stream
        assert_close_states(result.state_dict, expected.state_dict, **TIGHT)
        assert_same_history(result, expected)
    # dropout is really on (each member's own masks: tests/runtime/training/test_fused_spill.py)
    without = train_array([spec(1, max_steps=4)])[0]
    assert [v for _, v in results[0].history("train_loss")[1:]] != pytest.approx(
        [v for _, v in without.history("train_loss")[1:]], rel=1e-4
    )


def test_attention_dropout_of_a_factory_module_is_per_member() -> None:
    class DroppedAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.drop = nn.Dropout(0.3)

        def forward(self, x_BTC):
            q, k, v = self.qkv(self.drop(x_BTC)).unsqueeze(1).chunk(3, dim=-1)
            dropout_p = 0.25 if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            return y.squeeze(1)

    def tiny_attention() -> nn.Module:  # layers in forward order: the model splits into them
        return nn.Sequential(nn.Embedding(VOCAB, 16), DroppedAttention(), nn.Linear(16, VOCAB))

    tiny_attention.architecture_key = "tiny-attention-v2"  # type: ignore[attr-defined]
    specs = [spec(seed, model=tiny_attention, max_steps=3) for seed in (3, 4)]
    for member, result in zip(specs, train_array(specs), strict=True):
        expected = train_plain(member, CPU)
        assert_close_states(result.state_dict, expected.state_dict, **TIGHT)


def test_pretrained_directory_members_fuse(tmp_path: Path) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(dropout=0.1)).save_pretrained(tmp_path)
    specs = [spec(seed, model=str(tmp_path), max_steps=3) for seed in (1, 2)]
    assert architecture_key(specs[0]) == architecture_key(specs[1])
    for member, result in zip(specs, train_array(specs), strict=True):
        expected = train_plain(member, CPU)
        assert_close_states(result.state_dict, expected.state_dict, **TIGHT)


def test_model_with_other_randomness_refuses_to_fuse() -> None:
    class Noise(nn.Module):
        def forward(self, hidden):
            return hidden + 0.1 * torch.randn_like(hidden)

    def noisy() -> nn.Module:
        return nn.Sequential(nn.Embedding(VOCAB, 8), Noise(), nn.Linear(8, VOCAB))

    noisy.architecture_key = "noisy"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="cannot fuse.*randn"):
        train_array([spec(1, model=noisy), spec(2, model=noisy)])


def test_pruned_and_failed_members_leave_the_array() -> None:
    class PruneAtStep2(TrainCallbacks):
        def on_eval(self, event):
            return event.step >= 2

    specs = [
        spec(1),
        spec(2),
        spec(3, OptimizerSpec(name="sgd", lr=1e30)),  # diverges
    ]
    errors: dict[int, Exception] = {}

    def on_member_end(index, result, error):
        if error is not None:
            errors[index] = error

    results = train_array(specs, [None, PruneAtStep2(), None], on_member_end=on_member_end)
    assert results[2] is None and list(errors) == [2]
    assert isinstance(errors[2], FloatingPointError)
    assert re.search(r"trial-3.*non-finite train loss", str(errors[2]))
    assert results[1] is not None and results[1].pruned and results[1].steps == 2
    expected_pruned = train_plain(specs[1], CPU, PruneAtStep2())
    assert_close_states(results[1].state_dict, expected_pruned.state_dict, **TIGHT)
    assert results[0] is not None and results[0].steps == 5 and not results[0].pruned
    assert_close_states(results[0].state_dict, train_plain(specs[0], CPU).state_dict, **TIGHT)


# ---------------------------------------------------------------- grouping


def test_architecture_key_covers_what_must_match() -> None:
    base = spec(1)
    key = architecture_key(base)
    assert len(key) == 16 and key == architecture_key(spec(1))
    same = [
        spec(2, OptimizerSpec(lr=0.5, weight_decay=0.3)),
        spec(1, max_steps=9, eval_data=None),
        spec(1, train_data=random_blocks(20, seed=5)),
        spec(1, model=tiny_config(_name_or_path="elsewhere", bos_token_id=3)),
    ]
    assert all(architecture_key(s) == key for s in same)
    different = [
        spec(1, batch_size=2),
        spec(1, train_data=random_blocks(10, block_size=8)),
        spec(1, dtype="bfloat16"),
        spec(1, model=tiny_config(n_layer=3)),
        spec(1, model=tiny_config(dropout=0.1)),
        spec(1, model=tiny_config(vocab_size=VOCAB + 1)),
    ]
    keys = {architecture_key(s) for s in different}
    assert len(keys) == len(different) and key not in keys
    assert architecture_key(base, microbatch_size=1) != key


def test_factories_fuse_only_with_a_key() -> None:
    def factory() -> nn.Module:
        return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

    with pytest.raises(ValueError, match="architecture_key"):
        architecture_key(spec(1, model=factory))
    unkeyed = [spec(s, model=factory) for s in (1, 2)]
    assert group_for_fusion(unkeyed, max_k=4) == [[0], [1]]
    factory.architecture_key = "seq-v1"  # type: ignore[attr-defined]
    assert group_for_fusion(unkeyed, max_k=4) == [[0, 1]]


def test_group_for_fusion_rules() -> None:
    specs = [
        spec(0),
        spec(1, batch_size=2),  # other microbatch: never with 0
        spec(2),
        spec(3, OptimizerSpec(lr=1e-3)),  # adamw: another fused optimizer
        spec(4),
        spec(5, batch_size=2),
        spec(6),
        spec(7, train_data=random_blocks(10, block_size=8)),  # other sequence length
    ]
    assert group_for_fusion(specs, max_k=2) == [[0, 2], [1, 5], [3], [4, 6], [7]]
    assert group_for_fusion(specs, max_k=8) == [[0, 2, 4, 6], [1, 5], [3], [7]]
    assert group_for_fusion(specs, max_k=1) == [[i] for i in range(8)]
    with pytest.raises(ValueError, match="max_k"):
        group_for_fusion(specs, max_k=0)
    with pytest.raises(ValueError, match="architecture key"):
        SpilledFusedJob([spec(0), spec(1, batch_size=2)],
                        plan_stacked(spec(0), 2, CPU, whole=True))


# ---------------------------------------------------------------- fusion degree


def test_choose_fusion_degree_follows_the_measurements() -> None:
    def m(k: int, rate: float, fits: bool = True) -> FusionMeasurement:
        return FusionMeasurement(k, rate, 1000 * k, fits, 1.0)

    assert choose_fusion_degree([m(1, 100.0), m(2, 90.0), m(4, 80.0)]) == 1  # a CPU
    assert choose_fusion_degree([m(1, 100.0), m(2, 180.0), m(4, 300.0)]) == 4  # a GPU
    assert choose_fusion_degree([m(1, 100.0), m(2, 180.0), m(4, 300.0, fits=False)]) == 2
    assert choose_fusion_degree([m(1, 100.0), m(2, 100.0)]) == 1  # ties: smaller K
    with pytest.raises(ValueError, match="fits"):
        choose_fusion_degree([m(1, 100.0, fits=False)])


def test_measure_fusion_on_the_cpu() -> None:
    template = spec(0, batch_size=2)
    measurements = measure_fusion(template, CPU, ks=(2, 1), steps=1, rounds=1)
    assert [m.k for m in measurements] == [1, 2]
    for m in measurements:
        assert m.fits and m.trials_tokens_per_s > 0 and m.step_seconds > 0
        assert m.trials_tokens_per_s == pytest.approx(m.k * 2 * 16 / m.step_seconds)
    assert 0 < measurements[0].peak_bytes < measurements[1].peak_bytes
    json.dumps([dataclasses.asdict(m) for m in measurements], allow_nan=False)
    assert choose_fusion_degree(measurements) in (1, 2)

    # On a virtual device whose budget holds one model but not two, K = 2 hits the real OOM.
    budget = int(1.5 * measurements[0].peak_bytes)
    capped = measure_fusion(template, VirtualDevice("cpu:0", budget_bytes=budget), (1, 2, 4), 1)
    assert [(m.k, m.fits) for m in capped] == [(1, True), (2, False)]
    assert choose_fusion_degree(capped) == 1
    assert capped[1].step_seconds == 0 and capped[1].trials_tokens_per_s == 0
    json.dumps([dataclasses.asdict(m) for m in capped], allow_nan=False)
    over_budget = measure_fusion(template, CPU, (1, 2, 4), 1, budget_bytes=budget, rounds=1)
    assert [(m.k, m.fits) for m in over_budget] == [(1, True), (2, False)]
    assert over_budget[1].peak_bytes == measurements[1].peak_bytes > budget


def two_resident_steps_peak(array: SpilledFusedJob, device: VirtualDevice) -> int:
    """Peak bytes above what ``device`` held, metered over two steps of ``array`` kept resident.

    As the executor runs an array that fits; the array is released after.
    """
    meter = device.meter
    assert meter is not None
    start_bytes = meter.live_bytes
    meter.reset_peak()
    with meter.metering():
        array.run_step(device, keep=True)
        array.run_step(device, keep=True)
    array.store.release()
    return meter.peak_bytes - start_bytes


def test_measure_fusion_builds_each_k_once_with_the_seeded_builds_bytes(monkeypatch) -> None:
    from sweepmaster.runtime.training import members as members_module
    from sweepmaster.workload import causal_lm as causal_lm_module

    built: list[int] = []

    def counted_build_base(*args, **kwargs) -> nn.Module:
        base = build_base(*args, **kwargs)
        if next(base.parameters()).device.type != "meta":  # a template is not a member's base
            built.append(1)
        return base

    monkeypatch.setattr(members_module, "build_base", counted_build_base)  # K > 1
    monkeypatch.setattr(causal_lm_module, "build_base", counted_build_base)  # K = 1: build_model
    template = spec(0, batch_size=2, optimizer=OptimizerSpec(name="adamw", lr=1e-3))
    device = VirtualDevice("cpu:0", budget_bytes=1 << 30)
    measured = measure_fusion(template, device, (1, 2, 4), steps=2, rounds=3)
    assert [(m.k, m.fits) for m in measured] == [(1, True), (2, True), (4, True)]
    assert len(built) == 1 + 2 + 4  # one build per member and K, whatever the rounds

    # The placeholder weights take the bytes seeded weights took: the peak of two steps of a
    # seeded K = 2 array on one stacked shard, kept resident as the executor keeps it.
    members = [dataclasses.replace(template, seed=i, name=f"trial-0-{i}", eval_data=None,
                                   metric="train_loss") for i in (0, 1)]
    array = SpilledFusedJob(members, plan_stacked(members[0], 2, device, whole=True))
    assert measured[1].peak_bytes == two_resident_steps_peak(array, device)

    # A budget between K = 2's and K = 4's peaks stops the probe at K = 4 (the real OOM), and
    # the choice is the larger fitting K only if measured faster: here one of 1 and 2 as before.
    # A quarter of the way: halfway, K = 4 fits since its AdamW step works in place.
    budget = measured[1].peak_bytes + (measured[2].peak_bytes - measured[1].peak_bytes) // 4
    built.clear()
    capped = measure_fusion(template, VirtualDevice("cpu:0", budget_bytes=budget), (1, 2, 4, 8),
                            steps=1, rounds=1)
    assert [(m.k, m.fits) for m in capped] == [(1, True), (2, True), (4, False)]
    assert [m.peak_bytes for m in capped[:2]] == [m.peak_bytes for m in measured[:2]]
    assert len(built) <= 1 + 2 + 4
    assert choose_fusion_degree(capped) in (1, 2)


def test_measure_fusion_plans_and_times_at_the_executor_s_microbatch_size(monkeypatch) -> None:
    monkeypatch.setattr(fusion_degree, "FUSION_MEASURE_SHARE", None)  # however short the job
    # An executor with microbatch_size runs an array that fits as one stacked shard of
    # microbatches of that size; fusion is measured on the same job, and cached apart.
    from sweepmaster.runtime import ShardExecutor

    template = spec(0, batch_size=4)
    device = VirtualDevice("cpu:0", budget_bytes=1 << 30)
    whole = measure_fusion(template, device, (1, 2), steps=1, rounds=1)
    micro = measure_fusion(template, device, (1, 2), steps=1, rounds=1, microbatch_size=1)
    assert all(m.fits for m in whole + micro)
    assert all(a.peak_bytes < b.peak_bytes for a, b in zip(micro, whole, strict=True))

    # the peak of two steps of K = 2 at microbatch 1, as the executor plans the array
    members = [dataclasses.replace(template, seed=i, name=f"m{i}", eval_data=None,
                                   metric="train_loss") for i in (0, 1)]
    array = SpilledFusedJob(members, plan_stacked(members[0], 2, device, whole=True,
                                                  microbatch_size=1))
    assert micro[1].peak_bytes == two_resident_steps_peak(array, device)

    with ShardExecutor("cpu:1x1GiB", fusion="auto", microbatch_size=1) as executor:
        choice = executor.fusion_choice(template)
    assert choice.source == "measured"
    assert [m.peak_bytes for m in choice.measurements[:2]] == [m.peak_bytes for m in micro]
    assert fusion_cache_key(template, 1) == fusion_cache_key(template).replace("/f", "/mb1/f")
    assert fusion_cache_key(template, 4) == fusion_cache_key(template)


def test_members_report_as_they_leave_and_a_raising_callback_fails_alone() -> None:
    class Boom(TrainCallbacks):
        def on_eval(self, event):
            if event.step == 2:
                raise RuntimeError("broken callback")
            return False

    ended: list[tuple] = []

    def on_member_end(index, result, error):
        ended.append((index, None if result is None else result.steps, type(error).__name__))
        if error is not None:
            assert "broken callback" in str(error)

    specs = [spec(1, max_steps=3), spec(2), spec(3)]
    results = train_array(specs, [None, Boom(), None], on_member_end=on_member_end)
    assert ended == [(1, None, "RuntimeError"), (0, 3, "NoneType"), (2, 5, "NoneType")]
    assert results[1] is None
    expected = train_plain(specs[2], CPU)
    assert_close_states(results[2].state_dict, expected.state_dict, **TIGHT)
