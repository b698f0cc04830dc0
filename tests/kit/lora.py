"""The tiny LoRA world: a 2-layer GPT-2 base of ``VOCAB`` tokens and its token blocks."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config

from tests.kit import models

__all__ = ["VOCAB", "blocks", "tiny_config"]

VOCAB = 128


def tiny_config(**overrides: Any) -> GPT2Config:
    """The base: 2 blocks, 16 positions, ``VOCAB`` tokens, every dropout 0.1."""
    return models.tiny_gpt2(dropout=0.1, **{"n_positions": 16, "vocab_size": VOCAB, **overrides})


def blocks(num_blocks: int, seed: int) -> torch.Tensor:
    """``(num_blocks, 16)`` token ids below ``VOCAB``, drawn by ``seed``."""
    return models.random_blocks(num_blocks, 16, seed, vocab_size=VOCAB)
