"""The tiny spilled job: a 3-layer GPT-2 with dropout, cut into 4 shards on a virtual device.

Its optimizers, spec, profile and plan, plain training's result for it, and the checks that a
spilled run ends as plain training does.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
from transformers import GPT2Config

from sweepmaster.runtime import (
    Device,
    EvalEvent,
    StepEvent,
    TrainCallbacks,
    VirtualDevice,
    make_plan,
    profile_model,
    train_plain,
)
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory
from sweepmaster.runtime.planning.memprofile import profile_shards
from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.workload import OptimizerSpec, TrainSpec
from tests.kit.models import VOCAB, MiB, random_blocks, tiny_gpt2

__all__ = [
    "CUTS", "OPTIMIZERS", "VOCAB", "MiB", "Recorder", "assert_weights", "forced_decisions",
    "forced_plan", "plain_result",
    "random_blocks", "tiny_config", "tiny_plan", "tiny_profile", "tiny_spec",
]

CUTS = [0, 1, 2, 4, 5]  # embed | block.0 | block.1 block.2 | head: 4 shards
OPTIMIZERS = {
    "adamw-clip": OptimizerSpec(
        name="adamw",
        lr=3e-3,
        weight_decay=0.1,
        betas=(0.8, 0.95),
        eps=1e-7,
        warmup_steps=2,
        schedule="cosine",
        grad_clip=0.5,
    ),
    "adamw": OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1, schedule="linear"),
    "sgd": OptimizerSpec(
        name="sgd",
        lr=0.05,
        momentum=0.9,
        weight_decay=0.01,
        nesterov=True,
        warmup_steps=3,
        schedule="linear",
    ),
}


def tiny_config(**overrides: Any) -> GPT2Config:
    """The spilled job's model: 3 blocks, every dropout 0.2."""
    return tiny_gpt2(dropout=0.2, **{"n_layer": 3, **overrides})


def tiny_spec(opt_name: str = "adamw", **overrides: Any) -> TrainSpec:
    """The spilled job: 5 steps of batch 4 with ``OPTIMIZERS[opt_name]``, eval every 2."""
    kwargs = {
        "model": tiny_config(),
        "train_data": random_blocks(10),  # batch 4: 2 steps per epoch
        "eval_data": random_blocks(5, seed=9),
        "optimizer": OPTIMIZERS[opt_name],
        "batch_size": 4,
        "max_steps": 5,
        "eval_every": 2,
        "seed": 7,
    }
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


def plain_result(opt_name: str):
    """Plain training's result, cached per intra-op thread count (it changes float sums)."""
    return _plain_result(opt_name, torch.get_num_threads())


@functools.cache
def _plain_result(opt_name: str, threads: int):
    return train_plain(tiny_spec(opt_name), Device("cpu"))


@functools.cache
def tiny_profile(microbatch_size, n_layer=3):
    """The profile of the spilled job (of ``n_layer`` blocks) for ``microbatch_size`` rows."""
    return profile_model(tiny_spec(model=tiny_config(n_layer=n_layer)), microbatch_size)


def tiny_plan(spec: TrainSpec, microbatch_size=None, budget=4 * MiB, cuts=CUTS):
    """A plan of ``spec`` cut at ``cuts`` for a virtual device of ``budget`` bytes."""
    profile = tiny_profile(microbatch_size)
    return make_plan(profile, spec.optimizer, cuts, VirtualDevice("cpu:9", budget_bytes=budget))


def assert_weights(actual: dict, expected: dict, exact: bool = True) -> None:
    """Same names, on the CPU; equal bit for bit (``exact``) or within 1e-5."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].device.type == "cpu"
        if exact:
            assert torch.equal(actual[name], tensor), name
        else:
            torch.testing.assert_close(actual[name], tensor, rtol=0, atol=1e-5, msg=name)


class Recorder(TrainCallbacks):
    """Keeps every start, step and eval event; prunes at the eval of step ``prune_at``."""

    def __init__(self, prune_at: int | None = None) -> None:
        self.steps: list[StepEvent] = []
        self.evals: list[EvalEvent] = []
        self.starts = []
        self.prune_at = prune_at

    def on_start(self, event):
        self.starts.append(event)

    def on_step(self, event):
        self.steps.append(event)

    def on_eval(self, event):
        self.evals.append(event)
        return event.step == self.prune_at


def forced_decisions(sizes, codes, seed=0) -> list[list[LayerDecision]]:
    """Per shard, per layer of ``sizes[shard][layer]`` saved slots, the decision of its code:
    K keep, S swap, R recompute, M a seeded random mix of swap and keep."""
    rng = random.Random(seed)
    decisions = []
    for shard_sizes, shard_codes in zip(sizes, codes, strict=True):
        row = []
        for n, code in zip(shard_sizes, shard_codes, strict=True):
            if code == "M":
                row.append(LayerDecision(False, tuple(rng.random() < 0.5 for _ in range(n))))
            else:
                make = {"K": LayerDecision.keep_all, "S": LayerDecision.swap_all,
                        "R": LayerDecision.recomputed}[code]
                row.append(make(n))
        decisions.append(row)
    return decisions


def forced_plan(spec, plan, codes, seed=0, n_layer=3) -> MemoryPlan:
    """A memory plan with given per-layer codes: K keep, S swap, R recompute, M random mix."""
    profile = tiny_profile(plan.microbatch_size, n_layer)
    shards = profile_shards(spec, plan, profile, bytes_per_s=1e9)
    sizes = [[len(layer.activations) for layer in shard.layers] for shard in shards]
    decisions = forced_decisions(sizes, codes, seed)
    return plan_memory(spec, plan, profile=profile, bandwidth=1e9, budget_bytes=1 << 40,
                       decisions=decisions)
