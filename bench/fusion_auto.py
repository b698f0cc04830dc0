"""Wall seconds and model builds of ``resources.fusion: auto``'s measurement (``measure_fusion``).

    python bench/fusion_auto.py [--base REV] [--repeats 3] [--ks 1,2,4] [--threads 1]
                                [--layers 4] [--width 256] [--vocab 50257]

Times ``measure_fusion`` (its defaults: 5 timed steps, 3 rounds) of a GPT-2 of ``--layers``
layers, width ``--width`` and a ``--vocab`` vocabulary (GPT-2's by default: its embedding is
most of a small model's parameters, as it is for GPT-2 124M), 4 x 64 tokens per step, AdamW, on
the host CPU, for K in ``--ks``. Each measurement runs in a fresh Python process, which counts
the models it builds (``build_base`` calls off the meta device, in
:mod:`~sweepmaster.runtime.training.members` and :mod:`~sweepmaster.workload.causal_lm`) and
reports the K it would choose. With ``--base REV`` the ``sweepmaster`` package of git revision
``REV`` (``git archive``) is measured too, alternating with the working tree's in the same run,
so load drifts hit both alike; ``ratio`` is the base's best seconds over this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(args: argparse.Namespace) -> dict[str, object]:
    """One ``measure_fusion`` in this process: seconds, builds, chosen K, peaks."""
    import torch
    from transformers import GPT2Config

    import sweepmaster
    from sweepmaster.runtime.devices.device import Device
    from sweepmaster.runtime.planning.fusion_degree import choose_fusion_degree, measure_fusion
    from sweepmaster.runtime.training import members as members_module
    from sweepmaster.workload import OptimizerSpec, TrainSpec
    from sweepmaster.workload import causal_lm as causal_lm_module

    torch.set_num_threads(args.threads)
    builds = []

    def counting(build: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
        def counted(*a: object, **kw: object) -> torch.nn.Module:
            model = build(*a, **kw)
            if next(model.parameters()).device.type != "meta":
                builds.append(1)
            return model

        return counted

    # fused members build their bases with members.build_base; a single job (K = 1 since the
    # measurement runs the executor's jobs) with build_model, which calls causal_lm.build_base
    for module in (members_module, causal_lm_module):
        module.build_base = counting(module.build_base)  # type: ignore[attr-defined]
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, n_positions=64,
                        vocab_size=args.vocab)
    data = torch.randint(0, args.vocab, (64, 64), generator=torch.Generator().manual_seed(0))
    spec = TrainSpec(config, data, optimizer=OptimizerSpec(name="adamw", lr=1e-3),
                     batch_size=4, max_steps=20, seed=0, name="bench")
    ks = [int(k) for k in args.ks.split(",")]
    start = time.perf_counter()
    measurements = measure_fusion(spec, Device("cpu"), ks)
    seconds = time.perf_counter() - start
    return {
        "package": str(Path(sweepmaster.__file__).parent),
        "seconds": seconds,
        "builds": len(builds),
        "chosen_k": choose_fusion_degree(measurements),
        "step_s": [round(m.step_seconds, 4) for m in measurements],
        "peak_MiB": [round(m.peak_bytes / 2**20, 1) for m in measurements],
    }


def run_tree(tree: Path | None, args: argparse.Namespace) -> dict[str, object]:
    """:func:`measure` in a fresh process importing ``sweepmaster`` from ``tree`` (or this one)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    flags = ["--ks", args.ks, "--threads", str(args.threads), "--layers", str(args.layers),
             "--width", str(args.width), "--vocab", str(args.vocab)]
    out = subprocess.run([sys.executable, __file__, "--worker", *flags], env=env,
                         cwd=tempfile.gettempdir(), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import report

    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, Path | None] = {"this tree": None}
        if args.base is not None:
            archive = subprocess.run(["git", "archive", args.base, "sweepmaster"], cwd=ROOT,
                                     check=True, capture_output=True).stdout
            with tarfile.open(fileobj=BytesIO(archive)) as tar:
                tar.extractall(scratch, filter="data")
            trees = {f"base {args.base}": Path(scratch), **trees}
        load_start = os.getloadavg()
        runs: dict[str, list[dict[str, object]]] = {name: [] for name in trees}
        for _ in range(args.repeats):  # alternate, so load drifts hit both alike
            for name, tree in trees.items():
                runs[name].append(run_tree(tree, args))
        load_end = os.getloadavg()
    best = {name: min(float(str(r["seconds"])) for r in rs) for name, rs in runs.items()}
    rows = [
        {
            "code": name,
            "best_s": best[name],
            "all_s": ", ".join(f"{float(str(r['seconds'])):.1f}" for r in rs),
            "builds": rs[0]["builds"],
            "chosen_k": ", ".join(str(r["chosen_k"]) for r in rs),
            "peak_MiB": rs[0]["peak_MiB"],
            "ratio": best[next(iter(trees))] / best[name],
        }
        for name, rs in runs.items()
    ]
    report("fusion_auto", rows, load_average_start=load_start, load_average_end=load_end,
           runs=runs)


if __name__ == "__main__":
    main()
