"""Trials per second of fused arrays vs sequential training, and the auto fusion degree.

    python bench/fusion.py [--configs tiny,small] [--ks 1,2,4,8] [--steps 20] [--repeats 3]
                           [--threads 1] [--device cpu] [--spilled-ks 2,4]
                           [--spill-fraction 0.75]

For each model config (``tiny``: 2 layers, width 32, vocab 500, 4 x 32 tokens per step;
``small``: 2 layers, width 64, vocab 2000, 8 x 64 tokens per step) and each K, K trials (same
architecture, different seed and learning rate) are trained ``--steps`` steps twice in the same
process run: one after another with ``train_plain`` (sequential, the baseline) and together as
one fused array, as the executor trains one that fits its device: ``train_fused_spilled`` on one
stacked shard holding the whole array (``plan_stacked(..., whole=True)``). Each wall time
includes building the models, as a sweep pays it; the best of ``--repeats`` alternating runs is
kept. ``speedup`` is fused trials/s over
sequential trials/s of the same K.

Then ``ShardExecutor(fusion="auto").fusion_choice`` (the ``resources.fusion: auto`` path of a
sweep: ``measure_fusion`` run as an executor job, then ``choose_fusion_degree``) picks a K; the
JSON records whether it is the K with the most trials per second measured above, where K = 1 is
plain training (its rate: the mean sequential rate over all rows, the same work each time). The
machine is shared: the load average before and after is recorded with the numbers.

Spilled rows (``--spilled-ks``, empty to skip): on a virtual device whose budget is
``--spill-fraction`` of one trial's plain footprint (so every trial spills), K trials are
trained one after another with ``train_spilled`` (each planned alone, Hydra's full recompute,
double-buffered prefetch) and together as one spilled fused array with ``train_fused_spilled``
(stacked shards planned for K members, double-buffered too); ``speedup`` is again fused over
sequential trials/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
import warnings

import torch
from harness import markdown_table, report
from transformers import GPT2Config

from sweepmaster.runtime import ShardExecutor
from sweepmaster.runtime.devices.device import Device, VirtualDevice
from sweepmaster.runtime.planning.partition import plan_job
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.runtime.training.fused_spill import train_fused_spilled
from sweepmaster.runtime.training.plain import train_plain
from sweepmaster.runtime.training.spill import train_spilled
from sweepmaster.workload import OptimizerSpec, TrainSpec

CONFIGS = {
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab": 500, "block_size": 32, "batch": 4},
    "small": {
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 2,
        "vocab": 2000,
        "block_size": 64,
        "batch": 8,
    },
}


def make_specs(preset: dict, steps: int, k: int) -> list[TrainSpec]:
    config = GPT2Config(
        n_layer=preset["n_layer"],
        n_embd=preset["n_embd"],
        n_head=preset["n_head"],
        vocab_size=preset["vocab"],
        n_positions=preset["block_size"],
        bos_token_id=0,
        eos_token_id=0,
    )
    generator = torch.Generator().manual_seed(0)
    shape = (preset["batch"] * steps, preset["block_size"])
    blocks = torch.randint(0, preset["vocab"], shape, generator=generator)
    return [
        TrainSpec(
            model=config,
            train_data=blocks,
            batch_size=preset["batch"],
            max_steps=steps,
            seed=i,
            name=f"trial-{i}",
            optimizer=OptimizerSpec(lr=1e-3 * (1 + i), warmup_steps=2),
        )
        for i in range(k)
    ]


def sequential_seconds(specs: list[TrainSpec], device: Device) -> float:
    start = time.perf_counter()
    for spec in specs:
        train_plain(spec, device)
    return time.perf_counter() - start


def fused_seconds(specs: list[TrainSpec], device: Device, plan: JobPlan) -> float:
    """One fused array of ``specs`` on ``plan``: one stacked shard (S = 1, planned once)."""
    start = time.perf_counter()
    train_fused_spilled(specs, device, plan)
    return time.perf_counter() - start


def whole_plan(specs: list[TrainSpec], device: Device) -> JobPlan:
    """One stacked shard holding the whole array (an executor plans it once per architecture)."""
    return plan_stacked(specs[0], len(specs), device, whole=True)


def bench_spilled(name: str, args: argparse.Namespace, ks: list[int]) -> list[dict]:
    """Spilled rows: K sequential spilled runs vs one spilled fused array of K (module doc)."""
    preset = CONFIGS[name]
    one = make_specs(preset, args.steps, 1)[0]
    plain_bytes = plan_job(one, VirtualDevice("cpu:0", budget_bytes=2**40)).plain_bytes
    budget = int(plain_bytes * args.spill_fraction)
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    alone = plan_job(one, device)
    warmup = make_specs(preset, 1, 2)
    train_fused_spilled(warmup, device, plan_stacked(warmup[0], 2, device))
    rows = []
    for k in ks:
        specs = make_specs(preset, args.steps, k)
        stacked = plan_stacked(specs[0], k, device)
        seq, fused = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for spec in specs:
                train_spilled(spec, device, alone)
            seq.append(time.perf_counter() - start)
            start = time.perf_counter()
            train_fused_spilled(specs, device, stacked)
            fused.append(time.perf_counter() - start)
        seq_tps, fused_tps = k / min(seq), k / min(fused)
        rows.append({
            "config": f"{name} spilled",
            "k": k,
            "budget_MiB": budget / 2**20,
            "sequential_shards": len(alone.shards),
            "fused_shards": len(stacked.shards),
            "sequential_s": min(seq),
            "fused_s": min(fused),
            "sequential_trials_per_s": seq_tps,
            "fused_trials_per_s": fused_tps,
            "speedup": fused_tps / seq_tps,
        })
    return rows


def bench_config(name: str, args: argparse.Namespace, device: Device, ks: list[int]) -> dict:
    preset = CONFIGS[name]
    warmup = make_specs(preset, 1, 2)  # first-call costs (imports, vmap setup) off the clock
    fused_seconds(warmup, device, whole_plan(warmup, device))
    sequential_seconds(warmup[:1], device)
    rows = []
    for k in ks:
        specs = make_specs(preset, args.steps, k)
        plan = whole_plan(specs, device)
        seq, fused = [], []
        for _ in range(args.repeats):  # alternate, so load drifts hit both alike
            seq.append(sequential_seconds(specs, device))
            fused.append(fused_seconds(specs, device, plan))
        seq_tps, fused_tps = k / min(seq), k / min(fused)
        rows.append(
            {
                "config": name,
                "k": k,
                "sequential_s": min(seq),
                "fused_s": min(fused),
                "sequential_trials_per_s": seq_tps,
                "fused_trials_per_s": fused_tps,
                "speedup": fused_tps / seq_tps,
            }
        )
    with ShardExecutor([device], fusion="auto") as executor:
        choice = executor.fusion_choice(make_specs(preset, args.steps, 1)[0])
    measurements = choice.measurements
    by_k = {m.k: m for m in measurements}
    for row in rows:
        m = by_k.get(row["k"])
        row["auto_tokens_per_s"] = m.trials_tokens_per_s if m else float("nan")
        row["peak_MiB"] = m.peak_bytes / 2**20 if m else float("nan")
    plain_rate = statistics.mean(row["sequential_trials_per_s"] for row in rows)
    rates = {row["k"]: row["fused_trials_per_s"] for row in rows if row["k"] > 1}
    rates[1] = plain_rate
    best_k = max(rates, key=lambda k: (rates[k], -k))
    auto_k = choice.k
    return {
        "config": name,
        "model": preset,
        "rows": rows,
        "auto_k": auto_k,
        "best_measured_k": best_k,
        "auto_matches_best": auto_k == best_k,
        # trials/s of the auto K over the best K's, as the rows above measured them
        "auto_rate_vs_best": rates[auto_k] / rates[best_k] if auto_k in rates else float("nan"),
        "auto_note": choice.note,
        "measurements": [dataclasses.asdict(m) for m in measurements],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--spilled-ks", default="2,4", help="K of spilled fused rows ('' skips)")
    parser.add_argument("--spill-fraction", type=float, default=0.75,
                        help="virtual device budget of the spilled rows / one trial's footprint")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    device = Device(args.device)
    ks = [int(k) for k in args.ks.split(",") if k]
    load_before = os.getloadavg()
    results = [bench_config(name, args, device, ks) for name in args.configs.split(",") if ks]
    spilled_ks = [int(k) for k in args.spilled_ks.split(",") if k]
    spilled = [row for name in args.configs.split(",") if spilled_ks
               for row in bench_spilled(name, args, spilled_ks)]
    report(
        "fusion",
        [row for result in results for row in result["rows"]],
        device=args.device,
        threads=args.threads,
        steps=args.steps,
        repeats=args.repeats,
        spill_fraction=args.spill_fraction,
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
        auto=[{k: v for k, v in result.items() if k != "rows"} for result in results],
        spilled=spilled,
    )
    if spilled:
        print()
        print(markdown_table(spilled))
    print()
    for result in results:
        print(
            f"{result['config']}: auto K = {result['auto_k']}, best measured K = "
            f"{result['best_measured_k']}, match: {result['auto_matches_best']}, auto K's "
            f"trials/s {result['auto_rate_vs_best']:.2f}x the best's"
        )


if __name__ == "__main__":
    main()
