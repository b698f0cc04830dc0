"""The tiny LoRA world: a 2-layer GPT-2 base, its members, and the base that spills.

:func:`member` is one LoRA trial over the base of ``VOCAB`` tokens; :data:`SPILLED_MEMBERS`
are three over a wider base (``SPILL_VOCAB``) that spill into 4 stacked shards at
``SPILL_BUDGET``, and :func:`assert_equals_alone` checks a member of their array.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GPT2Config

from sweepmaster.runtime import Device, TrainCallbacks, train_plain
from sweepmaster.workload import LoraSpec, OptimizerSpec, TrainSpec
from tests.kit import models
from tests.kit.models import MiB

__all__ = [
    "CONFIG", "SPILLED_MEMBERS", "SPILL_BUDGET", "SPILL_VOCAB", "TARGETS", "TRAIN", "VALID",
    "VOCAB", "PruneAt2", "assert_equals_alone", "blocks", "max_abs_diff", "member",
    "spilled_member", "tiny_config",
]

VOCAB = 128
TARGETS = ("c_attn", "c_proj")


def tiny_config(**overrides: Any) -> GPT2Config:
    """The base: 2 blocks, 16 positions, ``VOCAB`` tokens, every dropout 0.1."""
    return models.tiny_gpt2(dropout=0.1, **{"n_positions": 16, "vocab_size": VOCAB, **overrides})


def blocks(num_blocks: int, seed: int, vocab_size: int = VOCAB) -> torch.Tensor:
    """``(num_blocks, 16)`` token ids below ``vocab_size``, drawn by ``seed``."""
    return models.random_blocks(num_blocks, 16, seed, vocab_size=vocab_size)


CONFIG = tiny_config()
TRAIN, VALID = blocks(12, 1), blocks(4, 2)


def member(r: int, alpha: float, dropout: float, lr: float, **overrides: Any) -> TrainSpec:
    """A LoRA trial of rank ``r`` on ``TARGETS``: 5 steps of batch 4, AdamW at ``lr``."""
    kwargs = {"model": CONFIG, "train_data": TRAIN, "eval_data": VALID,
              "optimizer": OptimizerSpec(lr=lr, weight_decay=0.1), "batch_size": 4,
              "max_steps": 5, "eval_every": 2, "seed": 5,
              "peft": LoraSpec(r=r, alpha=alpha, dropout=dropout, target_modules=TARGETS),
              "name": f"r{r}-a{alpha:g}-p{dropout:g}-lr{lr:g}"}
    return TrainSpec(**{**kwargs, **overrides})


SPILL_VOCAB = 1024
#: Three members' plain footprint is ~4.5 MiB; at 0.8 MiB they spill into 4 stacked shards, the
#: first of them the (frozen) embeddings alone.
SPILL_BUDGET = 4 * MiB // 5
_SPILL_CONFIG = tiny_config(vocab_size=SPILL_VOCAB)
_SPILL_TRAIN = blocks(12, 1, SPILL_VOCAB)
_SPILL_VALID = blocks(4, 2, SPILL_VOCAB)


def spilled_member(r: int, alpha: float, dropout: float, lr: float,
                   **overrides: Any) -> TrainSpec:
    """:func:`member` over the wider vocabulary, 4 steps."""
    return member(r, alpha, dropout, lr, **{"model": _SPILL_CONFIG, "train_data": _SPILL_TRAIN,
                                            "eval_data": _SPILL_VALID, "max_steps": 4,
                                            **overrides})


#: Ranks, alphas, adapter dropouts (0: PEFT's identity) and learning rates differ; the last
#: member clips its gradients.
SPILLED_MEMBERS = [
    spilled_member(2, 8.0, 0.1, 1e-2),
    spilled_member(8, 4.0, 0.0, 3e-3),
    spilled_member(4, 16.0, 0.05, 1e-2,
                   optimizer=OptimizerSpec(lr=1e-2, weight_decay=0.1, grad_clip=0.05)),
]


class PruneAt2(TrainCallbacks):
    """Prunes at the evaluation of step 2."""

    def on_eval(self, event):
        return event.step == 2


def max_abs_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of two state dicts of the same names and shapes."""
    assert got.keys() == want.keys()
    for name, tensor in want.items():  # unpadded: the member's own shapes
        assert got[name].shape == tensor.shape, name
    return max(float((got[name] - tensor).abs().max()) for name, tensor in want.items())


def assert_equals_alone(result, spec: TrainSpec, callbacks: TrainCallbacks | None = None) -> float:
    """The member's weights and metrics equal ``train_plain``'s; returns the max abs diff."""
    assert result is not None
    expected = train_plain(spec, Device("cpu"), callbacks)
    diff = max_abs_diff(result.state_dict, expected.state_dict)
    # AdamW divides by sqrt(v): rounding noise of batched kernels becomes lr-sized steps where a
    # gradient is ~0 (the tolerance of tests.kit.fused.assert_equals_plain); the base is never
    # changed.
    assert diff <= 1e-2 * spec.optimizer.lr, (spec.name, diff)
    for metric in ("train_loss", "eval_loss"):
        got, want = result.history(metric), expected.history(metric)
        assert [step for step, _ in got] == [step for step, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)
    assert (result.steps, result.pruned) == (expected.steps, expected.pruned)
    return diff
