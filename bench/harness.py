"""Shared benchmark harness: timing, JSON output and a markdown table.

Every benchmark prints one JSON object (machine, command, rows) and the same rows as a markdown
table, and writes the JSON to ``bench/results/<name>.json``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The machine the numbers come from."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once; return (wall seconds, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of equal keys as a markdown table (floats with 4 significant digits)."""
    if not rows:
        return ""
    keys = list(rows[0])

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def report(name: str, rows: Sequence[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Print the JSON record and the markdown table; save the JSON under bench/results/."""
    command = " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    record = {"benchmark": name, "command": command, "machine": machine(), **extra,
              "rows": list(rows)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    print()
    print(markdown_table(rows))
    return record
