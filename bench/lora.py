"""Trials per second and peak memory of K LoRA trials fused over one base vs a peft loop.

    python bench/lora.py [--part speed|spill|all] [--ks 1,4,8] [--steps 10] [--repeats 3]
                         [--threads 1] [--n-layer 4] [--n-embd 256] [--vocab 2000]
                         [--block-size 32] [--batch 4] [--spill-steps 3]
                         [--spill-n-embd 1024] [--spill-budget-mib 120] [--spill-rank 8]
                         [--device cpu]

K LoRA trials over one small GPT-2 base (same seed, so one base; ranks 4, 8, 16, 8, ...,
alpha 16, adapter dropout 0.05 or 0, learning rates 1e-3 * (1 + i), AdamW with weight decay
0.01, adapters on ``c_attn`` and ``c_proj``) are trained ``--steps`` steps in the same process
run two ways: one after another with a plain transformers + peft loop (``get_peft_model``,
``torch.optim.AdamW``, ``model(input_ids, labels=input_ids).loss``; the baseline), and together
as one fused array (``train_fused_spilled`` on one stacked shard holding the whole array, as
the executor trains an array that fits: the base held once, adapters stacked and padded to the
largest rank). Each wall time includes building the models, as a sweep pays it; the best of
``--repeats`` alternating runs is kept. ``speedup`` is fused trials/s over sequential trials/s.
The steady state is apart: ``*_ms_per_member_step`` are the training loops' seconds alone
(the peft loops' summed; the array's from its first step to its end, its members'
``train_seconds``) over K x ``--steps``, best of the same runs, and ``step_speedup`` their
ratio: what fusion does per step once the models are built.
Both ways train on ``--device`` (``cpu``, or ``cuda:0``: then the peak is CUDA's allocated peak
over the run instead of the meter's).

Peak memory is metered, not sampled from the process: each way runs once more under
sweepmaster's ``VirtualMeter`` (a ``TorchDispatchMode`` counting the live tensor storage bytes
that operations create: weights, adapters, optimizer state, activations, gradients; not the
Python heap or the allocator's slack). ``sequential_peak_MiB`` is the peak of the loop (one
trial alive at a time), ``fused_peak_MiB`` the peak of the whole array, and
``fused_MiB_per_member`` that over K. The machine is shared: the load average before and after is
recorded with the numbers.

The ``spill`` part trains K trials over a base of width ``--spill-n-embd`` as one spilled fused
array (a ``SpilledFusedJob`` planned by ``plan_stacked`` for K members on a virtual device of
``--spill-budget-mib``, small enough that the base spills even at K = 1; double-buffered) for
``--spill-steps`` steps and counts every host <-> device byte it moves (shard promotes and
demotes, boundary activations and gradients, dropout masks, optimizer state):
``MiB_per_member_step`` is that over K x steps, and ``vs_k1`` its ratio to K = 1 in the same run
(each base shard is promoted once per shard task for all K members). Its members all have rank
``--spill-rank`` and adapter dropout 0.05, so K = 1 and K = 8 move adapters of one size
(``--spill-rank 0``: the ranks and dropouts above, padded to the largest).
"""

from __future__ import annotations

import argparse
import copy
import os
import time
import warnings
from collections.abc import Callable

import torch
from harness import report, timed
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config

from sweepmaster.runtime.devices.device import Device, VirtualDevice
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob, train_fused_spilled
from sweepmaster.runtime.training.plain import minibatch_indices
from sweepmaster.workload import LoraSpec, OptimizerSpec, TrainSpec

RANKS = (4, 8, 16, 8)
TARGETS = ("c_attn", "c_proj")


def make_specs(args: argparse.Namespace, k: int, rank: int = 0) -> list[TrainSpec]:
    """K trials over one base (module doc); ``rank`` > 0: all that rank, adapter dropout 0.05."""
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4,
                        vocab_size=args.vocab, n_positions=args.block_size, bos_token_id=0,
                        eos_token_id=0)
    generator = torch.Generator().manual_seed(0)
    blocks_NT = torch.randint(0, args.vocab, (args.batch * args.steps, args.block_size),
                              generator=generator)
    return [
        TrainSpec(
            model=config, train_data=blocks_NT, batch_size=args.batch, max_steps=args.steps,
            seed=0, name=f"trial-{i}",
            optimizer=OptimizerSpec(lr=1e-3 * (1 + i), weight_decay=0.01),
            peft=LoraSpec(r=rank or RANKS[i % len(RANKS)], alpha=16.0,
                          dropout=0.05 if rank else 0.05 * (i % 2), target_modules=TARGETS),
        )
        for i in range(k)
    ]


def peft_loop(spec: TrainSpec, torch_device: torch.device) -> float:
    """One trial with transformers + peft by hand on ``torch_device``: the baseline.

    Returns:
        Seconds of its training loop (building excluded).
    """
    assert spec.peft is not None
    torch.manual_seed(spec.seed)
    base = AutoModelForCausalLM.from_config(copy.deepcopy(spec.model)).to(torch_device)
    model = get_peft_model(base, LoraConfig(
        r=spec.peft.r, lora_alpha=int(spec.peft.alpha), lora_dropout=spec.peft.dropout,
        target_modules=list(TARGETS)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.optimizer.lr,
                                  weight_decay=spec.optimizer.weight_decay)
    batches = minibatch_indices(int(spec.train_data.shape[0]), spec.batch_size, spec.seed)
    start = time.perf_counter()
    for _ in range(spec.total_steps):
        _, index_B = next(batches)
        input_ids_BT = spec.train_data[index_B].to(torch_device)
        model(input_ids=input_ids_BT, labels=input_ids_BT).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _synchronize(torch_device)
    return time.perf_counter() - start


def sequential(specs: list[TrainSpec], device: Device) -> float:
    """The K trials one after another with the peft loop; their training loops' seconds."""
    return sum(peft_loop(spec, device.torch_device) for spec in specs)


#: One stacked shard holding each array whole, per (K, device): planned once, off the clock.
_PLANS: dict[tuple[int, str], JobPlan] = {}


def whole_plan(specs: list[TrainSpec], device: Device) -> JobPlan:
    """The plan of an array that fits ``device``, as an executor plans (and caches) it."""
    key = (len(specs), device.name)
    if key not in _PLANS:
        _PLANS[key] = plan_stacked(stacked_spec(specs), len(specs), device, whole=True)
    return _PLANS[key]


def fused(specs: list[TrainSpec], device: Device) -> float:
    """The K trials as one fused array on ``device``; its training seconds (after building).

    As the executor trains an array that fits its device: one stacked shard holding it whole
    (:func:`whole_plan`).
    """
    results = train_fused_spilled(specs, device, whole_plan(specs, device))
    _synchronize(device.torch_device)
    assert all(result is not None for result in results)
    return max(result.train_seconds for result in results if result is not None)


def _synchronize(torch_device: torch.device) -> None:
    if torch_device.type == "cuda":
        torch.cuda.synchronize(torch_device)


def peak_bytes(run: Callable[[list[TrainSpec], Device], float], specs: list[TrainSpec],
               on: Device) -> int:
    """Peak tensor bytes of ``run``: a virtual device's meter, or CUDA's allocated peak."""
    if on.torch_device.type == "cuda":
        torch.cuda.empty_cache()
        start = torch.cuda.memory_allocated(on.torch_device)
        torch.cuda.reset_peak_memory_stats(on.torch_device)
        run(specs, on)
        return torch.cuda.max_memory_allocated(on.torch_device) - start
    device = VirtualDevice("cpu:meter", budget_bytes=1 << 40)
    assert device.meter is not None
    with device.meter.metering():
        run(specs, device)
    return device.meter.peak_bytes


def spilled_bytes(specs: list[TrainSpec], budget_bytes: int) -> dict[str, float | int | str]:
    """Host <-> device bytes of the K trials as one spilled fused array (one row)."""
    device = VirtualDevice("cpu:spill", budget_bytes=budget_bytes)
    plan = plan_stacked(stacked_spec(specs), len(specs), device)
    job = SpilledFusedJob(specs, plan)
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)
        job.run(task, device)
    job.settle(device)
    base_bytes = sum(t.nbytes for t in job.members.frozen.values())
    member_steps = len(specs) * specs[0].total_steps
    return {
        "k": len(specs),
        "ranks": "/".join(str(s.peft.r) for s in specs if s.peft is not None),
        "budget_MiB": budget_bytes / 2**20,
        "stacked_shards": len(plan.shards),
        "base_MiB": base_bytes / 2**20,
        "promotes_per_step": job.store.num_promotes / specs[0].total_steps,
        "swap_MiB": job.boundaries.swap_bytes / 2**20,
        "MiB_per_member_step": job.boundaries.swap_bytes / member_steps / 2**20,
        "peak_MiB": job.bookkeeping.peak_device_bytes / 2**20,
    }


def spill_part(args: argparse.Namespace) -> None:
    """Host <-> device bytes per member-step of spilled LoRA arrays for each K (module doc)."""
    load_before = os.getloadavg()
    budget_bytes = int(args.spill_budget_mib * 2**20)
    rows = []
    shape = argparse.Namespace(**{**vars(args), "steps": args.spill_steps,
                                  "n_embd": args.spill_n_embd})
    for k in [int(k) for k in args.ks.split(",") if k]:
        specs = make_specs(shape, k, args.spill_rank)
        rows.append(spilled_bytes(specs, budget_bytes))
    for row in rows:
        row["vs_k1"] = float(row["MiB_per_member_step"]) / float(rows[0]["MiB_per_member_step"])
    report("lora_spill", rows, threads=args.threads, steps=args.spill_steps,
           model={"n_layer": args.n_layer, "n_embd": args.spill_n_embd, "vocab": args.vocab,
                  "block_size": args.block_size, "batch": args.batch},
           rank=args.spill_rank or "mixed",
           bytes="counted by the array: every host <-> device copy (swap_bytes)",
           load_average_before=load_before, load_average_after=os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="1,4,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--part", choices=("speed", "spill", "all"), default="all")
    parser.add_argument("--spill-steps", type=int, default=3)
    parser.add_argument("--spill-n-embd", type=int, default=1024)
    parser.add_argument("--spill-budget-mib", type=float, default=120.0)
    parser.add_argument("--spill-rank", type=int, default=8)
    parser.add_argument("--device", default="cpu",
                        help="speed part: where both ways train (cpu, cuda:0); the spill part "
                             "always uses a virtual device")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(args.threads)
    if args.part in ("spill", "all"):
        spill_part(args)
    if args.part == "spill":
        return
    on = Device(args.device)
    warmup = make_specs(args, 2)  # first-call costs (imports, vmap setup) off the clock
    fused(warmup, on)
    sequential(warmup[:1], on)
    load_before = os.getloadavg()
    rows = []
    for k in [int(k) for k in args.ks.split(",") if k]:
        specs = make_specs(args, k)
        whole_plan(specs, on)
        seq_s, fused_s, seq_train_s, fused_train_s = [], [], [], []
        for _ in range(args.repeats):  # alternate, so load drifts hit both alike
            wall_s, train_s = timed(lambda: sequential(specs, on))  # noqa: B023
            seq_s.append(wall_s)
            seq_train_s.append(train_s)
            wall_s, train_s = timed(lambda: fused(specs, on))  # noqa: B023
            fused_s.append(wall_s)
            fused_train_s.append(train_s)
        seq_peak, fused_peak = peak_bytes(sequential, specs, on), peak_bytes(fused, specs, on)
        seq_tps, fused_tps = k / min(seq_s), k / min(fused_s)
        rows.append({
            "k": k,
            "ranks": "/".join(str(s.peft.r) for s in specs if s.peft is not None),
            "sequential_s": min(seq_s),
            "fused_s": min(fused_s),
            "sequential_trials_per_s": seq_tps,
            "fused_trials_per_s": fused_tps,
            "speedup": fused_tps / seq_tps,
            "sequential_ms_per_member_step": min(seq_train_s) / (k * args.steps) * 1e3,
            "fused_ms_per_member_step": min(fused_train_s) / (k * args.steps) * 1e3,
            "step_speedup": min(seq_train_s) / min(fused_train_s),
            "sequential_peak_MiB": seq_peak / 2**20,
            "fused_peak_MiB": fused_peak / 2**20,
            "fused_MiB_per_member": fused_peak / k / 2**20,
        })
    report("lora", rows, device=args.device, threads=args.threads, steps=args.steps,
           repeats=args.repeats,
           model={"n_layer": args.n_layer, "n_embd": args.n_embd, "vocab": args.vocab,
                  "block_size": args.block_size, "batch": args.batch},
           memory=("CUDA allocated peak over the run" if on.torch_device.type == "cuda" else
                   "metered: live tensor storage bytes (sweepmaster VirtualMeter)"),
           load_average_before=load_before, load_average_after=os.getloadavg())


if __name__ == "__main__":
    main()
