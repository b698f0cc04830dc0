"""Tiny sweep.yaml files over the WikiText-2 slice shipped in examples/data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.kit.data import EXAMPLES, SHIPPED_DATA

__all__ = ["DATA", "EXAMPLES", "tiny_sweep", "write_sweep"]

DATA = SHIPPED_DATA
"""The shipped data the tiny sweeps read (the same on every machine)."""


def tiny_sweep(tmp_path: Path, name: str = "tiny", **sections: Any) -> dict[str, Any]:
    """A sweep of a 1-layer GPT-2 that trains 6 steps per trial in well under a second."""
    raw: dict[str, Any] = {
        "name": name,
        "storage": f"sqlite:///{tmp_path / 'sweep.db'}",
        "study": {"direction": "minimize", "metric": "eval_loss", "sampler": "grid", "seed": 0},
        "model": {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}},
        "data": {
            "dir": str(DATA / "wikitext-2-slice"),
            "tokenizer": str(DATA / "gpt2-tokenizer"),
            "block_size": 32,
            "max_train_tokens": 4096,
            "max_eval_tokens": 512,
            "cache_dir": str(tmp_path / "token-cache"),
        },
        "train": {"max_steps": 6, "batch_size": 4, "lr": 1e-2, "eval_every": 3, "seed": 0},
        "output": {"dir": str(tmp_path / "checkpoints"), "save": "best"},
        "parameters": {"train.lr": {"values": [1e-2, 3e-3]},
                       "train.batch_size": {"values": [2, 4]}},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return raw


def write_sweep(tmp_path: Path, raw: dict[str, Any], filename: str = "sweep.yaml") -> Path:
    """Write ``raw`` as ``tmp_path / filename`` (YAML, keys in order); return its path."""
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
