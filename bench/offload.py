"""Update on the host (ZeRO-Offload) against on the device, for a spilled tiny GPT-2.

    python bench/offload.py [--steps 4] [--repeats 2] [--threads 1]

One GPT-2 spilled on a virtual device of 1/4 of its plain footprint, trained by shard tasks
with its optimizer steps on the device (Harmony's just-in-time update: state promoted and
demoted per update) and on the host (ZeRO-Offload, Ren et al. ATC 2021: gradients demoted, the
step on the host copies on the host thread, overlapped with the next task), alternating, in the
same process. Reported per site: median step seconds (the first step, a warm-up, dropped),
process CPU seconds per step, swap bytes per steady step (measured, and the plan's), and the
ratio host / device. On virtual devices host and device are the same CPU cores and memory: the
seconds are a proxy (the host step competes with the "device" compute for the same cores), the
bytes are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
from harness import report
from transformers import GPT2Config

from sweepmaster.runtime import SpilledJob, VirtualDevice, plan_job
from sweepmaster.runtime.planning.update_site import host_optimizer_bytes_per_s, with_update_on
from sweepmaster.workload import OptimizerSpec, TrainSpec

VOCAB = 2048


def gpt2_spec(steps: int) -> TrainSpec:
    config = GPT2Config(n_layer=4, n_embd=128, n_head=2, n_positions=64, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0)
    generator = torch.Generator().manual_seed(0)
    return TrainSpec(
        model=config,
        train_data=torch.randint(0, VOCAB, (32, 64), generator=generator),
        optimizer=OptimizerSpec(name="adamw", lr=1e-4, weight_decay=0.1),
        batch_size=8, max_steps=steps, seed=0,
    )


def run(spec: TrainSpec, plan, budget: int) -> tuple[list[float], list[float], list[int]]:
    """Wall and CPU seconds of each step after the first, and each step's swap bytes."""
    job = SpilledJob(spec, plan)
    device = VirtualDevice("cpu:offload", budget_bytes=budget)
    marks = []
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)
        job.run(task, device)
        if task.phase == "train" and task.kind == "backward" and task.shard == 0:
            marks.append((time.perf_counter(), time.process_time()))
    job.result()
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)]
    return wall, cpu, list(job.step_swap_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = gpt2_spec(args.steps + 1)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    budget = plain_bytes // 4
    device_plan = plan_job(spec, VirtualDevice("cpu:offload", budget_bytes=budget))
    plans = {"device": with_update_on(device_plan, spec.optimizer, "device"),
             "host": with_update_on(device_plan, spec.optimizer, "host")}
    wall: dict[str, list[float]] = {site: [] for site in plans}
    cpu: dict[str, list[float]] = {site: [] for site in plans}
    swaps: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for site in plans if repeat % 2 == 0 else list(plans)[::-1]:
            w, c, s = run(spec, plans[site], budget)
            wall[site] += w
            cpu[site] += c
            swaps[site] = s
    rows = []
    base = statistics.median(wall["device"])
    base_cpu = statistics.median(cpu["device"])
    for site, plan in plans.items():
        step = statistics.median(wall[site])
        rows.append({
            "update_on": site, "shards": len(plan.shards),
            "step_s": round(step, 4), "cpu_s_per_step": round(statistics.median(cpu[site]), 4),
            "swap_MiB_per_step": round(swaps[site][-1] / 2**20, 3),
            "plan_swap_MiB_per_step": round(plan.swap_bytes_per_step / 2**20, 3),
            "ratio_vs_device": round(step / base, 3),
            "cpu_ratio_vs_device": round(statistics.median(cpu[site]) / base_cpu, 3),
        })
    report("offload", rows, threads=args.threads, nproc=os.cpu_count(),
           budget_bytes=budget, plain_bytes=plain_bytes, load_avg_at_start=os.getloadavg()[0],
           host_adamw_bytes_per_s=round(host_optimizer_bytes_per_s(spec.optimizer)),
           spec=dataclasses.asdict(spec.optimizer))


if __name__ == "__main__":
    main()
