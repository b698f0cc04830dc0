"""Wall time of a cold ``sweepmaster validate``, this tree against an earlier revision.

    python bench/validate.py [--before a71597b] [--runs 5] [--sweep examples/quickstart.yaml]

Each run is a new ``python -m sweepmaster validate`` process (imports and all, as a user types
it), before and after alternating so both see the same machine load; the earlier revision is
exported with ``git archive`` to a temporary directory and put first on ``PYTHONPATH``. One
untimed run of each (``-X importtime``) first writes the bytecode caches and tells whether
the tree's validate imports torch. Reports the median of ``--runs`` per tree and their
ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import report

REPO = Path(__file__).resolve().parents[1]


def _run(tree: Path, sweep: str, *flags: str) -> tuple[float, str]:
    """One validate process in ``tree``: (wall seconds, its stderr)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *flags, "-m", "sweepmaster", "validate", sweep],
                            cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"validate failed in {tree}: {result.stderr[-2000:]}")
    return seconds, result.stderr


def main() -> None:
    """Time the two trees and report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default="a71597b", help="git revision to compare against")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sweep", default="examples/quickstart.yaml")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp)
        archive = subprocess.run(["git", "archive", args.before], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        trees = {f"before ({args.before})": before, "after (this tree)": REPO}
        times: dict[str, list[float]] = {name: [] for name in trees}
        torch: dict[str, bool] = {}
        for name, tree in trees.items():  # writes the bytecode caches; lists the imports
            imports = _run(tree, args.sweep, "-X", "importtime")[1].splitlines()
            torch[name] = any(line.rsplit("|", 1)[-1].strip() == "torch" for line in imports)
        for _ in range(args.runs):
            for name, tree in trees.items():
                times[name].append(_run(tree, args.sweep)[0])
    base = statistics.median(times[f"before ({args.before})"])
    rows = [{"tree": name, "median_s": statistics.median(runs), "min_s": min(runs),
             "max_s": max(runs), "vs_before": statistics.median(runs) / base,
             "imports_torch": torch[name]} for name, runs in times.items()]
    report("validate", rows, sweep=args.sweep, runs=args.runs, load_average=os.getloadavg())


if __name__ == "__main__":
    main()
