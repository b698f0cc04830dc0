from __future__ import annotations

import gc
import itertools
import random

import pytest
import torch

from sweepmaster.runtime import (
    Device,
    SpilledJob,
    VirtualDevice,
    make_plan,
    plan_job,
    train_plain,
    train_spilled,
)
from sweepmaster.runtime.execution.jobs import SpilledRun
from sweepmaster.runtime.planning.memgreedy import MemoryPlanError, greedy_shard_decisions
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory, plan_shard
from sweepmaster.runtime.planning.memplan_milp import optimal_shard_decisions, random_shard_profile
from sweepmaster.runtime.planning.memprofile import (
    profile_shards,
)
from sweepmaster.runtime.planning.memsim import LayerDecision, simulate_shard
from tests.kit.spill import (
    MiB,
    assert_weights,
    forced_plan,
    plain_result,
    tiny_config,
    tiny_profile,
    tiny_spec,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CUTS = [0, 1, 2, 4, 5]  # embed | block.0 | block.1 block.2 | head
FAST, SLOW = 1e13, 1e5  # bytes/s: swaps cost nothing / swaps cost more than any recompute


def job_plan(spec, budget=4 * MiB, cuts=CUTS, microbatch_size=None, rows=None, n_layer=3):
    device = VirtualDevice("cpu:plan", budget_bytes=budget)
    return make_plan(
        tiny_profile(microbatch_size, n_layer), spec.optimizer, cuts, device, microbatch_sizes=rows
    )


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    ("opt_name", "codes"),
    [
        ("adamw-clip", ["S", "S", "RS", "M"]),
        ("sgd", ["R", "S", "SR", "R"]),
        ("adamw", ["S", "R", "SS", "S"]),
    ],
)

def test_planned_training_equals_plain_training(opt_name: str, codes: list[str]) -> None:
    spec = tiny_spec(opt_name)
    plan = job_plan(spec)
    memory = forced_plan(spec, plan, codes)
    assert [s.codes for s in memory.shards][:3] == codes[:3]
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    result = train_spilled(spec, device, plan, memory_plan=memory)
    expected = plain_result(opt_name)
    assert_weights(result.state_dict, expected.state_dict)  # dropout on, tied wte, 4 shards
    for name in ("train_loss", "eval_loss"):
        assert result.history(name) == expected.history(name), name
    assert device.meter.live_bytes == 0


def test_one_shard_keeps_swaps_and_recomputes_exactly() -> None:
    spec = tiny_spec("adamw-clip", eval_data=None, max_steps=3)
    plan = job_plan(spec, cuts=[0, 5])
    memory = forced_plan(spec, plan, ["RMKSR"])
    result = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), plan,
                           memory_plan=memory)
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict)


@pytest.mark.parametrize(("opt_name", "microbatch_size"), [("adamw-clip", 2), ("sgd", 3)])
def test_planned_microbatches_equal_plain_training(opt_name: str, microbatch_size: int) -> None:
    spec = tiny_spec(opt_name)
    plan = job_plan(spec, microbatch_size=microbatch_size)
    memory = forced_plan(spec, plan, ["S", "R", "SR", "M"])
    result = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), plan,
                           memory_plan=memory)
    # dropout masks are the full batch's: only the order of float sums differs
    assert_weights(result.state_dict, plain_result(opt_name).state_dict, exact=False)


def test_planned_tasks_move_between_devices() -> None:
    devices = [VirtualDevice(f"cpu:{i}", budget_bytes=4 * MiB) for i in range(2)]
    spec = tiny_spec("sgd")
    plan = job_plan(spec)
    job = SpilledJob(spec, plan, memory_plan=forced_plan(spec, plan, ["S", "S", "RS", "K"]))
    turn = 0
    while (task := job.next_task()) is not None:  # forward on one device, backward on the other
        job.prefetch(job.peek_task(), devices[turn % 2])
        job.run(task, devices[turn % 2])
        turn += 1
    assert_weights(job.result().state_dict, plain_result("sgd").state_dict)
    assert all(d.meter.live_bytes == 0 for d in devices)
    assert job.passes.num_recompute_fallbacks == 0 and job.passes.plan_mismatches == 0


# ---------------------------------------------------------------- memory


def test_plan_keeps_the_metered_peak_within_the_budget() -> None:
    spec = tiny_spec("adamw", model=tiny_config(n_layer=4))
    budget = 540_000
    plan = job_plan(spec, budget=budget, cuts=[0, 3, 6], microbatch_size=2, rows=[2, 2],
                    n_layer=4)
    assert plan.peak_bytes > budget  # Hydra's full recompute does not fit
    memory = plan_memory(spec, plan, profile=tiny_profile(2, 4), bandwidth=FAST)
    codes = [s.codes for s in memory.shards]
    assert "R" in codes[0] and "S" in codes[0] and "R" in codes[1]  # the budget binds
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    result = train_spilled(spec, device, plan, memory_plan=memory)  # the meter raises past it
    metered = result.peak_device_bytes
    assert metered is not None and metered <= budget
    assert abs(memory.peak_bytes - metered) <= 0.10 * metered
    with pytest.raises(torch.OutOfMemoryError):  # Hydra's plan really needs more
        train_spilled(spec, VirtualDevice("cpu:1", budget_bytes=budget), plan)


@pytest.mark.parametrize("microbatch_size", [None, 2, 3])
def test_simulator_predicts_the_metered_peak(microbatch_size) -> None:
    spec = tiny_spec("sgd", eval_data=None, max_steps=2)
    plan = job_plan(spec, microbatch_size=microbatch_size)
    memory = forced_plan(spec, plan, ["S", "R", "SR", "M"])
    result = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), plan,
                           memory_plan=memory)
    metered = result.peak_device_bytes
    assert metered is not None
    assert abs(memory.peak_bytes - metered) <= 0.10 * metered


def early_fetch_job(spec):
    """A plan of ``spec`` in 3 shards on a roomy device, and a memory plan swapping every
    activation of the first two shards: each of their backward tasks' first fetch runs early,
    during the backward task of the shard after it."""
    device = VirtualDevice("cpu:plan", budget_bytes=1_000_000)
    plan = plan_job(spec, device)
    last = len(plan.shards) - 1
    greedy = plan_memory(spec, plan, device=device, bandwidth=1e9)
    decisions = [[LayerDecision(False, (shard.index != last,) * len(d.swap))
                  for d in shard.decisions] for shard in greedy.shards]
    memory = plan_memory(spec, plan, device=device, bandwidth=1e9, decisions=decisions)
    assert last == 2 and all(s.early_fetch_bytes > 0 for s in memory.shards[:last])
    return plan, memory


def test_a_backward_task_that_fetches_early_is_planned_with_the_early_fetch() -> None:
    # During the backward task of shard i > 0 the job fetches the first activations of shard
    # i - 1's backward where its memory plan says so: that task's planned peak holds them, as
    # the job's prefetch decisions, the chain the executor lists and the memory plan's own
    # peak all read it, and the metered task peaks at exactly that plus the shard prefetched
    # beside it.
    spec = tiny_spec("adamw", eval_data=None, max_steps=2)
    plan, memory = early_fetch_job(spec)
    order = plan.task_order()
    expected = [
        memory.shards[i].forward_peak_bytes if kind == "forward"
        else memory.shards[i].backward_peak_bytes
        + (memory.shards[i - 1].early_fetch_bytes if i > 0 else 0)
        for kind, i in order
    ]
    assert [plan.task_peak_bytes(kind, i, memory.shards) for kind, i in order] == expected
    nexts = [plan.shards[i].param_bytes for _, i in order[1:]] + [0]
    assert memory.peak_bytes == max(
        peak + (following if fetched else 0)
        for peak, following, fetched in zip(expected, nexts, memory.prefetch, strict=True))
    run = SpilledRun("job", spec, plan, None, None, memory_plan=memory)
    listed = run.chain()
    assert [task.peak_bytes for task in listed.head_tasks] == expected * spec.max_steps
    job = run.job
    device = VirtualDevice("cpu:0", budget_bytes=plan.budget_bytes)
    position = 0
    while (task := job.next_task()) is not None:
        assert job.planned_peak_bytes(task) == expected[position]
        prefetches = job.store.num_prefetches
        device.meter.reset_peak()
        job.prefetch(job.peek_task(), device)  # the early fetch and the next shard, as planned
        job.run(task, device)
        assert job.store.num_prefetches - prefetches == int(memory.prefetch[position])
        metered = device.meter.peak_bytes - (nexts[position] if memory.prefetch[position] else 0)
        assert metered == expected[position]
        if task.kind == "backward" and task.shard > 0:  # the early fetch's bytes held too
            assert metered > memory.shards[task.shard].backward_peak_bytes
        position = (position + 1) % len(order)
    assert job.store.num_prefetch_refusals == 0 and job.passes.plan_mismatches == 0


def test_swap_volume_per_step_matches_the_memory_plan() -> None:
    spec = tiny_spec("adamw", eval_data=None, max_steps=3)
    for microbatch_size in (None, 2):
        plan = job_plan(spec, microbatch_size=microbatch_size)
        memory = forced_plan(spec, plan, ["S", "R", "SR", "M"])
        job = SpilledJob(spec, plan, memory_plan=memory)
        device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
        while (task := job.next_task()) is not None:
            job.run(task, device)
        assert job.bookkeeping.step_swap_bytes[1:] == [memory.swap_bytes_per_step] * 2
        assert memory.swap_bytes_per_step > plan.swap_bytes_per_step  # activations moved


def test_failed_planned_task_leaves_the_device_empty() -> None:
    spec = tiny_spec("sgd")
    plan = job_plan(spec)
    memory = forced_plan(spec, plan, ["S", "S", "SS", "K"])
    small = VirtualDevice("cpu:0", budget_bytes=300_000)
    with pytest.raises(torch.OutOfMemoryError):
        train_spilled(spec, small, plan, memory_plan=memory)
    gc.collect()  # the traceback's frames hold the failed task's tensors
    assert small.meter.live_bytes == 0


def test_infeasible_budget_raises() -> None:
    spec = tiny_spec("sgd")
    plan = job_plan(spec)
    with pytest.raises(MemoryPlanError, match="shard 2: no keep/swap/recompute plan"):
        plan_memory(spec, plan, profile=tiny_profile(None), bandwidth=FAST,
                    budget_bytes=300_000)


# ---------------------------------------------------------------- decisions


def test_decisions_follow_the_bandwidth() -> None:
    spec = tiny_spec("adamw")
    plan = job_plan(spec)
    swapped = []
    for bandwidth in (SLOW, 1e9, 1e10, 1e11, FAST):
        memory = plan_memory(spec, plan, profile=tiny_profile(None), bandwidth=bandwidth)
        swapped.append(sum(s.swapped_bytes for s in memory.shards))
        if bandwidth == SLOW:
            assert [s.codes for s in memory.shards] == ["R", "R", "RR", "K"]
        if bandwidth == FAST:
            assert [s.codes for s in memory.shards][1:] == ["S", "SS", "K"]
            assert memory.step_s < plan.step_s  # no recompute left
    assert swapped == sorted(swapped) and swapped[0] == 0 < swapped[-1]


def test_last_shard_keeps_what_fits_and_evicts_the_rest() -> None:
    spec = tiny_spec("adamw", model=tiny_config(n_layer=4))
    plan = job_plan(spec, budget=540_000, cuts=[0, 3, 6], rows=[2, 2], microbatch_size=2,
                    n_layer=4)
    roomy = plan_memory(spec, plan, profile=tiny_profile(2, 4), bandwidth=FAST,
                        budget_bytes=4 * MiB)
    assert roomy.shards[-1].codes == "KKK" and roomy.shards[-1].swapped_bytes == 0
    tight = plan_memory(spec, plan, profile=tiny_profile(2, 4), bandwidth=FAST)
    assert tight.shards[-1].codes != "KKK"
    assert tight.shards[-1].peak_bytes <= tight.limit_bytes < roomy.shards[-1].peak_bytes


def test_summary_and_json_round_trip() -> None:
    spec = tiny_spec("adamw")
    plan = job_plan(spec)
    memory = plan_memory(spec, plan, profile=tiny_profile(None), bandwidth=1e11, overlap_s=1e-4)
    rows = memory.summary()
    assert [r.shard for r in rows] == [0, 1, 2, 3]
    assert rows[2].layers == "block.1-block.2" and rows[3].decisions == "K"
    assert all(r.peak_bytes <= memory.limit_bytes for r in rows)
    assert MemoryPlan.from_json(memory.to_json()) == memory
    with pytest.raises(ValueError, match="memory plan is for shards"):
        SpilledJob(spec, job_plan(spec, cuts=[0, 5]), memory_plan=memory)


def test_auto_memory_plan_trains_exactly() -> None:
    spec = tiny_spec("adamw")
    result = train_spilled(spec, VirtualDevice("cpu:0", budget_bytes=4 * MiB), job_plan(spec),
                           memory_plan="auto")
    assert_weights(result.state_dict, plain_result("adamw").state_dict)


# ---------------------------------------------------------------- greedy vs optimum


def brute_force(shard, budget, bandwidth, overlap_s):
    best = None
    for combo in itertools.product([False, True], repeat=len(shard.layers)):
        if any(c and not layer.swappable for c, layer in zip(combo, shard.layers, strict=True)):
            continue
        decisions = [
            LayerDecision.swap_all(len(layer.activations)) if c
            else LayerDecision.recomputed(len(layer.activations))
            for layer, c in zip(shard.layers, combo, strict=True)
        ]
        sim = simulate_shard(shard, decisions, bandwidth, overlap_s)
        if sim.peak_bytes <= budget and (best is None or sim.overhead_s < best):
            best = sim.overhead_s
    return best


def test_greedy_against_the_milp_optimum_on_small_shards() -> None:
    rng = random.Random(0)
    ratios = []
    for _ in range(60):
        shard = random_shard_profile(rng, rng.randint(3, 7), rng.randint(1, 2))
        bandwidth = rng.choice([5e6, 1e7, 2e7, 5e7])
        overlap_s = rng.choice([0.0, 2e-3])
        hydra = [LayerDecision.recomputed(len(layer.activations)) for layer in shard.layers]
        budget = int(simulate_shard(shard, hydra, bandwidth).peak_bytes * rng.uniform(0.8, 1.2))
        best = brute_force(shard, budget, bandwidth, overlap_s)
        if best is None:
            with pytest.raises(ValueError):
                optimal_shard_decisions(shard, budget, bandwidth, overlap_s)
            continue
        optimal = simulate_shard(
            shard, optimal_shard_decisions(shard, budget, bandwidth, overlap_s), bandwidth,
            overlap_s,
        )
        assert optimal.peak_bytes <= budget
        assert optimal.overhead_s == pytest.approx(best, rel=1e-9)  # the MILP is exact
        greedy = simulate_shard(
            shard, greedy_shard_decisions(shard, budget, bandwidth, overlap_s), bandwidth,
            overlap_s,
        )
        assert greedy.peak_bytes <= budget
        assert optimal.overhead_s <= greedy.overhead_s * (1 + 1e-9)
        ratios.append(greedy.overhead_s / optimal.overhead_s)
    assert len(ratios) >= 20
    # single moves miss some exchanges (one layer swapped instead of another): bounded
    assert max(ratios) <= 1.5 and sum(ratios) / len(ratios) <= 1.05


def test_optimal_method_plans_gpt2_shards() -> None:
    spec = tiny_spec("adamw")
    plan = job_plan(spec)
    greedy = plan_memory(spec, plan, profile=tiny_profile(None), bandwidth=3e10)
    optimal = plan_memory(spec, plan, profile=tiny_profile(None), bandwidth=3e10,
                          method="optimal")
    assert optimal.method == "optimal"
    for g, o in zip(greedy.shards, optimal.shards, strict=True):
        assert o.overhead_s <= g.overhead_s * (1 + 1e-9)


def test_plan_shard_rejects_keeping_across_tasks() -> None:
    spec = tiny_spec("adamw")
    plan = job_plan(spec)
    shard = profile_shards(spec, plan, tiny_profile(None), bytes_per_s=1e9)[1]
    keep = [LayerDecision.keep_all(len(layer.activations)) for layer in shard.layers]
    with pytest.raises(ValueError, match="only the last shard keeps"):
        plan_shard(shard, plan, 1 << 40, 1e9, decisions=keep)


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_planned_training_on_cuda_equals_plain_training() -> None:
    from sweepmaster.runtime import CudaDevice

    spec = tiny_spec("adamw")
    device = CudaDevice("cuda:0", memory_cap_bytes=64 * MiB)
    plan = make_plan(tiny_profile(None), spec.optimizer, CUTS, device)
    memory = forced_plan(spec, plan, ["S", "R", "SS", "M"])
    result = train_spilled(spec, device, plan, memory_plan=memory)
    expected = train_plain(spec, device)
    assert_weights(result.state_dict, expected.state_dict, exact=False)


def test_a_saved_tensor_on_another_device_stays_there_and_takes_no_slot() -> None:
    # CUDA's fused attention saves its RNG seed and offset on the host and reads them there in
    # backward: a swap plan must neither move them nor count them as slots
    from sweepmaster.runtime.training.swap import LayerPacker

    packer = LayerPacker([], torch.empty(4, 3, device="meta"), swap=[True])
    host = torch.arange(2)
    handle = packer.pack(host)
    assert packer.slots == []
    assert packer.unpack(handle) is host
