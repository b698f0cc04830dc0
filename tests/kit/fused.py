"""The tiny fused array: members of one 2-layer GPT-2 architecture, and the checks of a fused run.

A member is :func:`spec` of a seed; K of them fuse (same architecture key). :func:`train_array`
trains them as the executor trains an array that fits its device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import GPT2Config

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import train_fused_spilled
from sweepmaster.runtime.training.plain import train_plain
from sweepmaster.workload import OptimizerSpec, TrainSpec
from tests.kit import models
from tests.kit.models import MiB
from tests.kit.spill import forced_decisions

__all__ = [
    "BUDGET", "CPU", "EVAL", "MARKS", "TIGHT", "TRAIN", "VOCAB", "Recorder", "assert_close_states",
    "assert_equals_plain", "assert_same_events", "forced_stacked_plan", "member", "plain",
    "random_blocks", "spec", "tiny_config", "train_array",
]

CPU = Device("cpu")
VOCAB = 500
TIGHT = {"rtol": 1e-6, "atol": 1e-6}


def tiny_config(dropout: float = 0.0, **overrides: Any) -> GPT2Config:
    """The members' model: 2 blocks, 32 positions, ``VOCAB`` tokens, no dropout by default."""
    return models.tiny_gpt2(dropout=dropout, **{"n_positions": 32, "vocab_size": VOCAB,
                                                **overrides})


def random_blocks(num_blocks: int, block_size: int = 16, seed: int = 123) -> torch.Tensor:
    """``(num_blocks, block_size)`` token ids below ``VOCAB``."""
    return models.random_blocks(num_blocks, block_size, seed, vocab_size=VOCAB)


TRAIN = random_blocks(10)
EVAL = random_blocks(5, seed=9)


def spec(seed: int, opt: OptimizerSpec | None = None, **overrides: Any) -> TrainSpec:
    """A member named ``trial-<seed>``: 5 steps of batch 3, eval every 2, SGD unless ``opt``."""
    kwargs = {
        "model": tiny_config(),
        "train_data": TRAIN,
        "eval_data": EVAL,
        "optimizer": opt or OptimizerSpec(name="sgd", lr=0.1),
        "batch_size": 3,
        "max_steps": 5,
        "eval_every": 2,
        "seed": seed,
        "name": f"trial-{seed}",
    }
    kwargs.update(overrides)
    return TrainSpec(**kwargs)


def assert_close_states(actual: dict, expected: dict, **tolerance: Any) -> None:
    """Same names; each tensor close within ``tolerance`` (``torch.testing.assert_close``)."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, msg=name, **tolerance)


class Recorder(TrainCallbacks):
    """Every event, without its wall-clock fields."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_start(self, event):
        self.events.append(("start", event.job, event.total_steps, event.num_parameters))

    def on_step(self, event):
        self.events.append(("step", event.step, event.epoch, event.lr, event.train_loss))

    def on_eval(self, event):
        self.events.append(("eval", event.step, event.eval_loss))
        return False


def assert_same_events(actual: list[tuple], expected: list[tuple]) -> None:
    """Same events in the same order: names and counts equal, floats within 1e-5."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            if isinstance(b, float):
                assert a == pytest.approx(b, rel=1e-5), (got, want)
            else:
                assert a == b, (got, want)


def train_array(specs, callbacks=None, **hooks) -> list:
    """A fused array as the executor trains one that fits its device: one stacked shard.

    ``train_fused_spilled`` on ``plan_stacked(..., whole=True)`` (S = 1); per member its result,
    or ``None`` if it failed; ``hooks`` are ``on_member_end`` and ``refill``.
    """
    plan = plan_stacked(stacked_spec(specs), len(specs), CPU, whole=True)
    assert len(plan.shards) == 1
    return train_fused_spilled(specs, CPU, plan, callbacks, **hooks)


#: The marks of a module that trains tiny fused arrays: one intra-op thread, and no warning of
#: the performance drop vmap announces for the stacked members' ops.
MARKS = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


#: Three tiny members fit 1 MiB only as 4 stacked shards (their plain footprint is ~2.9 MiB).
BUDGET = MiB


def member(seed: int, opt_name: str = "sgd", dropout: float = 0.1, **overrides: Any) -> TrainSpec:
    """A member with dropout that spills: SGD with momentum, or AdamW at a seeded lr."""
    opt = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9) if opt_name == "sgd" else \
        OptimizerSpec(name="adamw", lr=1e-3 * (1 + seed), weight_decay=0.01)
    return spec(seed, opt, model=tiny_config(dropout=dropout), **overrides)


def plain(member_spec: TrainSpec):
    """``train_plain`` of the member on the CPU, without its checkpoints."""
    return train_plain(dataclasses.replace(member_spec, checkpoint_dir=None), CPU)


def assert_equals_plain(result, member_spec, opt_name: str) -> None:
    """The member's weights, losses and steps equal plain training's; its head stays tied."""
    expected = plain(member_spec)
    # AdamW divides by sqrt(v): rounding noise of batched kernels becomes lr-sized steps where a
    # gradient is ~0 (as in tests/runtime/test_fusion.py); SGD stays within 1e-6.
    atol = 1e-6 if opt_name == "sgd" else 1e-2 * member_spec.optimizer.lr
    assert_close_states(result.state_dict, expected.state_dict, rtol=0, atol=atol)
    for name in ("train_loss", "eval_loss"):
        torch.testing.assert_close(torch.tensor(result.history(name)),
                                   torch.tensor(expected.history(name)), rtol=1e-5, atol=1e-5)
    assert result.steps == expected.steps and result.pruned == expected.pruned
    assert torch.equal(result.state_dict["lm_head.weight"],
                       result.state_dict["transformer.wte.weight"])


def forced_stacked_plan(specs, plan, codes, seed=0):
    """A memory plan of the array with per-layer codes: K keep, S swap, R recompute, M mixed.

    Planned for the members' stacked spec, as ``plan`` is (LoRA adapters padded to the widest).
    """
    planned = stacked_spec(specs)
    traced = plan_stacked_memory(planned, len(specs), plan, bandwidth=1e9, budget_bytes=1 << 40)
    sizes = [[len(decision.swap) for decision in shard.decisions] for shard in traced.shards]
    decisions = forced_decisions(sizes, codes, seed)
    return plan_stacked_memory(planned, len(specs), plan, bandwidth=1e9, budget_bytes=1 << 40,
                               decisions=decisions)
