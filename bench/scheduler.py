"""SHARP scheduling: Sharded-LRTF vs the exact optimum, vs the baselines, and its overhead.

    python bench/scheduler.py [--parts 1 2 3 4 5] [--instances 60] [--time-limit 30] [--seed 0]
                              [--real-width 128] [--real-layers 6] [--real-budget 24MiB]
                              [--real-steps 8] [--real-repeats 3]

1. Sharded-LRTF makespan / optimal makespan (MILP, HiGHS) on random small instances, compute only
   (the simulator with infinite bandwidth; the MILP models no transfers). Target: mean <= 1.05,
   max <= 1.15. The baselines' ratios are shown too.
2. Sharded-LRTF vs every baseline on the Hydra paper's grid (12 GPT-2 124M jobs: batch sizes
   {16, 8} x 6 learning rates) on 1, 2, 4 and 8 devices, costs from the GPT-2 cost model below.
3. Scheduler overhead at 1,000 jobs: next_task + task_done cycles per second (target >= 100,000).
4. Real CPU run: 4 GPT-2 jobs, each several times a 24 MiB virtual device, trained by the SHARP
   executor on 2 virtual devices vs 1 (half the cores' intra-op threads per device worker in
   both runs, what the executor gives each of 2 virtual devices; one on a 2-core machine):
   throughput ratio (target >= 1.7x), device utilization from the executor's task records; and
   the simulated makespan of the same chains against the real one (target within 10%), with
   ``CostModel.speed`` measured by a short calibration run on the same devices first.
5. Pipelined mode (Harmony PP), simulated: the grid of part 2 (12 jobs) and its first 4 jobs on
   8 devices, Sharded-LRTF without pipelining vs with pipelining, boundary copies p2p or
   through the host: makespan and host-link bytes. Packs from the partitioner's balanced-time
   packing (``pipeline_packs``) over the part-2 shard table on an 80 GB device; M = batch size
   microbatches of one sequence; boundary activation B x T x d fp32; p2p at PCIe speed (16 GB/s,
   Harmony's commodity servers) and at NVLink-class 150 GB/s.
   Then the same jobs on 8 devices of a 1.4 GB budget (``SMALL_DEVICE_BYTES``), packed by the
   planner itself (``pipeline_shape`` over a ``JobPlan`` of the same shards, below): the fewest
   packs that fit one per device are 3, so 4 jobs sharing 8 devices (2 each) pipeline only
   wrap-around over their share (``PipelineShape.wrap``). Sharded-LRTF without pipelining vs
   pipelined with those shapes vs pipelined with each shape's ``wrap`` emptied (what was
   offered before: no pipelining on fewer devices than the fewest packs). The policy prices
   layouts at the cost model's links (PCIe, and p2p where it has it) and pipelines a job only
   where its step is predicted faster than as shard tasks (``choose_packs`` with ``step_s``).

GPT-2 124M cost model (part 2): 12 blocks of 12 d^2 + 13 d parameters (d = 768), embeddings
(50257 + 1024) x d in shard 0, the tied LM head (50257 x d) in the last shard, blocks split evenly
into 4 shards; sequence 1024 tokens. Forward FLOPs per token: 2 x block parameters + 4 x T x d of
attention per block, 2 x 50257 x d for the head. Backward = 2 x forward, plus 1 x forward of
in-shard recompute (Hydra) for every shard but the last, which runs forward + backward at once.
Compute at an effective 30 TFLOP/s; fp32 parameters (4 B) promoted for a forward; parameters +
Adam moments (12 B/parameter) promoted and written back for a backward (just-in-time update).
Host <-> device: 16 GB/s per direction per device (PCIe 4 x16), double-buffered prefetch; a shard
stays resident only before its job's next task of the same shard (the executor's residency cache;
the tasks carry no planned peak, so each takes its device and nothing of other jobs stays beside).
One epoch of WikiText-2 (~2.4 M GPT-2 tokens): 147 steps at batch 16, 293 at 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

from harness import report

from sweepmaster.runtime.scheduling.chains import JobSpec
from sweepmaster.runtime.scheduling.optimal import optimal_makespan
from sweepmaster.runtime.scheduling.pipeline import PipelineShape, choose_packs, pipeline_step
from sweepmaster.runtime.scheduling.policies import ShardedLRTF, policy_names
from sweepmaster.runtime.scheduling.scheduler import Policy
from sweepmaster.runtime.scheduling.sim_model import CostModel, SimResult
from sweepmaster.runtime.scheduling.simulate import simulate

FREE = CostModel(bandwidth_bytes_per_s=math.inf)  # no transfers, hence no lookahead
LOOKAHEAD_ONLY = CostModel(bandwidth_bytes_per_s=1e30)  # ~free transfers, lookahead asked
BASELINES = [n for n in policy_names() if n != ShardedLRTF.name]

# GPT-2 124M and the hardware assumptions of part 2.
D_MODEL, N_LAYER, VOCAB, N_CTX, SEQ = 768, 12, 50257, 1024, 1024
NUM_SHARDS = 4
FLOP_PER_S = 30e12
PCIE_BYTES_PER_S = 16e9
TRAIN_TOKENS = 2_400_000
DEVICE_BYTES = 80e9  # part 5: an 80 GB-class GPU
SMALL_DEVICE_BYTES = 1.4e9  # part 5, wrap-around: fewest packs that fit one per device are 3
NVLINK_BYTES_PER_S = 150e9


def random_instance(rng: random.Random, max_tasks: int = 16) -> tuple[int, list[JobSpec]]:
    """2-3 devices, 2-6 jobs of 1-3 shards (1-5 tasks per step), at most ``max_tasks`` tasks."""
    while True:
        jobs = []
        for j in range(rng.randint(2, 6)):
            shards = rng.choice([1, 1, 2, 2, 3])
            jobs.append(JobSpec.from_shards(
                f"j{j}", rng.choice([1, 2]) if shards == 1 else 1,
                [round(rng.uniform(0.2, 1.5), 2) for _ in range(shards)],
                [round(rng.uniform(0.4, 3.0), 2) for _ in range(shards)],
                [1] * shards, [3] * shards))
        if sum(j.num_tasks for j in jobs) <= max_tasks:
            return rng.choice([2, 3]), jobs


def part_optimal(num_instances: int, time_limit_s: float, seed: int) -> None:
    rng = random.Random(seed)
    runs: dict[str, tuple[Callable[[int], Policy], CostModel]] = {
        name: (policy_names()[name], FREE) for name in [ShardedLRTF.name, *BASELINES]}
    runs["sharded-lrtf+reserved-lookahead"] = (ShardedLRTF, LOOKAHEAD_ONLY)
    ratios: dict[str, list[float]] = {n: [] for n in runs}
    bound_ratios, solve_s, proven = [], [], 0
    for _ in range(num_instances):
        num_devices, jobs = random_instance(rng)
        start = time.perf_counter()
        best = optimal_makespan(jobs, num_devices, time_limit_s=time_limit_s)
        solve_s.append(time.perf_counter() - start)
        proven += best.optimal
        for name, (make, cost) in runs.items():
            makespan = simulate(make(num_devices), jobs, cost).makespan_s
            ratios[name].append(makespan / best.makespan_s)
        bound_ratios.append(ratios[ShardedLRTF.name][-1] * best.makespan_s / best.lower_bound_s)
    rows = [{"policy": n, "instances": num_instances, "mean_ratio": statistics.fmean(r),
             "max_ratio": max(r), "optimal_share": sum(x <= 1 + 1e-6 for x in r) / len(r)}
            for n, r in ratios.items()]
    report("scheduler_optimal", rows, proven_optimal=proven, time_limit_s=time_limit_s,
           lrtf_max_ratio_vs_lower_bound=max(bound_ratios),
           mean_solve_s=statistics.fmean(solve_s), max_solve_s=max(solve_s),
           note="makespan / MILP optimum, compute only (zero transfer time; the simulator then "
                "asks no lookahead). 'reserved-lookahead': transfers ~free but lookahead asked, "
                "so each device commits to its next job a task early. Targets for sharded-lrtf: "
                "mean <= 1.05, max <= 1.15")


def gpt2_job(job_id: str, batch_size: int, pipeline: bool = False) -> JobSpec:
    """One GPT-2 124M trial spilled into NUM_SHARDS shards, per the cost model above.

    ``pipeline``: with its pipeline shape (part 5), packs for up to 8 devices.
    """
    block_params = 12 * D_MODEL**2 + 13 * D_MODEL
    block_flops = 2 * block_params + 4 * SEQ * D_MODEL  # forward, per token
    per_shard = N_LAYER // NUM_SHARDS
    params = [per_shard * block_params] * NUM_SHARDS
    params[0] += (VOCAB + N_CTX) * D_MODEL
    params[-1] += VOCAB * D_MODEL + 2 * D_MODEL
    flops = [per_shard * block_flops] * NUM_SHARDS
    flops[-1] += 2 * VOCAB * D_MODEL
    tokens = batch_size * SEQ
    forward = [tokens * f / FLOP_PER_S for f in flops]
    backward = [3 * s for s in forward]
    backward[-1] = 2 * forward[-1]  # the last shard runs forward + backward at once: no recompute
    steps = math.ceil(TRAIN_TOKENS / SEQ / batch_size)
    spec = JobSpec.from_shards(job_id, steps, forward, backward, [4 * p for p in params],
                               [12 * p for p in params])
    if not pipeline:
        return spec
    from sweepmaster.runtime.planning.pipeline_plan import pipeline_packs

    boundary = tokens * D_MODEL * 4
    state = [12 * p for p in params]
    shape = PipelineShape(
        forward_s=tuple(forward), backward_s=tuple(backward), state_bytes=tuple(state),
        boundary_bytes=(boundary,) * (NUM_SHARDS - 1) + (0,), input_bytes=tokens * 8,
        num_microbatches=batch_size,
        packs=tuple(pipeline_packs([f + b for f, b in zip(forward, backward, strict=True)],
                                   [s + 2 * boundary for s in state], int(DEVICE_BYTES), 8,
                                   label_bytes=tokens * 8)))
    return JobSpec(job_id, spec.step_tasks, steps, pipeline=shape)


def part_grid() -> None:
    lrs = [1e-4, 3e-4, 6e-4, 1e-3, 3e-3, 6e-3]
    grid = [gpt2_job(f"bs{bs}-lr{lr:g}", bs) for bs in (16, 8) for lr in lrs]
    cost = CostModel(bandwidth_bytes_per_s=PCIE_BYTES_PER_S, prefetch=True)
    makers: dict[str, Callable[[int], Policy]] = dict(policy_names())
    makers["sharded-lrtf/no-reservation"] = partial(ShardedLRTF, reserve_lookahead=False)
    rows = []
    for num_devices in (1, 2, 4, 8):
        results = {name: simulate(make(num_devices), grid, cost) for name, make in makers.items()}
        lrtf = results[ShardedLRTF.name].makespan_s
        for name, res in results.items():
            rows.append({"devices": num_devices, "policy": name,
                         "makespan_min": res.makespan_s / 60,
                         "lrtf_speedup": res.makespan_s / lrtf,
                         "mean_util": statistics.fmean(res.utilization),
                         "swap_GB": res.swap_bytes / 1e9,
                         "promotes": res.num_promotes})
    one = grid[0]
    report("scheduler_grid", rows,
           jobs=len(grid), shards=NUM_SHARDS, steps={"bs16": one.num_steps,
                                                      "bs8": grid[-1].num_steps},
           step_compute_s={"bs16": one.remaining_est_s(0) / one.num_steps,
                           "bs8": grid[-1].remaining_est_s(0) / grid[-1].num_steps},
           flop_per_s=FLOP_PER_S, pcie_bytes_per_s=PCIE_BYTES_PER_S,
           note="lrtf_speedup = policy makespan / sharded-lrtf makespan on the same devices; "
                "sharded-lrtf/no-reservation: lookahead only guesses (ablation)")


def _pipeline_row(jobs: int | str, mode: str, res: SimResult, base: SimResult,
                  **extra: int) -> dict:
    """One row of the pipelined-mode tables: ``res`` against ``base`` (no pipelining)."""
    row = {"jobs": jobs, "devices": 8, "mode": mode,
           "makespan_min": res.makespan_s / 60,
           "speedup": base.makespan_s / res.makespan_s,
           "host_GB": res.swap_bytes / 1e9,
           "host_ratio": res.swap_bytes / base.swap_bytes,
           "p2p_GB": res.p2p_bytes / 1e9,
           "pipelined_steps": res.num_pipelined_steps}
    return {**row, **extra, "mean_util": statistics.fmean(res.utilization)}


def part_pipeline() -> None:
    lrs = [1e-4, 3e-4, 6e-4, 1e-3, 3e-3, 6e-3]
    grid = [gpt2_job(f"bs{bs}-lr{lr:g}", bs, pipeline=True) for bs in (16, 8) for lr in lrs]
    runs: dict[str, tuple[bool, float | None]] = {
        "sharp (no pipelining)": (False, None),
        "pipelined, through host": (True, None),
        "pipelined, p2p 16 GB/s": (True, PCIE_BYTES_PER_S),
        "pipelined, p2p 150 GB/s": (True, NVLINK_BYTES_PER_S),
    }
    rows = []
    for jobs in (grid, grid[:4]):
        base = None
        for name, (pipelined, p2p) in runs.items():
            cost = CostModel(bandwidth_bytes_per_s=PCIE_BYTES_PER_S, p2p_bytes_per_s=p2p)
            policy = ShardedLRTF(8, pipeline=pipelined, host_bytes_per_s=PCIE_BYTES_PER_S,
                                 p2p_bytes_per_s=p2p)
            res = simulate(policy, jobs, cost)
            base = base or res
            rows.append(_pipeline_row(len(jobs), name, res, base))
    report("scheduler_pipeline", rows, shards=NUM_SHARDS,
           packs={n: list(c) for n, c in zip(("bs16", "bs8"), (grid[0].pipeline.packs,
                                                             grid[-1].pipeline.packs),
                                             strict=True)} if grid[0].pipeline else {},
           pcie_bytes_per_s=PCIE_BYTES_PER_S, device_bytes=DEVICE_BYTES,
           note="speedup and host_ratio against sharp (no pipelining) on the same jobs; "
                "host_GB = host<->device bytes (swap volume), p2p_GB = device<->device bytes")


def planned_job(spec: JobSpec, budget_bytes: int, max_devices: int = 8) -> JobSpec:
    """``spec`` (a :func:`gpt2_job` with its pipeline shape) packed by the planner for a budget.

    The shards' seconds and bytes of ``spec.pipeline`` become a ``JobPlan`` on one device of
    ``budget_bytes``, and its shape is the planner's (``pipeline_shape``: one-pack-per-device
    layouts and, for each device count too few for the fewest of them, the wrap-around layout
    planned for it). Per shard s of p parameters, in bytes: parameters 4p and Adam moments 8p
    (the shape's state of 12p); input the minibatch's boundary activation (shard 0: the token
    ids, int64) and output the next boundary (the last shard: none); forward peak parameters +
    input + output; backward peak parameters, gradients and Adam moments (16p, its
    just-in-time update) + input + output gradient, and on the last shard the logits of one
    microbatch (one sequence x vocabulary, fp32) instead. The LM head is the last shard's own,
    as the shard tasks count it (no tied-parameter traffic). As in the planner, the last shard
    has no forward task: its forward seconds join its backward.
    """
    from sweepmaster.runtime.planning.pipeline_plan import pipeline_shape
    from sweepmaster.runtime.planning.plans import JobPlan, ShardPlan

    hand = spec.pipeline
    assert hand is not None
    last = hand.num_shards - 1
    logits_bytes = SEQ * VOCAB * 4  # one microbatch of one sequence, fp32
    shards = []
    for s in range(hand.num_shards):
        param_bytes = hand.state_bytes[s] // 3  # fp32 parameters of 12 B of state each
        optimizer_bytes = hand.state_bytes[s] - param_bytes
        input_bytes = hand.input_bytes if s == 0 else hand.boundary_bytes[s - 1]
        output_bytes = hand.boundary_bytes[s]
        beside = logits_bytes if s == last else output_bytes  # logits / output gradient
        shards.append(ShardPlan(
            index=s, start=s, stop=s + 1, layer_names=(f"shard{s}",), microbatch_size=1,
            param_bytes=param_bytes, owned_param_bytes=param_bytes,
            optimizer_bytes=optimizer_bytes, num_owned_params=1, input_bytes=input_bytes,
            output_bytes=output_bytes, contribution_bytes=0,
            activation_bytes=logits_bytes if s == last else 0,
            forward_peak_bytes=0 if s == last else param_bytes + input_bytes + output_bytes,
            backward_peak_bytes=2 * param_bytes + optimizer_bytes + input_bytes + beside,
            forward_s=0.0 if s == last else hand.forward_s[s],
            backward_s=hand.backward_s[s] + (hand.forward_s[s] if s == last else 0.0)))
    step_bytes = sum(t.promote_bytes + t.demote_bytes for t in spec.step_tasks)
    plan = JobPlan(
        device="bench", budget_bytes=budget_bytes, batch_size=hand.num_microbatches,
        microbatch_size=1, plain_bytes=sum(s.backward_peak_bytes for s in shards), spill=True,
        shards=tuple(shards), prefetch=(False,) * len(spec.step_tasks),
        peak_bytes=max(s.backward_peak_bytes for s in shards),
        num_tasks_per_step=len(spec.step_tasks), swap_bytes_per_step=step_bytes,
        step_s=sum(t.est_seconds for t in spec.step_tasks), method="estimate", grad_clip=False)
    shape = pipeline_shape(plan, max_devices)
    return JobSpec(spec.job_id, spec.step_tasks, spec.num_steps, pipeline=shape)


def part_pipeline_wrap() -> None:
    """Part 5, wrap-around over a job's share: the grid on devices of ``SMALL_DEVICE_BYTES``."""
    lrs = [1e-4, 3e-4, 6e-4, 1e-3, 3e-3, 6e-3]
    grid = [planned_job(gpt2_job(f"bs{bs}-lr{lr:g}", bs, pipeline=True), int(SMALL_DEVICE_BYTES))
            for bs in (16, 8) for lr in lrs]
    no_wrap = [dataclasses.replace(job, pipeline=dataclasses.replace(job.pipeline, wrap=()))
               if job.pipeline else job for job in grid]
    runs: dict[str, tuple[bool, float | None, bool]] = {  # pipelined, p2p, wrap kept
        "sharp (no pipelining)": (False, None, True),
        "pipelined, wrap emptied, p2p 16 GB/s": (True, PCIE_BYTES_PER_S, False),
        "pipelined, through host": (True, None, True),
        "pipelined, p2p 16 GB/s": (True, PCIE_BYTES_PER_S, True),
    }
    scenarios = {"12 (grid)": slice(0, 12), "4 (bs16)": slice(0, 4), "4 (bs8)": slice(6, 10)}
    rows = []
    for scenario, picked in scenarios.items():
        base = None
        for name, (pipelined, p2p, wrap) in runs.items():
            cost = CostModel(bandwidth_bytes_per_s=PCIE_BYTES_PER_S, p2p_bytes_per_s=p2p)
            policy = ShardedLRTF(8, pipeline=pipelined, host_bytes_per_s=PCIE_BYTES_PER_S,
                                 p2p_bytes_per_s=p2p)
            res = simulate(policy, (grid if wrap else no_wrap)[picked], cost)
            base = base or res
            wrapped = sum(1 for steps in res.pipelined_steps.values() for d in steps
                          if len(d.cuts) - 1 > len(d.devices))
            rows.append(_pipeline_row(scenario, name, res, base, wrap_steps=wrapped))
    layouts = {}
    for name, job in (("bs16", grid[0]), ("bs8", grid[-1])):
        shape = job.pipeline
        assert shape is not None
        steps = {}
        shard_step_s = sum(t.est_seconds for t in job.step_tasks)
        links = {"host_bytes_per_s": PCIE_BYTES_PER_S, "p2p_bytes_per_s": PCIE_BYTES_PER_S}
        for devices in (2, 3, 4, 8):
            cuts = choose_packs(shape, devices, **links)  # the fastest that fits, ungated
            if cuts is None:
                continue
            pipelines = choose_packs(shape, devices, step_s=shard_step_s, **links) is not None
            taken = min(devices, len(cuts) - 1)
            step = pipeline_step(shape, cuts, num_devices=taken,
                                 host_bytes_per_s=PCIE_BYTES_PER_S,
                                 p2p_bytes_per_s=PCIE_BYTES_PER_S)
            free = pipeline_step(shape, cuts, num_devices=taken,
                                 p2p_bytes_per_s=PCIE_BYTES_PER_S)
            steps[devices] = {"cuts": list(cuts), "devices": taken, "pipelines": pipelines,
                              "step_s": step.seconds,
                              "step_s_free_host": free.seconds,
                              "host_GB": (step.host_to_device_bytes
                                          + step.device_to_host_bytes) / 1e9}
        layouts[name] = {"packs": [list(c) for c in shape.packs],
                         "wrap": [[d, list(c)] for d, c in shape.wrap],
                         "step_compute_s": sum(shape.forward_s) + sum(shape.backward_s),
                         "shard_step_s": shard_step_s,
                         "by_share": steps}
    report("scheduler_pipeline_wrap", rows, shards=NUM_SHARDS, device_bytes=SMALL_DEVICE_BYTES,
           pcie_bytes_per_s=PCIE_BYTES_PER_S, layouts=layouts,
           note="the part-5 jobs on 8 devices of device_bytes, packed by pipeline_shape; "
                "speedup and host_ratio against sharp (no pipelining) on the same jobs; "
                "'wrap emptied': each shape with wrap=() (no pipelining on fewer devices than "
                "its fewest packs); wrap_steps: pipelined steps with more packs than devices; "
                "layouts.by_share: the fastest layout that fits a share of that many devices "
                "(choose_packs without step_s), whether it beats shard_step_s (the step's "
                "tasks' estimated seconds; else the policy runs shard tasks), and "
                "pipeline_step's seconds and host bytes of a steady step (no load), "
                "step_s_free_host: its seconds with host copies free (the flow alone)")


def cycles_per_s(policy: Policy, num_cycles: int, with_lookahead: bool) -> float:
    devices = policy.num_devices
    running = [policy.next_task(d) for d in range(devices)]
    start = time.perf_counter()
    for i in range(num_cycles):
        device = i % devices
        task = running[device]
        if task is not None:
            if with_lookahead:
                policy.lookahead(device)
            policy.task_done(task, measured_s=task.est_seconds)
        running[device] = policy.next_task(device)
    return num_cycles / (time.perf_counter() - start)


def part_overhead(num_jobs: int = 1000, num_devices: int = 8, repeats: int = 5) -> None:
    rows = []
    for name, cls in policy_names().items():
        best: dict[bool, float] = {}
        for with_lookahead in (False, True):
            rates = []
            for rep in range(repeats):
                rng = random.Random(rep)
                policy = cls(num_devices)
                for j in range(num_jobs):
                    shards = rng.randint(1, 4)
                    policy.add_job(JobSpec.from_shards(
                        f"j{j}", 10**6, [rng.uniform(0.1, 1)] * shards,
                        [rng.uniform(0.1, 2)] * shards, [1] * shards, [3] * shards))
                rates.append(cycles_per_s(policy, 50_000, with_lookahead))
            best[with_lookahead] = max(rates)
        rows.append({"policy": name, "jobs": num_jobs, "devices": num_devices,
                     "decisions_per_s": best[False], "with_lookahead_per_s": best[True]})
    report("scheduler_overhead", rows, repeats=repeats,
           note="one decision = next_task + task_done (a full cycle); best of repeats; "
                "target >= 100,000/s for sharded-lrtf")


def part_real(num_jobs: int = 4, num_steps: int = 8, budget: str = "24MiB", width: int = 128,
              num_layers: int = 6, repeats: int = 3, calibration_steps: int = 1) -> None:
    """Part 4: the real executor on virtual devices, 2 devices vs 1, and the simulator's makespan.

    Each repeat: a calibration run (the same jobs, a first step to warm up, then
    ``calibration_steps`` steps) measures ``CostModel.speed`` (measured / estimated seconds of
    the tasks after the first step); then the timed run. Simulated, with the devices' measured
    copy bandwidth: from the plan's estimates alone, calibrated by that speed, and replayed with
    the timed run's own task seconds (the scheduling model alone).
    """
    import dataclasses
    import threading

    import torch
    from transformers import GPT2Config

    from sweepmaster.runtime import ShardExecutor, TaskRecord
    from sweepmaster.runtime.execution.policy_chain import shard_chain
    from sweepmaster.runtime.planning.timing import measure_copy_bandwidth
    from sweepmaster.runtime.scheduling.durations import recorded_durations
    from sweepmaster.workload import OptimizerSpec, TrainSpec

    vocab = 4096
    config = GPT2Config(n_layer=num_layers, n_embd=width, n_head=4, n_positions=64,
                        vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    blocks_NT = torch.randint(0, vocab, (256, 64), generator=torch.Generator().manual_seed(0))
    specs = [TrainSpec(model=config, train_data=blocks_NT, batch_size=8, max_steps=num_steps,
                       optimizer=OptimizerSpec(lr=1e-3 * (j + 1)), seed=j, name=f"job-{j}")
             for j in range(num_jobs)]

    def run(num_devices: int, jobs: list[TrainSpec], warmup_steps: int = 0) -> dict:
        # each worker gets what each of 2 devices gets (the executor splits the cores on 2)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
        records: list[TaskRecord] = []
        lock = threading.Lock()

        def keep(record: TaskRecord) -> None:
            with lock:
                records.append(record)

        with ShardExecutor(f"cpu:{num_devices}x{budget}", on_task=keep) as executor:
            plan = executor.plan(jobs[0])
            memory = executor.memory_plan(jobs[0])  # planned before the clock starts
            chains = [shard_chain(spec.name, plan, spec.total_steps, memory_plan=memory)
                      for spec in jobs]
            bandwidth = measure_copy_bandwidth(executor.devices[0])
            start, cpu = time.perf_counter(), time.process_time()
            results = [f.result() for f in [executor.submit(spec) for spec in jobs]]
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        busy: dict[str, float] = {}
        for r in records:
            busy[r.device] = busy.get(r.device, 0.0) + (r.end_s - r.start_s)
        durations = recorded_durations(records, chains)
        est = {(c.job_id, t.index): t.est_seconds for c in chains for t in c.tasks()}
        after = [k for k in est if k[1] >= (warmup_steps * plan.num_tasks_per_step)]
        return {"wall": wall, "chains": chains, "plan": plan, "bandwidth": bandwidth,
                "durations": durations, "cores": cpu / wall,
                "speed": sum(durations[k] for k in after) / sum(est[k] for k in after),
                "util": statistics.mean(busy.values()) / wall,
                "swap": sum(r.swap_bytes for r in results),
                "budget": executor.devices[0].budget_bytes}

    rows = []
    walls: dict[int, float] = {}
    load_before = os.getloadavg()[0]
    for num_devices in (1, 2):
        runs, sims = [], []
        for _ in range(repeats):
            calibration = run(num_devices, [
                dataclasses.replace(spec, max_steps=1 + calibration_steps, name=f"calibrate-{j}")
                for j, spec in enumerate(specs)], warmup_steps=1)
            real = run(num_devices, specs)
            durations = real["durations"]
            costs = {
                "estimated": CostModel(real["bandwidth"]),
                "calibrated": CostModel(real["bandwidth"], speed=calibration["speed"]),
                "replayed": CostModel(real["bandwidth"],
                                      compute_s=lambda t, d=durations: d[(t.job_id, t.index)]),
            }
            runs.append(real)
            sims.append({name: simulate(ShardedLRTF(num_devices), real["chains"], cost)
                         .makespan_s for name, cost in costs.items()}
                        | {"speed": calibration["speed"], "real_speed": real["speed"]})
        wall = statistics.median(r["wall"] for r in runs)
        walls[num_devices] = wall
        plan = runs[0]["plan"]

        def median(key: str, sims: list[dict] = sims) -> float:
            return statistics.median(s[key] for s in sims)

        def ratio(key: str, sims: list[dict] = sims, runs: list[dict] = runs) -> float:
            return statistics.median(s[key] / r["wall"] for s, r in zip(sims, runs, strict=True))

        def spread(key: str, sims: list[dict] = sims, runs: list[dict] = runs) -> str:
            ratios = [s[key] / r["wall"] for s, r in zip(sims, runs, strict=True)]
            return f"{min(ratios):.2f}-{max(ratios):.2f}"

        rows.append({
            "devices": num_devices, "jobs": num_jobs, "shards": len(plan.shards),
            "footprint/budget": plan.plain_bytes / runs[0]["budget"],
            "wall_s": wall, "walls_s": " / ".join(f"{r['wall']:.1f}" for r in runs),
            "speedup": walls[1] / wall,
            "mean_util": statistics.median(r["util"] for r in runs),
            "cores_used": statistics.median(r["cores"] for r in runs),
            "swap_GB": statistics.median(r["swap"] for r in runs) / 1e9,
            "speed": median("speed"), "real_speed": median("real_speed"),
            "sim_estimated_s": median("estimated"), "sim_calibrated_s": median("calibrated"),
            "calibrated/real": ratio("calibrated"), "range": spread("calibrated"),
            "sim_replayed_s": median("replayed"), "replayed/real": ratio("replayed"),
            "replayed range": spread("replayed"),
        })
    report("scheduler_real_cpu", rows, steps=num_steps, budget=budget, width=width,
           layers=num_layers, repeats=repeats, calibration_steps=calibration_steps,
           copy_bytes_per_s=runs[0]["bandwidth"],
           load_average=[load_before, os.getloadavg()[0]],
           note="medians of repeats; speedup = median wall on 1 device / here, same 4 jobs, "
                "target >= 1.7x on 2; speed = measured / estimated task seconds of the "
                "calibration run (real_speed: of the timed run); cores_used = process CPU "
                "seconds / wall; sim_*: simulated makespan from "
                "the plan's estimates, calibrated by speed, replayed with the run's task "
                "seconds; target calibrated/real within 0.9-1.1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--instances", type=int, default=60)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-width", type=int, default=128, help="part 4: GPT-2 n_embd")
    parser.add_argument("--real-layers", type=int, default=6, help="part 4: GPT-2 n_layer")
    parser.add_argument("--real-budget", default="24MiB", help="part 4: each device's budget")
    parser.add_argument("--real-steps", type=int, default=8, help="part 4: steps per job")
    parser.add_argument("--real-repeats", type=int, default=3, help="part 4: repeats (median)")
    args = parser.parse_args()
    if 1 in args.parts:
        part_optimal(args.instances, args.time_limit, args.seed)
    if 2 in args.parts:
        part_grid()
    if 3 in args.parts:
        part_overhead()
    if 4 in args.parts:
        part_real(num_steps=args.real_steps, budget=args.real_budget, width=args.real_width,
                  num_layers=args.real_layers, repeats=args.real_repeats)
    if 5 in args.parts:
        part_pipeline()
        part_pipeline_wrap()


if __name__ == "__main__":
    main()
