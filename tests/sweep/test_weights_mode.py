"""Kept weights get the modes the umask gives: a teammate on the same server can read them."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from sweepmaster.workload import save_weights


@pytest.fixture
def umask() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _modes(root: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode))
            for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize(("mask", "dir_mode", "file_mode"), [
    (0o022, 0o755, 0o644), (0o027, 0o750, 0o640), (0o077, 0o700, 0o600)])
def test_saved_weights_follow_the_umask(tmp_path: Path, umask: None, mask: int, dir_mode: int,
                                        file_mode: int) -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32,
                                       vocab_size=64))
    os.umask(mask)
    target = save_weights(model, tmp_path / "sweep" / "trial-0")
    save_weights(model, target)  # replacing a kept folder: the same modes
    assert (target / "model.safetensors").is_file()
    assert _modes(target) == {("dir", dir_mode), ("file", file_mode)}
    assert stat.S_IMODE((tmp_path / "sweep").stat().st_mode) == dir_mode
    assert not [p for p in (tmp_path / "sweep").iterdir() if p != target]  # no leftovers
