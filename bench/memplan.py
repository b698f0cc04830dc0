"""Swap/recompute planning benchmarks (mu-TWO) on virtual devices (CPU).

    python bench/memplan.py [--steps 3] [--repeats 3] [--skip-optimal]

1. Overhead: one GPT-2 (8 x 512, T=128, B=8, dropout 0.1) trained plain, spilled with Hydra's
   full recompute, and spilled with the swap/recompute plan (``plan_memory`` at the device's
   measured copy bandwidth), in the same process, alternating the order per repeat, on virtual
   devices of 1/4 and 1/8 of its plain footprint; plain training under a virtual device's byte
   meter too (the meter's own cost, which a GPU does not pay). Step time = time between consecutive
   ``on_step`` events (the first step, a warm-up, is dropped); median over repeats. Target:
   spilled-with-planner / plain <= 1.10. Process CPU time ratios are reported too: the machine
   is shared, and copies run on a background thread that only hides them when a core is free.
2. Greedy vs optimum: the greedy's simulated overhead over the MILP optimum (HiGHS) of the
   same profile, on the benchmark's GPT-2 shards (budgets of 1/2, 1/4, 1/8 of its footprint;
   bandwidths 0.3-10 GB/s; 0 or 50 ms of independent compute), and on 200 random small shards
   (3-8 layers, 1-2 microbatches, tight budgets, slow links).

Random token ids (vocabulary 8192) stand in for text: only shapes matter.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from harness import report
from spill import StepClock, gpt2_spec

from sweepmaster.runtime import Device, VirtualDevice, plan_job, train_plain, train_spilled
from sweepmaster.runtime.planning.memgreedy import MemoryPlanError, greedy_shard_decisions
from sweepmaster.runtime.planning.memplan import plan_memory
from sweepmaster.runtime.planning.memplan_milp import optimal_shard_decisions, random_shard_profile
from sweepmaster.runtime.planning.memprofile import ShardMemoryProfile, profile_shards
from sweepmaster.runtime.planning.memsim import LayerDecision, simulate_shard
from sweepmaster.runtime.planning.profile import profile_model
from sweepmaster.runtime.planning.timing import measure_copy_bandwidth

MiB = 2**20
PATHS = ("plain", "plain_metered", "hydra", "planned")


def overhead(steps: int, repeats: int, n_layer: int, n_embd: int) -> list[dict]:
    spec = gpt2_spec(n_layer=n_layer, n_embd=n_embd, block=128, batch=8, steps=steps + 1)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    rows = []
    for factor in (4, 8):
        device = VirtualDevice(f"cpu:x{factor}", budget_bytes=plain_bytes // factor)
        plan = plan_job(spec, device)
        bandwidth = measure_copy_bandwidth(device)
        start = time.perf_counter()
        memory = plan_memory(spec, plan, device=device, bandwidth=bandwidth)
        plan_s = time.perf_counter() - start
        wall: dict[str, list[float]] = {path: [] for path in PATHS}
        cpu: dict[str, list[float]] = {path: [] for path in PATHS}
        results = {}
        for repeat in range(repeats):
            order = PATHS if repeat % 2 == 0 else PATHS[::-1]
            for path in order:
                clock = StepClock()
                if path == "plain":
                    train_plain(spec, Device("cpu"), clock)
                elif path == "plain_metered":  # plain under a virtual device's byte meter
                    host = VirtualDevice("cpu:host", budget_bytes=1 << 40)
                    with host.meter.metering():
                        train_plain(spec, host, clock)
                elif path == "hydra":
                    results[path] = train_spilled(spec, device, plan, clock)
                else:
                    results[path] = train_spilled(spec, device, plan, clock, memory_plan=memory)
                wall[path] += clock.step_seconds()
                cpu[path] += clock.step_cpu_seconds()
        med = {path: statistics.median(wall[path]) for path in PATHS}
        med_cpu = {path: statistics.median(cpu[path]) for path in PATHS}
        planned = results["planned"]
        rows.append({
            "model": f"gpt2 {n_layer}x{n_embd}, T=128, B=8",
            "footprint_x": plan.plain_bytes / device.budget_bytes,
            "budget_MiB": device.budget_bytes / MiB,
            "shards": len(plan.shards),
            "bandwidth_GBps": bandwidth / 1e9,
            "decisions": " ".join(s.codes for s in memory.shards),
            "plain_step_s": med["plain"],
            "hydra_step_s": med["hydra"],
            "planned_step_s": med["planned"],
            "hydra_x": med["hydra"] / med["plain"],
            "planned_x": med["planned"] / med["plain"],
            "hydra_cpu_x": med_cpu["hydra"] / med_cpu["plain"],
            "planned_cpu_x": med_cpu["planned"] / med_cpu["plain"],
            "planned_vs_metered_plain_x": med["planned"] / med["plain_metered"],
            "predicted_step_s": memory.step_s,
            "hydra_predicted_step_s": plan.step_s,
            "predicted_peak_MiB": memory.peak_bytes / MiB,
            "metered_peak_MiB": (planned.peak_device_bytes or 0) / MiB,
            "hydra_swap_MiB_per_step": plan.swap_bytes_per_step / MiB,
            "planned_swap_MiB_per_step": memory.swap_bytes_per_step / MiB,
            "plan_s": plan_s,
        })
        assert (planned.peak_device_bytes or 0) <= device.budget_bytes
        print(rows[-1], flush=True)
    return rows


def optimal_gpt2(n_layer: int, n_embd: int) -> list[dict]:
    """Greedy vs MILP on the benchmark's GPT-2 shards, over bandwidths and budgets."""
    spec = gpt2_spec(n_layer=n_layer, n_embd=n_embd, block=128, batch=8, steps=2)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    rows = []
    for factor in (2, 4, 8):  # at 2x, shards have 3-4 layers
        device = VirtualDevice(f"cpu:x{factor}", budget_bytes=plain_bytes // factor)
        plan = plan_job(spec, device)
        profile = profile_model(spec, plan.microbatch_size)
        shards = [s for s in profile_shards(spec, plan, profile, device) if not s.last]
        ratios, solve = [], []
        for bandwidth in (3e8, 1e9, 3e9, 1e10):
            for overlap_s in (0.0, 0.05):
                r, t = compare(shards, plan.budget_bytes, bandwidth, overlap_s)
                ratios += r
                solve += t
        layers = "/".join(str(len(s.layers)) for s in shards)
        rows.append(summary_row(f"gpt2 1/{factor} budget, layers {layers}", ratios, solve))
    return rows


def optimal_random(instances: int) -> list[dict]:
    """Greedy vs MILP on random small shards."""
    rng = random.Random(0)
    ratios: list[float] = []
    solve: list[float] = []
    for _ in range(instances):
        shard = random_shard_profile(rng, rng.randint(3, 8), rng.randint(1, 2))
        bandwidth = rng.choice([5e6, 1e7, 2e7, 5e7])
        overlap_s = rng.choice([0.0, 2e-3])
        hydra = [LayerDecision.recomputed(len(layer.activations)) for layer in shard.layers]
        budget = int(simulate_shard(shard, hydra, bandwidth).peak_bytes * rng.uniform(0.8, 1.2))
        r, s = compare([shard], budget, bandwidth, overlap_s)
        ratios += r
        solve += s
    return [summary_row("random shards, 3-8 layers", ratios, solve)]


def compare(
    shards: list[ShardMemoryProfile], budget: int, bandwidth: float, overlap_s: float
) -> tuple[list[float], list[float]]:
    ratios, solve = [], []
    for shard in shards:
        try:
            start = time.perf_counter()
            best = optimal_shard_decisions(shard, budget, bandwidth, overlap_s)
            solve.append(time.perf_counter() - start)
        except ValueError:
            continue  # infeasible
        optimum = simulate_shard(shard, best, bandwidth, overlap_s).overhead_s
        try:
            greedy = greedy_shard_decisions(shard, budget, bandwidth, overlap_s)
        except MemoryPlanError:
            ratios.append(float("inf"))
            continue
        found = simulate_shard(shard, greedy, bandwidth, overlap_s).overhead_s
        ratios.append(found / optimum if optimum > 0 else 1.0)
    return ratios, solve


def summary_row(name: str, ratios: list[float], solve: list[float]) -> dict:
    return {
        "instances": name,
        "shard_plans": len(ratios),
        "greedy_over_optimum_mean": statistics.mean(ratios) if ratios else float("nan"),
        "greedy_over_optimum_max": max(ratios) if ratios else float("nan"),
        "share_at_optimum": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios) if ratios else 0.0,
        "milp_solve_s_mean": statistics.mean(solve) if solve else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path per budget")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: stable timings on a shared machine)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-optimal", action="store_true")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    if not args.skip_overhead:
        report("memplan_overhead", overhead(args.steps, args.repeats, args.layers, args.width),
               load_avg_at_start=load, threads=args.threads)
    if not args.skip_optimal:
        rows = optimal_gpt2(args.layers, args.width) + optimal_random(200)
        report("memplan_optimal", rows)
    with open("/proc/loadavg") as f:
        print(f"\nload average at start {load}, at end {f.read().split()[:3]}, "
              f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
