"""Trials finished per hour of a pruned fused sweep: arrays that refill vs arrays that run on.

    python bench/refill.py [--trials 24] [--fusion 4] [--steps 96] [--eval-every 8]
                           [--repeats 2] [--threads 1] [--devices cpu]

One sweep (``run_sweep``, SQLite, a 2-layer GPT-2 of width 32 over the WikiText-2 slice in
``examples/data``, tokenized by a byte-level BPE of 512 tokens trained on it here, so that the
model is the kind whose fused steps are cheaper than K separate ones on a CPU; 4 x 32 tokens
per step) of ``--trials`` trials with a random sampler (seed 0,
learning rate log-uniform in [1e-6, 3e-2]) and Optuna's median pruner (2 startup trials, pruning
from the first evaluation), ``resources.fusion: --fusion`` on ``--devices`` (default the host
CPU; a virtual device's budget, e.g. ``cpu:1x1MiB``, makes the arrays spill: stacked shards,
two arrays sharing the device task by task), run twice in the same process run, alternating,
best of ``--repeats``:

* ``refill``: the launch as it is: when a member of a fused array leaves (pruned or finished),
  its slot takes the next trial at once (``ShardExecutor.join_fused`` from the array's vacancy
  hook);
* ``run on``: the same launch on an executor whose ``join_fused`` refuses every trial, so an
  array runs on with K - 1, K - 2, ... members until its last member ends, and only then does a
  new array of K start (the trial the launch asked for the slot waits in its pool for it).

``trials/h`` is finished trials (COMPLETE + PRUNED) over the sweep's wall time; ``speedup`` is
refill's over run-on's. Wall time includes everything a sweep pays (asking, building, telling,
the database). The load average before and after is recorded (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import torch
from harness import report

from sweepmaster.config import parse_sweep_config
from sweepmaster.runtime import ShardExecutor
from sweepmaster.sweep import run_sweep

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


class RunOnExecutor(ShardExecutor):
    """The baseline: a running fused array takes no new member (it runs on with fewer)."""

    def join_fused(self, job_id, spec, callbacks=None):
        return None  # as for an array that has ended: the trial waits for a new array


def small_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of 512 tokens trained on the slice's training split, saved for HF."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(DATA / "wikitext-2-slice" / "wiki.train.tokens")], vocab_size=512,
              min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return directory


def sweep_config(workdir: Path, args: argparse.Namespace) -> Any:
    return parse_sweep_config({
        "name": "refill",
        "storage": f"sqlite:///{workdir / 'sweep.db'}",
        "study": {"direction": "minimize", "metric": "eval_loss", "n_trials": args.trials,
                  "sampler": "random", "seed": 0,
                  "pruner": {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 0}},
        "model": {"config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32}},
        "data": {"dir": str(DATA / "wikitext-2-slice"), "tokenizer": str(workdir.parent / "bpe"),
                 "block_size": 32, "max_train_tokens": 8192, "max_eval_tokens": 512,
                 "cache_dir": str(workdir.parent / "token-cache")},
        "train": {"max_steps": args.steps, "batch_size": 4, "eval_every": args.eval_every,
                  "seed": 0},
        "output": {"dir": str(workdir / "checkpoints"), "save": "none"},
        "resources": {"fusion": args.fusion, "devices": args.devices},
        "parameters": {"train.lr": {"min": 1e-6, "max": 3e-2,
                                    "distribution": "log_uniform_values"}},
    })


def one_sweep(root: Path, mode: str, run: int, args: argparse.Namespace) -> dict[str, Any]:
    workdir = root / f"{mode}-{run}"
    workdir.mkdir(parents=True)
    config = sweep_config(workdir, args)
    executor_type = ShardExecutor if mode == "refill" else RunOnExecutor
    with executor_type(args.devices, fusion=args.fusion) as executor:
        start = time.perf_counter()
        outcome = run_sweep(config, executor=executor)
        seconds = time.perf_counter() - start
        spilled = bool(executor._stacked_plans)  # a fused array was planned as stacked shards
    trials = optuna.load_study(study_name="refill", storage=config.storage).get_trials()
    states = [t.state.name for t in trials]
    return {"seconds": seconds, "finished": outcome.num_finished,
            "pruned": states.count("PRUNED"), "complete": states.count("COMPLETE"),
            "spilled": spilled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--fusion", type=int, default=4)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--devices", default="cpu", help="resources.devices (cpu:1x1MiB spills)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="There is a performance drop")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    load_before = os.getloadavg()[0]
    best: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        small_tokenizer(Path(tmp) / "bpe")
        for run in range(args.repeats):
            for mode in ("run on", "refill"):
                measured = one_sweep(Path(tmp), mode.replace(" ", "-"), run, args)
                if mode not in best or measured["seconds"] < best[mode]["seconds"]:
                    best[mode] = measured
    rows = [{"mode": mode, "spilled": m["spilled"], "trials": m["finished"], "pruned": m["pruned"],
             "seconds": m["seconds"], "trials/h": m["finished"] / m["seconds"] * 3600}
            for mode, m in best.items()]
    for row in rows:
        row["speedup"] = row["trials/h"] / rows[0]["trials/h"]
    report("refill", rows, load_average=[load_before, os.getloadavg()[0]])


if __name__ == "__main__":
    main()
