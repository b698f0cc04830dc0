"""The tests' data: the shipped copy in ``examples/data`` when ``../shared/data`` is absent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.kit.data import ROOT

SHIPPED = ROOT / "examples" / "data"


def test_without_the_shared_directory_the_shipped_data_are_used(tmp_path: Path) -> None:
    env = {**os.environ, "SMTEST_SHARED_DATA": str(tmp_path / "absent")}
    code = "import tests.kit.data as d\nprint(d.WIKITEXT_DIR)\nprint(d.TOKENIZER_DIR)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    wikitext, tokenizer = map(Path, result.stdout.splitlines())
    assert (wikitext, tokenizer) == (SHIPPED / "wikitext-2-slice", SHIPPED / "gpt2-tokenizer")
    for path in (*(wikitext / f"wiki.{split}.tokens" for split in ("train", "valid", "test")),
                 tokenizer / "vocab.json", tokenizer / "merges.txt"):
        assert path.stat().st_size > 0, path
