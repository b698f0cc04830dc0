"""Tiny GPT-2 configs and random token blocks: models that train in milliseconds on a CPU."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config

__all__ = ["VOCAB", "KiB", "MiB", "random_blocks", "tiny_gpt2"]

KiB = 2**10
MiB = 2**20
VOCAB = 101
"""The tiny vocabulary most tests use (token ids ``0 .. VOCAB - 1``; 0 is bos and eos)."""


def tiny_gpt2(n_layer: int = 2, dropout: float | None = None, **overrides: Any) -> GPT2Config:
    """A GPT-2 of width 32, 2 heads, 64 positions and ``VOCAB`` tokens.

    Args:
        n_layer: How many transformer blocks.
        dropout: Every dropout probability (residual, attention, embedding); ``None`` keeps
            transformers' defaults (0.1).
        overrides: Other ``GPT2Config`` fields, last.
    """
    kwargs: dict[str, Any] = {"n_layer": n_layer, "n_embd": 32, "n_head": 2, "n_positions": 64,
                              "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    if dropout is not None:
        kwargs.update(resid_pdrop=dropout, attn_pdrop=dropout, embd_pdrop=dropout)
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def random_blocks(num_blocks: int, block_size: int = 16, seed: int = 123,
                  vocab_size: int = VOCAB) -> torch.Tensor:
    """``(num_blocks, block_size)`` token ids drawn uniformly from ``vocab_size``, by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_blocks, block_size), generator=generator)
