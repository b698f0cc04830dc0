"""Pipelined mode, real: one spilled job on 2 virtual devices vs spilled on 1 (CPU).

    python bench/pipeline.py [--steps 3] [--repeats 2] [--factor 3]
    python bench/pipeline.py --sweep

One GPT-2 (8 layers, width 512, T = 128, batch 8, vocabulary 8192, AdamW) whose plain training
needs ``--factor`` times a virtual device's budget, trained three ways in the same process,
alternating:

* ``spilled``: on one device, the plan ``plan_job`` makes (Hydra's shard tasks, input-batch
  grouping, jit update, prefetch), with every core as torch threads;
* ``spilled, 1 thread``: the same with one torch thread;
* ``pipelined``: on two devices (Harmony PP, ``train_pipelined``): a shard per layer, in
  microbatches of 2 (M = 4 flow through), packed over the devices by ``pipeline_shape``
  (balanced-time packing) and ``choose_packs``: one pack per device when two fit, else
  wrap-around (more packs than devices, each device swapping its packs in turn); one torch
  thread per device.

Step time = time between consecutive ``on_step`` events (the first step, a warm-up, dropped),
median over the repeats; process CPU time likewise. Bytes per step: host <-> device (promote +
demote) and device -> device (p2p) counted by the devices between consecutive steps, median.

``--sweep``: three such jobs (10, 2 and 2 steps) at once on an executor with two devices of
half the footprint, shard tasks under Sharded-LRTF, with and without ``pipeline=True``: the
makespan, and how many steps of the tail ran pipelined.

With one resident pack per device the devices together must hold the job's resident state
(parameters, gradients, boundary inputs and what optimizer state fits); past that (4x on two
devices) the job wraps around.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

import torch
from harness import report
from spill import gpt2_spec

from sweepmaster.runtime import (
    ShardExecutor,
    TrainCallbacks,
    VirtualDevice,
    make_plan,
    plan_job,
    profile_model,
    train_spilled,
)
from sweepmaster.runtime.planning.pipeline_plan import (
    pipeline_device_bytes,
    pipeline_state_stays,
)
from sweepmaster.runtime.scheduling.pipeline import choose_packs
from sweepmaster.runtime.training.pipelined import train_pipelined
from sweepmaster.sweep.plan import pipeline_shape
from sweepmaster.workload import TrainSpec

MiB = 2**20


class StepMeter(TrainCallbacks):
    """Wall and CPU time, host and p2p bytes of the devices, at every step."""

    def __init__(self, devices: list[VirtualDevice]) -> None:
        self.devices = devices
        self.marks: list[tuple[float, float, int, int]] = []

    def on_step(self, event):  # noqa: ANN001, ANN201
        host = sum(d.transfers.swap_bytes for d in self.devices)
        p2p = sum(d.transfers.p2p_in_bytes for d in self.devices)
        self.marks.append((time.perf_counter(), time.process_time(), host, p2p))

    def deltas(self, index: int) -> list[float]:
        return [b[index] - a[index] for a, b in zip(self.marks, self.marks[1:], strict=False)]


def compare(spec: TrainSpec, plain_bytes: int, factor: float, microbatch: int,
            repeats: int) -> None:
    """The three runs at one footprint / budget ratio (see the module doc)."""
    cores = os.cpu_count() or 1
    budget = int(plain_bytes / factor)
    plan = plan_job(spec, VirtualDevice("cpu:plan", budget_bytes=budget))
    cuts = list(range(plan.shards[-1].stop + 1))  # a shard per layer: packs can balance
    small = make_plan(profile_model(spec, microbatch), spec.optimizer, cuts,
                      VirtualDevice("cpu:plan", budget_bytes=budget))
    shape = pipeline_shape(small, 2)
    packs = None if shape is None else choose_packs(shape, 2)
    if packs is None:  # not even a shard per pack, wrapped around the two devices
        need = max(pipeline_device_bytes(small, range(len(small.shards) + 1), 2))
        print(f"{factor}x: no packs fit: a shard per pack needs {need / MiB:.0f} MiB on a "
              f"device, a device has {budget / MiB:.0f} MiB", flush=True)
        return
    stays = pipeline_state_stays(small, packs, 2)
    runs = {
        "spilled": lambda clock, devices: train_spilled(spec, devices[0], plan, clock),
        "spilled, 1 thread": lambda clock, devices: train_spilled(spec, devices[0], plan, clock),
        "pipelined, 2 devices":
            lambda clock, devices: train_pipelined(spec, devices, small, packs, clock),
    }
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    host: dict[str, list[float]] = {name: [] for name in runs}
    p2p: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, int] = {}
    names = list(runs)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            pipelined = name.startswith("pipelined")
            devices = [VirtualDevice(f"cpu:{i}", budget_bytes=budget)
                       for i in range(2 if pipelined else 1)]
            one = name.endswith("1 thread")
            torch.set_num_threads(1 if one else max(1, cores // len(devices)))
            clock = StepMeter(devices)
            result = runs[name](clock, devices)
            wall[name] += clock.deltas(0)
            cpu[name] += clock.deltas(1)
            host[name] += clock.deltas(2)
            p2p[name] += clock.deltas(3)
            peaks[name] = max(peaks.get(name, 0), result.peak_device_bytes or 0)
    base = statistics.median(wall["spilled"])
    base_cpu = statistics.median(cpu["spilled"])
    rows = []
    for name in names:
        step = statistics.median(wall[name])
        rows.append({
            "run": name,
            "footprint_x": factor,
            "budget_MiB": budget / MiB,
            "shards": f"{len(small.shards)} in {len(packs) - 1} packs " + "/".join(
                f"{a}-{b - 1}" for a, b in zip(packs, packs[1:], strict=False))
            if name.startswith("pipelined") else str(len(plan.shards)),
            "microbatch": microbatch if name.startswith("pipelined") else "/".join(
                str(s.microbatch_size) for s in plan.shards),
            "step_s": step,
            "speedup": base / step,
            "cpu_s": statistics.median(cpu[name]),
            "cpu_ratio": statistics.median(cpu[name]) / base_cpu,
            "host_MiB_per_step": statistics.median(host[name]) / MiB,
            "p2p_MiB_per_step": statistics.median(p2p[name]) / MiB,
            "peak_MiB": peaks[name] / MiB,
        })
        print(rows[-1], flush=True)
    report("pipeline", rows, states_stay=stays, load_average=os.getloadavg())


def sweep_makespan(factor: float, microbatch: int, steps: tuple[int, ...]) -> None:
    """A sweep of jobs on 2 devices whose tail has one job: makespan with and without pipelining.

    The jobs (learning rates differ) are submitted at once to an executor on two virtual devices
    of ``plain footprint / factor`` each, shard tasks under Sharded-LRTF; with ``pipeline=True``
    the policy pipelines a job's steps over both devices when it is the only one ready.
    """
    rows = []
    for pipeline in (False, True):
        specs = [dataclasses.replace(
            gpt2_spec(n_layer=8, n_embd=512, block=128, batch=8, steps=n), name=f"job{i}",
            optimizer=dataclasses.replace(gpt2_spec(8, 512, 128, 8, 1).optimizer,
                                          lr=1e-4 * (i + 1)))
            for i, n in enumerate(steps)]
        plain_bytes = plan_job(specs[0], VirtualDevice("cpu:probe",
                                                       budget_bytes=1 << 40)).plain_bytes
        budget = int(plain_bytes / factor)
        devices = [VirtualDevice(f"cpu:{i}", budget_bytes=budget) for i in range(2)]
        records: list[Any] = []
        with ShardExecutor(devices, microbatch_size=microbatch, pipeline=pipeline,
                      plan_activations=False, on_task=records.append) as executor:
            shape = pipeline_shape(executor.plan(specs[0]), 2)
            start = time.perf_counter()
            results = [f.result() for f in [executor.submit(spec) for spec in specs]]
            makespan = time.perf_counter() - start
        rows.append({
            "mode": "pipelined tail" if pipeline else "shard tasks only",
            "jobs (steps)": "/".join(str(n) for n in steps),
            "footprint_x": factor,
            "packs": "/".join(str(c) for c in shape.packs[0]) if shape and shape.packs else "",
            "makespan_s": makespan,
            "pipelined_steps": sum(r.kind == "pipeline" for r in records) // 2,
            "host_MiB": sum(d.transfers.swap_bytes for d in devices) / MiB,
            "p2p_MiB": sum(r.p2p_bytes for r in results) / MiB,
        })
        print(rows[-1], flush=True)
    rows[1]["speedup"] = rows[0]["makespan_s"] / rows[1]["makespan_s"]
    rows[0]["speedup"] = 1.0
    report("pipeline_sweep", rows, load_average=os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--factor", type=float, default=3.0,
                        help="plain footprint / device budget")
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--sweep", action="store_true",
                        help="instead: 3 jobs (10/2/2 steps) on 2 devices at 2x, microbatch 4")
    args = parser.parse_args()
    if args.sweep:
        sweep_makespan(2.0, 4, (10, 2, 2))
        return
    spec = gpt2_spec(n_layer=8, n_embd=512, block=128, batch=8, steps=args.steps + 1)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    for factor in sorted({4.0, args.factor}, reverse=True):
        compare(spec, plain_bytes, factor, args.microbatch, args.repeats)


if __name__ == "__main__":
    main()
