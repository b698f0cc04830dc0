"""Spilling benchmarks: overhead, capacity and swap volume on virtual devices (CPU).

    python bench/spill.py [--steps 3] [--skip-capacity]

1. Overhead: one GPT-2 trained plain and spilled (Hydra's full recompute, jit update, input-batch
   grouping, prefetch) in the same process, alternating, on virtual devices of 1/4 and 1/8 of its
   plain footprint. Step time = time between consecutive ``on_step`` events (the first step, a
   warm-up, is dropped). Target: spilled / plain <= 1.25.
2. Capacity: GPT-2 configs of growing depth and width (vocabulary 2048) planned for a fixed
   64 MiB budget; the largest that plans is trained for real (2 steps) and its metered peak
   reported. Figure of merit: plain training footprint / budget. Target >= 10x. The widest layer
   bounds what fits (its parameters, gradients and optimizer state at once); depth does not.
3. Swap volume per steady-state step, measured, next to the plan's estimate and to Harmony's
   analytic figure for its schedule (Li et al., VLDB 2022: with input-batch grouping and
   just-in-time update, weights are swapped in twice and out once per iteration, optimizer state
   in and out once, gradients never: ``3W + 2K``), per parameter byte, for 1 and 4 microbatches.

With ``--resident``: only a job that fits its device, trained through the ``ShardExecutor`` (one
shard, kept resident between its steps; on the host CPU its transfers are in place) against
``train_plain`` in the same process, alternating: the cost of training every job by shard tasks.
With ``--members K`` too: a fused array of K that fits (one stacked shard) against
``train_fused_spilled`` on the same one-stacked-shard plan, run directly (no executor).

With ``--profile``: where a spilled step's time goes, for the 4x-budget model of (1): seconds
per step by shard-task kind, and by ATen operator (``torch.profiler``, self CPU time) next to
plain training, plus the time spent outside operators (Python, the meter's dispatch mode).

Random token ids (vocabulary 8192; 2048 for capacity) stand in for text: only shapes matter.
Timings use one intra-op thread by default (``--threads``): the machine is shared, and wall time
under load is noisy, so the process CPU time ratio is reported too.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

import torch
from harness import report
from transformers import GPT2Config

from sweepmaster.runtime import (
    CudaDevice,
    Device,
    LayerTooLargeError,
    ShardExecutor,
    SpilledJob,
    TrainCallbacks,
    VirtualDevice,
    plan_job,
    profile_model,
    train_plain,
    train_spilled,
)
from sweepmaster.runtime.planning.profile import optimizer_state_bytes
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import train_fused_spilled
from sweepmaster.workload import OptimizerSpec, TrainSpec

MiB = 2**20
VOCAB = 8192
#: The tied embedding (parameters, gradients, AdamW state, the head's contribution) is one layer:
#: with 8192 tokens it alone outgrows 64 MiB at width 512, so capacity uses 2048.
CAPACITY_VOCAB = 2048


class StepClock(TrainCallbacks):
    """Wall and process-CPU time between consecutive steps."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def on_step(self, event):  # noqa: ANN001, ANN201
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.times.append((time.perf_counter(), time.process_time()))

    def step_seconds(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.times, self.times[1:], strict=False)]

    def step_cpu_seconds(self) -> list[float]:
        return [b[1] - a[1] for a, b in zip(self.times, self.times[1:], strict=False)]


def gpt2_spec(
    n_layer: int, n_embd: int, block: int, batch: int, steps: int, vocab: int = VOCAB
) -> TrainSpec:
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64), n_positions=block,
        vocab_size=vocab, bos_token_id=0, eos_token_id=0,
    )
    generator = torch.Generator().manual_seed(0)
    return TrainSpec(
        model=config,
        train_data=torch.randint(0, vocab, (4 * batch, block), generator=generator),
        optimizer=OptimizerSpec(name="adamw", lr=1e-4, weight_decay=0.1),
        batch_size=batch,
        max_steps=steps,
        seed=0,
    )


def plan_fitting(spec: TrainSpec, device: Device):  # noqa: ANN201
    """The plan (each shard gets the largest microbatch that fits; see partition.py)."""
    return plan_job(spec, device)


def overhead(
    steps: int, n_layer: int, n_embd: int, repeats: int, device_name: str = "cpu",
    block: int = 128, batch: int = 8, vocab: int = VOCAB,
) -> list[dict]:
    """Spilled vs plain step time at 1/4 and 1/8 of the plain footprint.

    On ``cpu`` the spilled device is a :class:`VirtualDevice`; on ``cuda:N`` a
    :class:`CudaDevice` capped at the budget, and plain training runs on the same GPU with the
    allocator's limit lifted (the capped device limits the whole process while it runs).
    """
    spec = gpt2_spec(n_layer=n_layer, n_embd=n_embd, block=block, batch=batch, steps=steps + 1,
                     vocab=vocab)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    on_cuda = device_name.startswith("cuda")
    rows = []
    for factor in (4, 8):
        budget = plain_bytes // factor
        device: Device
        if on_cuda:
            device = CudaDevice(device_name, memory_cap_bytes=budget)
            budget = device.budget_bytes  # the cap less the headroom
        else:
            device = VirtualDevice(f"cpu:x{factor}", budget_bytes=budget)
        plan = plan_fitting(spec, device)
        paths = ("plain", "spilled") if on_cuda else ("plain", "plain_metered", "spilled")
        wall: dict[str, list[float]] = {path: [] for path in paths}
        cpu: dict[str, list[float]] = {path: [] for path in paths}
        for repeat in range(repeats):
            for path in paths if repeat % 2 == 0 else paths[::-1]:
                clock = StepClock()
                if on_cuda:
                    torch.cuda.empty_cache()
                    fraction = 1.0 if path == "plain" else device.cuda_budget.memory_fraction
                    torch.cuda.set_per_process_memory_fraction(fraction, device.torch_device)
                if path == "plain":
                    train_plain(spec, Device(device_name), clock)
                elif path == "plain_metered":  # plain under a virtual device's meter
                    host = VirtualDevice("cpu:host", budget_bytes=1 << 40)
                    with host.meter.metering():
                        train_plain(spec, host, clock)
                else:
                    result = train_spilled(spec, device, plan, clock)
                wall[path] += clock.step_seconds()
                cpu[path] += clock.step_cpu_seconds()
        med = {path: statistics.median(wall[path]) for path in paths}
        med_cpu = {path: statistics.median(cpu[path]) for path in paths}
        rows.append({
            "model": f"gpt2 {n_layer}x{n_embd}, T={block}, B={batch}, V={vocab}",
            "device": device_name,
            "plain_footprint_MiB": plan.plain_bytes / MiB,
            "budget_MiB": budget / MiB,
            "footprint_x": plan.plain_bytes / budget,
            "shards": len(plan.shards),
            "microbatches": "/".join(str(s.microbatch_size) for s in plan.shards),
            "plain_step_s": med["plain"],
            "spilled_step_s": med["spilled"],
            "overhead_x": med["spilled"] / med["plain"],
            "overhead_cpu_x": med_cpu["spilled"] / med_cpu["plain"],
            "overhead_vs_metered_plain_x": (
                med["spilled"] / med["plain_metered"] if "plain_metered" in med else None
            ),
            "peak_MiB": (result.peak_device_bytes or 0) / MiB,
        })
        print(rows[-1], flush=True)
    return rows


def resident(
    steps: int, n_layer: int, n_embd: int, repeats: int, block: int = 128, batch: int = 8,
    vocab: int = VOCAB, members: int = 1,
) -> list[dict]:
    """A job (or fused array) that fits, through the ShardExecutor (S = 1, resident): step times.

    One job against ``train_plain``, or with ``members`` K > 1 an array of K (seeds and learning
    rates differ) through ``ShardExecutor.submit_fused`` against ``train_fused_spilled`` on one
    stacked shard holding the whole array (the executor's plan, its tasks run in order without
    the executor). On the host CPU
    (``"cpu"``) and on a virtual device of twice the plain footprint (there also against the
    reference under a virtual device's meter, which the executor's tasks run under); median
    over ``repeats`` runs of each, alternating, of the steps after the first (member 0's).
    """
    spec = gpt2_spec(n_layer=n_layer, n_embd=n_embd, block=block, batch=batch, steps=steps + 1,
                     vocab=vocab)
    specs = [dataclasses.replace(spec, seed=k, name=f"m{k}",
                                 optimizer=dataclasses.replace(spec.optimizer,
                                                               lr=spec.optimizer.lr * (k + 1)))
             for k in range(members)]
    probe = VirtualDevice("cpu:probe", budget_bytes=1 << 40)
    plain_bytes = (plan_job(spec, probe) if members == 1 else
                   plan_stacked(spec, members, probe)).plain_bytes

    def reference(device: Device, clock: StepClock) -> None:
        if members == 1:
            train_plain(spec, device, clock)
        else:
            plan = plan_stacked(stacked_spec(specs), members, device, whole=True)
            train_fused_spilled(specs, device, plan, [clock, *[None] * (members - 1)])

    rows = []
    for devices in ("cpu", f"cpu:1x{2 * plain_bytes}"):
        paths = ("plain", "executor") if devices == "cpu" else (
            "plain", "plain_metered", "executor")
        wall: dict[str, list[float]] = {path: [] for path in paths}
        cpu: dict[str, list[float]] = {path: [] for path in paths}
        for repeat in range(repeats):
            for path in paths if repeat % 2 == 0 else paths[::-1]:
                clock = StepClock()
                if path == "plain":
                    reference(Device("cpu"), clock)
                elif path == "plain_metered":
                    host = VirtualDevice("cpu:host", budget_bytes=1 << 40)
                    with host.meter.metering():
                        reference(host, clock)
                else:
                    with ShardExecutor(devices) as executor:
                        if members == 1:
                            num_shards = len(executor.plan(spec).shards)
                            result = executor.fit(spec, clock)
                        else:
                            futures = executor.submit_fused(
                                specs, [clock, *[None] * (members - 1)])
                            result = futures[0].result()
                            num_shards = len(executor.stacked_plan(
                                executor.fused_spec(specs), members,
                                whole=not executor.will_spill(spec)).shards)
                wall[path] += clock.step_seconds()
                cpu[path] += clock.step_cpu_seconds()
        med = {path: statistics.median(values) for path, values in wall.items()}
        med_cpu = {path: statistics.median(values) for path, values in cpu.items()}
        rows.append({
            "model": f"gpt2 {n_layer}x{n_embd}, T={block}, B={batch}, V={vocab}",
            "members": members,
            "reference": "train_plain" if members == 1 else "train_fused_spilled",
            "device": devices,
            "shards": num_shards,
            "plain_step_s": med["plain"],
            "executor_step_s": med["executor"],
            "ratio_wall_x": med["executor"] / med["plain"],
            "ratio_cpu_x": med_cpu["executor"] / med_cpu["plain"],
            "ratio_cpu_vs_metered_plain_x": (
                med_cpu["executor"] / med_cpu["plain_metered"] if "plain_metered" in med_cpu
                else None),
            "num_promotes": result.num_promotes,
            "swap_MiB": result.swap_bytes / MiB,
        })
        print(rows[-1], flush=True)
    return rows


def capacity(budget: int) -> list[dict]:
    device = VirtualDevice("cpu:cap", budget_bytes=budget)
    candidates = [(12, 256), (24, 512), (48, 512), (12, 768)]
    rows = []
    best = None
    for n_layer, n_embd in candidates:
        spec = gpt2_spec(n_layer, n_embd, block=64, batch=4, steps=2, vocab=CAPACITY_VOCAB)
        try:
            plan = plan_fitting(spec, device)
        except LayerTooLargeError as err:
            nan = float("nan")
            rows.append({"config": f"{n_layer}x{n_embd}", "params_M": nan,
                         "plain_footprint_MiB": nan, "footprint_x": nan, "shards": 0,
                         "microbatch": 0, "trained": f"no: {err.layer} too large",
                         "plan_peak_MiB": nan, "measured_peak_MiB": nan, "plan_step_s": nan,
                         "measured_step_s": nan})
            continue
        params = sum(profile_model(spec, plan.microbatch_size).param_bytes.values()) / 4
        rows.append({"config": f"{n_layer}x{n_embd}", "params_M": params / 1e6,
                     "plain_footprint_MiB": plan.plain_bytes / MiB,
                     "footprint_x": plan.plain_bytes / budget, "shards": len(plan.shards),
                     "microbatch": min(s.microbatch_size for s in plan.shards),
                     "trained": "planned", "plan_peak_MiB": plan.peak_bytes / MiB,
                     "measured_peak_MiB": float("nan"), "plan_step_s": plan.step_s,
                     "measured_step_s": float("nan")})
        if best is None or plan.plain_bytes > best[1].plain_bytes:
            best = (spec, plan, len(rows) - 1)
    assert best is not None
    spec, plan, index = best
    clock = StepClock()
    result = train_spilled(spec, device, plan, clock)
    rows[index]["trained"] = f"yes, {result.steps} steps"
    rows[index]["measured_peak_MiB"] = (result.peak_device_bytes or 0) / MiB
    rows[index]["measured_step_s"] = clock.step_seconds()[0]
    assert (result.peak_device_bytes or 0) <= budget
    return rows


def swap_volume(steps: int) -> list[dict]:
    spec = gpt2_spec(n_layer=8, n_embd=256, block=128, batch=8, steps=steps)
    rows = []
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    for microbatch in (8, 2):
        device = VirtualDevice("cpu:swap", budget_bytes=plain_bytes // 4)
        plan = plan_job(spec, device, microbatch_size=microbatch)
        job = SpilledJob(spec, plan)
        while (task := job.next_task()) is not None:
            job.prefetch(job.peek_task(), device)
            job.run(task, device)
        profile = profile_model(spec, microbatch)
        weights = profile.total_param_bytes
        state = sum(optimizer_state_bytes(n, spec.optimizer) for n in profile.param_bytes.values())
        measured = statistics.median(job.bookkeeping.step_swap_bytes[1:])
        harmony = 3 * weights + 2 * state
        rows.append({
            "model": "gpt2 8x256, T=128, B=8",
            "microbatches": plan.num_microbatches(0),
            "shards": len(plan.shards),
            "param_MiB": weights / MiB,
            "measured_swap_MiB_per_step": measured / MiB,
            "plan_swap_MiB_per_step": plan.swap_bytes_per_step / MiB,
            "harmony_3W_2K_MiB": harmony / MiB,
            "measured_per_param_byte": measured / weights,
            "harmony_per_param_byte": harmony / weights,
            "measured_over_harmony": measured / harmony,
        })
        print(rows[-1], flush=True)
    return rows


def profile_spill(steps: int, n_layer: int, n_embd: int) -> tuple[list[dict], list[dict]]:
    """Seconds per step of spilled training by task kind, and by operator next to plain.

    Task times come from a run without the profiler, steps 2.. (the first warms up): wall
    seconds and the main thread's CPU seconds (``time.thread_time``: robust to other processes
    on a shared machine; background prefetch copies excluded). Operator times come from whole
    runs (model build and every step, for both paths) under ``torch.profiler``.
    """
    from torch.profiler import ProfilerActivity, profile

    spec = gpt2_spec(n_layer=n_layer, n_embd=n_embd, block=128, batch=8, steps=steps + 1)
    plain_bytes = plan_job(spec, VirtualDevice("cpu:probe", budget_bytes=1 << 40)).plain_bytes
    device = VirtualDevice("cpu:x4", budget_bytes=plain_bytes // 4)
    plan = plan_job(spec, device)
    last = len(plan.shards) - 1
    num_steps = steps + 1

    def kind_of(task: object) -> str:
        if task.kind == "forward":  # type: ignore[attr-defined]
            return "forward"
        if task.shard == last:  # type: ignore[attr-defined]
            return "backward of the last shard (forward, loss, backward, jit update)"
        return "backward (recompute, backward, jit update)"

    def run_spilled() -> dict[str, list[float]]:
        """Seconds per task kind over steps 2.. (the first step warms up)."""
        job = SpilledJob(spec, plan)
        times: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        while (task := job.next_task()) is not None:
            job.prefetch(job.peek_task(), device)
            wall, cpu = time.perf_counter(), time.thread_time()
            job.run(task, device)
            if task.step >= 1:
                entry = times[kind_of(task) if task.phase == "train" else "other"]
                entry[0] += time.perf_counter() - wall
                entry[1] += time.thread_time() - cpu
        return times

    class Clock(TrainCallbacks):
        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []

        def on_step(self, event):  # noqa: ANN001, ANN201
            self.marks.append((time.perf_counter(), time.thread_time()))

    def run_plain() -> tuple[float, float]:
        """Seconds of steps 2.. (from the end of the first step to the end of the last)."""
        clock = Clock()
        train_plain(spec, Device("cpu"), clock)
        (wall0, cpu0), (wall1, cpu1) = clock.marks[0], clock.marks[-1]
        return wall1 - wall0, cpu1 - cpu0

    run_plain()  # warm-up (allocator, kernels)
    plain_wall, plain_cpu = run_plain()
    tasks = run_spilled()
    spilled_wall = sum(wall for wall, _ in tasks.values())
    spilled_cpu = sum(cpu for _, cpu in tasks.values())
    task_rows = [{"task": kind, "wall_s_per_step": wall / steps, "cpu_s_per_step": cpu / steps,
                  "cpu_share": cpu / spilled_cpu}
                 for kind, (wall, cpu) in sorted(tasks.items())]
    task_rows.append({"task": "spilled step", "wall_s_per_step": spilled_wall / steps,
                      "cpu_s_per_step": spilled_cpu / steps, "cpu_share": 1.0})
    task_rows.append({"task": "plain step", "wall_s_per_step": plain_wall / steps,
                      "cpu_s_per_step": plain_cpu / steps, "cpu_share": plain_cpu / spilled_cpu})

    def op_seconds(prof) -> dict[str, float]:  # noqa: ANN001
        return {e.key: e.self_cpu_time_total / 1e6 / num_steps for e in prof.key_averages()}

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_plain(spec, Device("cpu"))
    plain_ops = op_seconds(prof)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_spilled(spec, device, plan)
    spilled_ops = op_seconds(prof)
    names = sorted(set(plain_ops) | set(spilled_ops),
                   key=lambda n: -abs(spilled_ops.get(n, 0.0) - plain_ops.get(n, 0.0)))
    op_rows = [{"operator": name, "plain_s_per_step": plain_ops.get(name, 0.0),
                "spilled_s_per_step": spilled_ops.get(name, 0.0),
                "extra_s_per_step": spilled_ops.get(name, 0.0) - plain_ops.get(name, 0.0)}
               for name in names[:12]]
    totals = {path: sum(ops.values()) for path, ops in (("plain", plain_ops),
                                                        ("spilled", spilled_ops))}
    op_rows.append({"operator": "all operators", "plain_s_per_step": totals["plain"],
                    "spilled_s_per_step": totals["spilled"],
                    "extra_s_per_step": totals["spilled"] - totals["plain"]})
    for row in task_rows + op_rows:
        print(row, flush=True)
    return task_rows, op_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="plain/spilled runs per budget")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: stable timings on a shared machine)")
    parser.add_argument("--device", default="cpu",
                        help="overhead only: cpu (virtual devices) or cuda:N (a capped GPU)")
    parser.add_argument("--block", type=int, default=128, help="overhead: tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="overhead: sequences per step")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="overhead: vocabulary size")
    parser.add_argument("--skip-swap", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--capacity-budget-mib", type=int, default=64)
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="only profile where a spilled step's time goes (4x budget)")
    parser.add_argument("--resident", action="store_true",
                        help="only a job that fits, through the ShardExecutor vs train_plain")
    parser.add_argument("--members", type=int, default=1,
                        help="resident: K > 1 fuses K members (vs train_fused_spilled, S = 1)")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.profile:
        task_rows, op_rows = profile_spill(args.steps, args.layers, args.width)
        report("spill_profile_tasks", task_rows, load_avg_at_start=load, threads=args.threads)
        report("spill_profile_ops", op_rows, load_avg_at_start=load, threads=args.threads)
        return
    if args.resident:
        rows = resident(args.steps, args.layers, args.width, args.repeats, args.block,
                        args.batch, args.vocab, args.members)
        report("spill_resident", rows, load_avg_at_start=load, threads=args.threads)
        return
    if not args.skip_overhead:
        rows = overhead(args.steps, args.layers, args.width, args.repeats, args.device,
                        args.block, args.batch, args.vocab)
        report("spill_overhead", rows, load_avg_at_start=load, threads=args.threads)
    if not args.skip_swap:
        report("spill_swap", swap_volume(args.steps))
    if not args.skip_capacity:
        report("spill_capacity", capacity(args.capacity_budget_mib * MiB),
               budget_MiB=args.capacity_budget_mib)
    with open("/proc/loadavg") as f:
        print(f"\nload average at start {load}, at end {f.read().split()[:3]}, "
              f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
