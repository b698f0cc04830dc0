"""Shared fixtures: data directories and the ``cuda`` skip; the rest come from :mod:`tests.kit`.

Data: WikiText-2 and the GPT-2 tokenizer come from ``../shared/data`` (the full WikiText-2) when
that directory exists, else from the slice shipped in ``examples/data/``; see
:mod:`tests.kit.data`. Set ``SMTEST_SHARED_DATA`` to another directory (or to one that
does not exist, to use the shipped slice).

The HuggingFace hub is never asked: ``HF_HUB_OFFLINE`` is set for every test (a test that
needs hub ids lays out a cache of its own, :mod:`tests.kit.hub`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.kit.data import TOKENIZER_DIR, WIKITEXT_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it

#: Fixtures shared by every test file, registered for all of them.
pytest_plugins = ["tests.kit.storages", "tests.kit.threads", "tests.kit.caches"]


@pytest.fixture(autouse=True)
def _skip_cuda_without_gpu(request: pytest.FixtureRequest) -> None:
    """Skip tests marked ``cuda`` when no CUDA device is available."""
    if request.node.get_closest_marker("cuda") is None:
        return
    import torch  # only tests that need a GPU pay for importing torch here

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    """A WikiText-2 directory (``wiki.{train,valid,test}.tokens``): shared, else shipped."""
    return WIKITEXT_DIR


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The GPT-2 tokenizer directory: shared, else shipped."""
    return TOKENIZER_DIR
