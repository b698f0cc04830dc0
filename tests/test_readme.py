"""The README's code: every Python block meant to run runs, as written, from the checkout.

A block is not run only when the line before its fence is ``<!-- not run -->``. Blocks run in
order in one namespace (a later block may use what an earlier one made), in a fresh process
with its own token cache.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.data import ROOT as REPO

NOT_RUN = "<!-- not run -->"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each fenced block of ``language`` not marked as not run."""
    blocks = []
    for match in FENCE.finditer(text):
        if match.group(1) != language:
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before == NOT_RUN:
            continue
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(2)))
    return blocks


def test_every_python_block_of_the_readme_compiles() -> None:
    blocks = code_blocks((REPO / "README.md").read_text(encoding="utf-8"), "python")
    assert blocks
    for line, code in blocks:
        compile(code, f"README.md:{line}", "exec")


def test_code_blocks_are_found_and_a_marked_one_is_left_out() -> None:
    text = "a\n```python\nx = 1\n```\n<!-- not run -->\n```python\nboom\n```\n```bash\nls\n```\n"
    assert code_blocks(text, "python") == [(3, "x = 1\n")]


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(tmp_path: Path) -> None:
    blocks = code_blocks((REPO / "README.md").read_text(encoding="utf-8"), "python")
    assert len(blocks) >= 2  # the Python API and its fused arrays
    program = "\n".join(
        f"print('--- README.md line {line}', flush=True)\n"
        f"exec(compile({code!r}, 'README.md:{line}', 'exec'), namespace)"
        for line, code in blocks)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", f"namespace = {{}}\n{program}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
