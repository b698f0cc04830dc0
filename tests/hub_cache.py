"""A HuggingFace hub cache laid out as ``snapshot_download`` leaves it, for offline tests.

``<hf_home>/hub/models--<org>--<name>/refs/main`` holds the commit sha, and
``snapshots/<sha>/`` the files: a tiny GPT-2 (``save_pretrained``: config.json,
model.safetensors) and the GPT-2 tokenizer's files. Tests point ``HF_HOME`` at it and set
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from data_paths import TOKENIZER_DIR

#: The repository id tests name, and the two commits its cache holds (``main`` is the first).
REPO_ID = "smtest/tiny-gpt2"
MAIN_SHA = "1" * 40
OTHER_SHA = "2" * 40

#: Tiny GPT-2 shapes: two layers of width 32, the GPT-2 vocabulary.
TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}


def make_hub_cache(hf_home: Path, repo_id: str = REPO_ID, *, seeds: tuple[int, ...] = (0, 1),
                   ) -> dict[str, Path]:
    """Write ``repo_id`` into ``hf_home/hub`` with one snapshot per seed; return sha -> folder.

    The first snapshot (``MAIN_SHA``) is what ``refs/main`` points at; the second
    (``OTHER_SHA``) holds other weights of the same shapes, reachable only by its sha.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(MAIN_SHA)
    folders = {}
    for sha, seed in zip((MAIN_SHA, OTHER_SHA), seeds, strict=False):
        folder = repo / "snapshots" / sha
        torch.manual_seed(seed)
        GPT2LMHeadModel(GPT2Config(**TINY_GPT2)).save_pretrained(folder)
        for file in TOKENIZER_DIR.iterdir():
            if file.is_file():
                shutil.copy(file, folder / file.name)
        folders[sha] = folder
    return folders
