"""Where the tests' text data are: ``../shared/data`` when present, else ``examples/data/``.

The shared directory holds the full WikiText-2 (``wikitext-2/``) and the GPT-2 tokenizer; the
repository ships a slice of WikiText-2 (``wikitext-2-slice/``) and the same tokenizer, so every
test that needs data runs on a fresh clone too. ``SMTEST_SHARED_DATA`` names another
shared directory (one that does not exist selects the shipped data).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
EXAMPLES = ROOT / "examples"
"""The example sweeps (``*.yaml``) and their data."""
SHIPPED_DATA = EXAMPLES / "data"
"""The data the repository ships: ``wikitext-2-slice/`` and ``gpt2-tokenizer/``."""
SHARED_DATA = Path(os.environ.get("SMTEST_SHARED_DATA",
                                  ROOT.parent / "shared" / "data"))

_SHARED = (SHARED_DATA / "wikitext-2").is_dir() and (SHARED_DATA / "gpt2-tokenizer").is_dir()
DATA_DIR = SHARED_DATA if _SHARED else SHIPPED_DATA
"""The directory the data below come from."""
WIKITEXT_DIR = DATA_DIR / ("wikitext-2" if _SHARED else "wikitext-2-slice")
"""A WikiText-2 directory: ``wiki.train.tokens``, ``wiki.valid.tokens``, ``wiki.test.tokens``."""
TOKENIZER_DIR = DATA_DIR / "gpt2-tokenizer"
"""The GPT-2 tokenizer (``vocab.json``, ``merges.txt``)."""
