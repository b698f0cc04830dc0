"""Host syncs per training step: the calls that would make the host wait for a GPU.

    python bench/host_syncs.py [--steps 2]

Counts, with :class:`~sweepmaster.runtime.devices.host_syncs.HostSyncCounter` on a CPU
virtual device, what each training step of a job does that forces a device -> host sync on
CUDA (``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``, blocking demotes), after a
warm-up step, for: a resident job (K = 1, S = 1), a spilled job (K = 1, S = 4, two
microbatches, without and with ``grad_clip``), a resident fused array (K = 2, S = 1) and a
spilled fused array (K = 2, two microbatches); GPT-2 3 layers, width 32, dropout 0.1
everywhere, AdamW. Plain training reads its loss once a step (``loss.item()``). Reads of
``torch.optim``'s host step counters are no sync and are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from harness import report
from transformers import GPT2Config

from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.devices.host_syncs import HostSyncCounter
from sweepmaster.runtime.planning.packing import make_plan
from sweepmaster.runtime.planning.profile import profile_model
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.shard_trainer import ShardTrainer
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.workload import OptimizerSpec, TrainSpec

MiB = 2**20
VOCAB = 101


def spec(seed: int, clip: float | None = None) -> TrainSpec:
    """A tiny GPT-2 with dropout everywhere, AdamW, batch 4 of 16 tokens."""
    generator = torch.Generator().manual_seed(123)
    config = GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, attn_pdrop=0.1,
                        embd_pdrop=0.1)
    return TrainSpec(
        model=config, train_data=torch.randint(0, VOCAB, (12, 16), generator=generator),
        optimizer=OptimizerSpec(name="adamw", lr=1e-3 * seed, weight_decay=0.01, grad_clip=clip),
        batch_size=4, max_steps=4, seed=seed, name=f"trial-{seed}")


def syncs_per_step(job: ShardTrainer, device: VirtualDevice, steps: int) -> list[dict[str, int]]:
    """Each training step's host syncs after the first (a warm-up step), by call."""
    counted: list[dict[str, int]] = []
    while (task := job.next_task()) is not None:
        if task.step == 0 or task.step > steps or task.phase != "train":
            job.run(task, device, keep=True)
            continue
        while len(counted) <= task.step - 1:
            counted.append({})
        with HostSyncCounter() as counter:
            job.run(task, device, keep=True)
        for name, num in counter.counts.items():
            counted[task.step - 1][name] = counted[task.step - 1].get(name, 0) + num
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="counted steps after the warm-up")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    device = VirtualDevice("cpu:0", budget_bytes=64 * MiB)
    one = spec(1, clip=0.5)
    profile = profile_model(one, 2)
    cases: list[tuple[str, ShardTrainer]] = [
        ("K=1 S=1 (resident)", SpilledJob(dataclasses.replace(one, optimizer=dataclasses.replace(
            one.optimizer, grad_clip=None)), make_plan(profile, one.optimizer, [0, 5], device))),
        ("K=1 S=4 (spilled, b=2)",
         SpilledJob(dataclasses.replace(one, optimizer=dataclasses.replace(
             one.optimizer, grad_clip=None)),
             make_plan(profile, one.optimizer, [0, 1, 2, 4, 5], device))),
        ("K=1 S=4 (spilled, b=2, grad_clip)",
         SpilledJob(one, make_plan(profile, one.optimizer, [0, 1, 2, 4, 5], device))),
    ]
    members = [spec(1), spec(2)]
    cases.append(("K=2 S=1 (fused, resident)",
                  SpilledFusedJob(members, plan_stacked(members[0], 2, device, whole=True))))
    spilled = plan_stacked(members[0], 2, VirtualDevice("cpu:1", budget_bytes=MiB // 2),
                           microbatch_size=2)
    cases.append((f"K=2 S={len(spilled.shards)} (fused, spilled, b=2)",
                  SpilledFusedJob(members, spilled)))
    for name, job in cases:
        run_device = device if len(job.plan.shards) == 1 or name.startswith("K=1") else \
            VirtualDevice("cpu:1", budget_bytes=MiB // 2)
        counted = syncs_per_step(job, run_device, args.steps + 1)
        per_step = [sum(step.values()) for step in counted[1:]]
        calls: dict[str, int] = {}
        for step in counted[1:]:
            for call, num in step.items():
                calls[call] = calls.get(call, 0) + num
        rows.append({"job": name, "syncs_per_step": max(per_step),
                     "calls": ", ".join(f"{c} x{n // len(per_step)}"
                                        for c, n in sorted(calls.items()))})
    report("host_syncs", rows, steps=args.steps)



if __name__ == "__main__":
    main()
