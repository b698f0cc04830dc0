"""Fused arrays that spill: stacked shards trained by the executor equal plain training."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.runtime import ShardExecutor, TrainCallbacks, train_plain
from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.execution.policy_chain import shard_chain
from sweepmaster.runtime.planning.packing import make_plan
from sweepmaster.runtime.planning.profile import profile_model
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.scheduling.residency import PEAK_MARGIN
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_noise import member_noises
from sweepmaster.runtime.training.fused_shards import (
    StackedLayerTooLargeError,
    dropout_noise_bytes,
    plan_stacked,
    stacked_profile,
    stacked_spec,
)
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob, train_fused_spilled
from sweepmaster.store import create_store_engine, get_sweep
from sweepmaster.store.fusion import fusion_groups
from sweepmaster.sweep import run_sweep
from sweepmaster.workload import OptimizerSpec
from tests.kit.fused import (
    BUDGET,
    CPU,
    MARKS,
    TIGHT,
    Recorder,
    assert_close_states,
    assert_equals_plain,
    assert_same_events,
    forced_stacked_plan,
    member,
    plain,
    spec,
)
from tests.kit.fused import tiny_config as fusion_config
from tests.kit.records import (
    Timeline,
    assert_never_overlaps,
    assert_one_task_at_a_time,
    hand_out_order,
    recorded_durations,
    replay,
)
from tests.kit.spill import MiB
from tests.kit.sweeps import tiny_sweep, write_sweep

pytestmark = MARKS

def test_stacked_profile_scales_every_byte_and_second_by_k() -> None:
    profile = profile_model(member(0))
    stacked = stacked_profile(profile, 3)
    assert stacked.total_param_bytes == 3 * profile.total_param_bytes
    for one, three in zip(profile.layers, stacked.layers, strict=True):
        assert three.saved_bytes == 3 * one.saved_bytes
        assert three.backward_peak_bytes == 3 * one.backward_peak_bytes
        assert three.forward_s == pytest.approx(3 * one.forward_s)
        assert three.param_names == one.param_names


def test_a_layer_of_k_members_that_does_not_fit_names_layer_bytes_and_budget() -> None:
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    with pytest.raises(StackedLayerTooLargeError,
                       match=r"layer 'embed' of 8 fused members needs .* MiB .* budget of 1.0 MiB"
                       ) as caught:
        plan_stacked(member(0), 8, device)
    assert caught.value.num_members == 8 and caught.value.budget_bytes == BUDGET


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_spilled_fused_array_equals_each_member_trained_plainly(opt_name: str) -> None:
    budget = BUDGET if opt_name == "sgd" else 3 * MiB // 2  # AdamW's state: 1.5 MiB
    specs = [member(seed, opt_name) for seed in (1, 2, 3)]
    recorders = [Recorder() for _ in specs]
    timeline = Timeline()
    with ShardExecutor(f"cpu:1x{budget}", spill="always", on_task=timeline) as executor:
        plan = executor.stacked_plan(specs[0], 3)
        futures = executor.submit_fused(specs, recorders, name="array")
        results = [future.result() for future in futures]
    assert len(plan.shards) >= 2 and plan.spill
    assert {r.job for r in timeline.records} == {"array"}
    kinds = {(r.kind, r.shard) for r in timeline.records}
    assert {("forward", 0), ("backward", 0), ("eval", 0)} <= kinds
    for member_spec, result, recorder in zip(specs, results, recorders, strict=True):
        assert_equals_plain(result, member_spec, opt_name)
        plain_recorder = Recorder()
        train_plain(member_spec, CPU, plain_recorder)
        assert_same_events(recorder.events, plain_recorder.events)
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget
        assert result.swap_bytes > 0 and result.num_promotes == result.num_demotes > 0


def test_each_member_draws_its_own_dropout_and_microbatches_keep_its_masks() -> None:
    specs = [member(seed) for seed in (4, 5)]
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_stacked(specs[0], 2, device, microbatch_size=1)
    assert all(shard.microbatch_size == 1 for shard in plan.shards)
    job = SpilledFusedJob(specs, plan)
    task = job.next_task()
    assert task is not None and task.phase == "eval"
    while task is not None and task.phase == "eval":
        job.run(task, device)
        task = job.next_task()
    assert task is not None
    job.run(task, device)  # the first training task draws every dropout noise of the step
    site = job.members._sites[0][0]
    embed_K = member_noises(site, specs, job.members._noise_states[0][0], slice(0, 2),
                            torch.Generator())
    assert embed_K.shape[:2] == (2, 2) and not torch.equal(embed_K[0], embed_K[1])
    while (task := job.next_task()) is not None:
        job.run(task, device)
    results = train_fused_spilled(specs, device, plan)
    for member_spec, result in zip(specs, results, strict=True):
        assert result is not None
        assert_equals_plain(result, member_spec, "sgd")
    # dropout matters: without it the weights differ
    undropped = plain(dataclasses.replace(specs[0], model=fusion_config(dropout=0.0)))
    assert results[0] is not None
    assert not torch.allclose(results[0].state_dict["transformer.h.0.mlp.c_fc.weight"],
                              undropped.state_dict["transformer.h.0.mlp.c_fc.weight"])


def test_a_pruned_member_leaves_and_the_others_still_equal_plain_training() -> None:
    class PruneAt2(TrainCallbacks):
        def on_eval(self, event):
            return event.step == 2

    class Boom(TrainCallbacks):
        def on_step(self, event):
            if event.step == 3:
                raise RuntimeError("callback broke")

    specs = [member(6), member(7), member(8), member(9, max_steps=3)]
    with ShardExecutor(f"cpu:1x{3 * MiB // 2}", spill="always") as executor:
        futures = executor.submit_fused(specs, [None, PruneAt2(), Boom(), None])
        with pytest.raises(RuntimeError, match="callback broke"):
            futures[2].result()
        results = [futures[i].result() for i in (0, 1, 3)]
    first, pruned, short = results
    assert pruned.pruned and pruned.steps == 2
    assert_close_states(pruned.state_dict, train_plain(specs[1], CPU, PruneAt2()).state_dict,
                        **TIGHT)
    assert short.steps == 3 and not short.pruned
    assert_equals_plain(short, specs[3], "sgd")
    assert first.steps == 5
    assert_equals_plain(first, specs[0], "sgd")


def test_two_spilled_fused_arrays_and_a_plain_job_share_one_executor_under_sharp() -> None:
    arrays = [[member(10), member(11)], [member(12), member(13)]]
    alone = member(14)
    timeline = Timeline()
    with ShardExecutor(f"cpu:2x{BUDGET}", spill="always", on_task=timeline,
                  policy="sharded-lrtf") as executor:
        futures = [executor.submit_fused(specs, name=f"array-{i}")
                   for i, specs in enumerate(arrays)]
        single = executor.submit(alone)
        results = [[f.result(timeout=600) for f in group] for group in futures]
        single_result = single.result(timeout=600)
        steps = alone.total_steps
        chains = [shard_chain(f"array-{i}", executor.stacked_plan(specs[0], 2), steps)
                  for i, specs in enumerate(arrays)]
        chains.append(shard_chain(alone.name, executor.plan(alone), steps))
        devices = executor.devices
    for specs, group in zip(arrays, results, strict=True):
        for member_spec, result in zip(specs, group, strict=True):
            assert_equals_plain(result, member_spec, "sgd")
            assert result.peak_device_bytes is not None and result.peak_device_bytes <= BUDGET
    assert_equals_plain(single_result, alone, "sgd")
    assert all(r.peak_bytes is not None and r.peak_bytes <= BUDGET for r in timeline.records)
    assert all(d.meter.live_bytes == 0 for d in devices)
    for records in (*timeline.by("device").values(), *timeline.by("job").values()):
        assert_never_overlaps(records)

    # What Sharded-LRTF decides from its inputs: the executor's chains, replayed with the
    # estimates and with the seconds each task really took (deterministic, unlike the run).
    durations = recorded_durations(timeline.records, chains)
    for seconds in (None, durations):
        result = replay(ShardedLRTF(2), chains, seconds)
        assert result == replay(ShardedLRTF(2), chains, seconds)
        assert_one_task_at_a_time(result)
        order = hand_out_order(result)
        # nothing measured yet: the two arrays, longest by estimate, start on the two devices
        assert sorted(order[:2]) == [(0, "array-0", 0), (1, "array-1", 0)]
        assert result.completion_s.keys() == {"array-0", "array-1", alone.name}
    # with the estimates, the policy interleaves all three before the first job finishes
    result = replay(ShardedLRTF(2), chains)
    first_end = min(result.completion_s.values())
    assert {g.job_id for g in result.gantt if g.start_s < first_end} == {
        "array-0", "array-1", alone.name}


def test_fixed_fusion_of_spilled_trials_is_capped_to_what_fits_and_auto_keeps_one() -> None:
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always", fusion=8) as executor:
        choice = executor.fusion_choice(member(0))
    assert choice.source == "capped" and 1 < choice.k < 8
    assert choice.stacked_plan is not None and choice.stacked_plan.spill
    assert f"{8} asked" in choice.note
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always", fusion="auto") as executor:
        choice = executor.fusion_choice(member(0))
    assert (choice.k, choice.source) == (1, "spills") and "auto" in choice.note
    clipped = member(0, optimizer=OptimizerSpec(name="sgd", lr=0.1, grad_clip=1.0))
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always", fusion=2) as executor:
        assert executor.fusion_choice(clipped).k == 2


def test_clipped_members_that_leave_early_or_fail_keep_plain_trainings_weights() -> None:
    """grad_clip without evaluation: deferred updates land before a member leaves.

    Member 1 (not clipped) ends after 3 of 5 steps (``update`` tasks apply the deferred
    updates first); member 2 fails at step 2 (its rows of the deferred gradients go with it).
    """

    class Boom(TrainCallbacks):
        def on_step(self, event):
            if event.step == 2:
                raise RuntimeError("callback broke")

    opts = [OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, grad_clip=clip)
            for clip in (0.5, None, 1.0)]
    specs = [member(40 + k, optimizer=opt, eval_data=None, eval_every=None,
                    max_steps=3 if k == 1 else 5) for k, opt in enumerate(opts)]
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_stacked(specs[0], 3, device)
    assert len(plan.shards) >= 3
    results = train_fused_spilled(specs, device, plan, [None, None, Boom()])
    assert results[2] is None
    for member_spec, result in zip(specs[:2], results[:2], strict=True):
        assert result is not None
        assert_close_states(result.state_dict, plain(member_spec).state_dict, rtol=0,
                            atol=1e-6)
    unclipped = plain(dataclasses.replace(specs[0], optimizer=dataclasses.replace(
        opts[0], grad_clip=None)))
    assert not torch.allclose(unclipped.state_dict["transformer.h.0.mlp.c_fc.weight"],
                              results[0].state_dict["transformer.h.0.mlp.c_fc.weight"])


@pytest.mark.slow
def test_sweep_with_fusion_2_on_a_budget_that_spills_tells_optuna_each_trial(
    tmp_path: Path,
) -> None:
    def config(path: Path, fusion: int | str):
        path.mkdir(parents=True)
        raw = tiny_sweep(path, resources={"fusion": fusion, "devices": "cpu:1x64MiB"},
                         train={"optimizer": "sgd"})
        raw["parameters"] = {"train.lr": {"values": [1e-2, 3e-3]}}
        return load_sweep_config(write_sweep(path, raw))

    fused, alone = config(tmp_path / "fused", 2), config(tmp_path / "alone", "off")
    shown = CliRunner().invoke(app, ["plan", str(tmp_path / "fused" / "sweep.yaml")],
                               env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "K = 2 as asked, spilled" in shown.output
    assert "fused array of 2 (stacked shards)" in shown.output
    outcome = run_sweep(fused)
    assert (outcome.num_run, outcome.num_finished, outcome.num_failed) == (2, 2, 0)
    assert run_sweep(alone).num_finished == 2
    engine = create_store_engine(fused.storage)
    groups = fusion_groups(engine, get_sweep(engine, "tiny").id)
    assert [sorted(members) for members in groups.values()] == [[0, 1]]

    def trials(config):
        study = optuna.load_study(study_name=config.name, storage=config.storage)
        return {t.params["train.lr"]: t for t in study.get_trials()}

    expected = trials(alone)
    for lr, got in trials(fused).items():
        assert got.state == TrialState.COMPLETE
        assert got.value == pytest.approx(expected[lr].value, rel=1e-6)
        assert got.intermediate_values.keys() == {3, 6}
        for step, value in expected[lr].intermediate_values.items():
            assert got.intermediate_values[step] == pytest.approx(value, rel=1e-6)


def test_schedules_weight_decay_and_checkpoints_of_spilled_members(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    opts = [OptimizerSpec(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-7,
                          warmup_steps=2, schedule="cosine"),
            OptimizerSpec(lr=5e-3, betas=(0.9, 0.99), schedule="linear")]
    specs = [spec(20, opts[0], model=fusion_config(dropout=0.1),
                  checkpoint_dir=tmp_path / "trial-20"),
             spec(21, opts[1], model=fusion_config(dropout=0.1), max_steps=3, eval_every=None)]
    device = VirtualDevice("cpu:0", budget_bytes=3 * MiB // 2)
    results = train_fused_spilled(specs, device, plan_stacked(specs[0], 2, device))
    first, short = results
    assert first is not None and short is not None
    assert first.checkpoint_path == tmp_path / "trial-20" and short.checkpoint_path is None
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trial-20", local_files_only=True)
    assert_close_states(reloaded.state_dict(), first.state_dict, rtol=0, atol=0)
    for member_spec, result in zip(specs, results, strict=True):
        assert_equals_plain(result, member_spec, "adamw")
        assert result.history("lr") == plain(member_spec).history("lr")


# ---------------------------------------------------------------- memory plans (mu-TWO)


def stacked_cut_plan(specs, cuts, rows=None):
    """The stacked plan of ``specs`` with given cuts (the 4 layers: embed, 2 blocks, head)."""
    profile = stacked_profile(profile_model(specs[0]), len(specs), dropout_noise_bytes(specs[0]))
    device = VirtualDevice("cpu:plan", budget_bytes=4 * MiB)
    return make_plan(profile, specs[0].optimizer, cuts, device, microbatch_sizes=rows,
                     prefetch_margin=PEAK_MARGIN)  # a stacked estimate, as plan_stacked's


def test_an_arrays_remaining_seconds_are_its_longest_members_at_the_planned_step() -> None:
    specs = [member(4, max_steps=3), member(5, max_steps=2)]
    plan = stacked_cut_plan(specs, [0, 2, 4])
    job = SpilledFusedJob(specs, plan)
    assert plan.step_s > 0 and job.remaining_seconds == pytest.approx(3 * plan.step_s)
    job.run_step(VirtualDevice("cpu:0", budget_bytes=4 * MiB))
    assert job.remaining_seconds == pytest.approx(2 * plan.step_s)
    memory = forced_stacked_plan(specs, plan, ["SR", "MK"])
    planned = SpilledFusedJob(specs, plan, memory_plan=memory)
    assert planned.remaining_seconds == pytest.approx(3 * memory.step_s)


def run_array(specs, plan, device, memory_plan):
    """Train the array task by task with prefetch; returns the job and each member's result."""
    results: list = [None] * len(specs)

    def ended(index, result, error):
        assert error is None, error
        results[index] = result

    job = SpilledFusedJob(specs, plan, on_member_end=ended, memory_plan=memory_plan)
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)
        job.run(task, device)
    job.settle(device)
    return job, results


@pytest.mark.parametrize(
    ("opt_name", "clip", "cuts", "rows", "codes"),
    [
        ("sgd", None, [0, 2, 4], None, ["SR", "MK"]),
        ("sgd", None, [0, 1, 3, 4], [2, 3, 2], ["R", "SR", "M"]),
        ("adamw", None, [0, 1, 3, 4], None, ["S", "RS", "M"]),
        ("adamw", 1.0, [0, 2, 3, 4], None, ["RS", "S", "M"]),
    ],
    ids=["sgd", "sgd-microbatches", "adamw", "adamw-clip"],
)
def test_planned_spilled_fused_array_equals_plain_training(opt_name, clip, cuts, rows,
                                                           codes) -> None:
    """K = 3 members (dropout on) with a forced plan that swaps some activations, keeps some
    and recomputes some layers: every member ends with plain training's weights, the metered
    peak stays within the device budget and the activation bytes moved are the plan's."""
    specs = [member(seed, opt_name) for seed in (1, 2, 3)]
    if clip is not None:
        specs = [dataclasses.replace(s, optimizer=dataclasses.replace(s.optimizer,
                                                                      grad_clip=clip))
                 for s in specs]
    plan = stacked_cut_plan(specs, cuts, rows)
    memory = forced_stacked_plan(specs, plan, codes)
    assert [s.codes for s in memory.shards][:-1] == codes[:-1]
    budget = 4 * MiB
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    job, results = run_array(specs, plan, device, memory)
    assert job.passes.plan_mismatches == 0 and job.passes.num_recompute_fallbacks == 0
    for member_spec, result in zip(specs, results, strict=True):
        expected = plain(member_spec)
        diff = max(float((result.state_dict[n] - expected.state_dict[n]).abs().max())
                   for n in expected.state_dict)
        print(f"{opt_name} clip={clip} {member_spec.name}: max abs weight diff {diff:.3g}")
        assert_equals_plain(result, member_spec, opt_name)
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget
    # every activation the plan swaps moved, once out and once back, at every step
    per_step = sum(shard.swap_bytes for shard in memory.shards)
    assert per_step > 0 and job.passes.activation_swap_bytes == job.members.step * per_step
    assert job.boundaries.swap_bytes > job.passes.activation_swap_bytes
    assert device.meter.live_bytes == 0


def test_planned_spilled_lora_array_equals_each_member_alone() -> None:
    """LoRA members (ranks, alphas and adapter dropouts differ; one clips) over one frozen
    base: the stacked adapters' activations swapped, recomputed and mixed."""
    from tests.kit.lora import SPILL_BUDGET as LORA_BUDGET
    from tests.kit.lora import SPILLED_MEMBERS as LORA_MEMBERS
    from tests.kit.lora import assert_equals_alone

    planned = stacked_spec(LORA_MEMBERS)
    plan = plan_stacked(planned, 3, VirtualDevice("cpu:plan", budget_bytes=LORA_BUDGET))
    assert len(plan.shards) == 4
    memory = forced_stacked_plan([planned] * 3, plan, ["S", "R", "S", "M"])
    device = VirtualDevice("cpu:0", budget_bytes=4 * MiB)
    results: list = [None] * 3

    def ended(index, result, error):
        assert error is None, error
        results[index] = result

    job = SpilledFusedJob(LORA_MEMBERS, plan, on_member_end=ended, planned=planned,
                          memory_plan=memory)
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)
        job.run(task, device)
    assert job.passes.plan_mismatches == 0 and job.passes.activation_swap_bytes > 0
    for member_spec, result in zip(LORA_MEMBERS, results, strict=True):
        diff = assert_equals_alone(result, member_spec)
        print(f"{member_spec.name}: max abs weight diff {diff:.3g}")
    assert device.meter.live_bytes == 0


def train_tasks(job):
    """The job's training tasks of its first step, and the next step's first one."""
    tasks, ahead = [], 0
    while (task := job.peek_task(ahead)) is not None:
        ahead += 1
        if task.phase == "train":
            tasks.append(task)
        if len(tasks) == job.plan.num_tasks_per_step + 1:
            return tasks
    raise AssertionError("the job trains less than two steps")


@pytest.mark.parametrize(("members", "budget", "memory"),
                         [("dropout", 1_200_000, False), ("lora", 4 * MiB // 5, False),
                          ("lora", 4 * MiB // 5, True)])
def test_a_stacked_plan_prefetches_where_the_array_does(members: str, budget: int,
                                                        memory: bool) -> None:
    # The array prefetches the next task's shard only with PEAK_MARGIN of the running task's
    # planned peak to spare (its peaks are estimates); so does its plan. Before, the plan
    # prefetched with no margin: at these budgets one task of a step more than the array did.
    from tests.kit.lora import SPILLED_MEMBERS as LORA_MEMBERS

    specs = list(LORA_MEMBERS) if members == "lora" else [member(seed) for seed in (1, 2, 3)]
    planned = stacked_spec(specs)
    plan = plan_stacked(planned, 3, VirtualDevice("cpu:plan", budget_bytes=budget),
                        microbatch_size=2 if members == "lora" else None)
    assert plan.prefetch_margin == PEAK_MARGIN and len(plan.shards) == 4
    memory_plan = forced_stacked_plan(specs, plan, ["R", "S", "R", "R"]) if memory else None
    flags = memory_plan.prefetch if memory_plan is not None else plan.prefetch
    job = SpilledFusedJob(specs, plan, planned=planned, memory_plan=memory_plan)
    pairs = list(itertools.pairwise(train_tasks(job)))
    assert [job.store._may_prefetch(a, b) for a, b in pairs] == list(flags)
    # a task the margin keeps from prefetching: with no margin, its next shard would fit
    limit = memory_plan.limit_bytes if memory_plan is not None else plan.budget_bytes
    assert any(not flag and job.planned_peak_bytes(a) + plan.shards[b.shard].param_bytes <= limit
               for flag, (a, b) in zip(flags, pairs, strict=True))


def test_greedy_memory_plan_of_a_spilled_fused_array_keeps_the_metered_peak() -> None:
    """mu-TWO's greedy plan for the array's own budget: the meter (which raises past the
    budget) sees the planned peak, and every member still equals plain training."""
    specs = [member(seed, "adamw") for seed in (1, 2, 3)]
    budget = 3 * MiB // 2
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    plan = plan_stacked(specs[0], 3, device)
    memory = plan_stacked_memory(specs[0], 3, plan, device=device, bandwidth=1e13)
    assert any("S" in shard.codes for shard in memory.shards)  # swaps cost nothing here
    job, results = run_array(specs, plan, device, memory)
    metered = job.bookkeeping.peak_device_bytes
    print(f"planned peak {memory.peak_bytes}, metered {metered}, budget {budget}")
    assert metered <= budget
    assert abs(memory.peak_bytes - metered) <= 0.10 * metered
    for member_spec, result in zip(specs, results, strict=True):
        assert_equals_plain(result, member_spec, "adamw")


def test_executor_plans_the_activations_of_a_spilled_fused_array() -> None:
    """``plan_activations`` (default): a spilled fused array runs its stacked memory plan,
    made once per architecture, budget and K; off, it recomputes every activation."""
    specs = [member(seed) for seed in (71, 72, 73)]
    for plan_activations in (True, False):
        with ShardExecutor(f"cpu:1x{BUDGET}", spill="always",
                      plan_activations=plan_activations) as executor:
            memory = executor.memory_plan(specs[0], 3)
            assert (memory is not None) == plan_activations
            assert executor.memory_plan(specs[0], 3) is memory  # cached
            results = [f.result() for f in executor.submit_fused(specs)]
        for member_spec, result in zip(specs, results, strict=True):
            assert_equals_plain(result, member_spec, "sgd")
            assert result.peak_device_bytes is not None and result.peak_device_bytes <= BUDGET


def test_double_buffered_prefetch_keeps_results_and_the_budget() -> None:
    budget = 3 * MiB // 4
    specs = [member(seed) for seed in (30, 31)]
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    plan = plan_stacked(specs[0], 2, device)
    assert len(plan.shards) >= 3 and any(plan.prefetch)
    results: list = [None, None]

    def ended(index, result, error):
        results[index] = result

    job = SpilledFusedJob(specs, plan, on_member_end=ended)
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)
        job.run(task, device)
    assert job.store.num_prefetches > 0
    assert job.bookkeeping.peak_device_bytes <= budget
    for member_spec, result in zip(specs, results, strict=True):
        assert_equals_plain(result, member_spec, "sgd")


def test_members_resumed_at_their_end_leave_at_once_with_their_results(tmp_path: Path) -> None:
    specs = [member(50 + k, max_steps=2, eval_every=None, state_dir=tmp_path / f"m{k}",
                    checkpoint_every=2) for k in range(2)]
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="always") as executor:
        first = [future.result() for future in executor.submit_fused(specs)]
        recorders = [Recorder(), Recorder()]
        again = [future.result(timeout=600)
                 for future in executor.submit_fused(specs, recorders)]
    for before, after, recorder in zip(first, again, recorders, strict=True):
        assert after.steps == 2 and after.metrics == before.metrics
        assert_close_states(after.state_dict, before.state_dict, rtol=0, atol=0)
        assert [e[0] for e in recorder.events] == ["start"]


def test_killed_members_resume_from_their_own_steps_and_repeat_no_event(tmp_path: Path) -> None:
    """Evaluated every 2 steps, checkpointed every 2 and 3: killed at step 5, the members
    resume from steps 4 and 3, repeat no step or evaluation, and end as uninterrupted (their
    checkpoints are any path's: plain training resumes one too)."""

    class Kill(BaseException):
        pass

    class Events(Recorder):
        def __init__(self, kill: int | None = None) -> None:
            super().__init__()
            self.kill = kill

        def on_step(self, event):
            super().on_step(event)
            if event.step == self.kill:
                raise Kill

    def specs(root: Path | None) -> list:
        return [member(60 + k, max_steps=6, state_dir=None if root is None else root / f"m{k}",
                       checkpoint_every=None if root is None else every)
                for k, every in enumerate((2, 3))]

    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_stacked(specs(None)[0], 2, device)
    uninterrupted = [Events(), Events()]
    want = train_fused_spilled(specs(None), device, plan, uninterrupted)
    killed = specs(tmp_path)
    with pytest.raises(Kill):
        train_fused_spilled(killed, device, plan, [Events(kill=5), Events()])
    second = [Events(), Events()]
    got = train_fused_spilled(killed, device, plan, second)
    for k, done in enumerate((4, 3)):
        assert got[k] is not None and want[k] is not None
        assert_close_states(got[k].state_dict, want[k].state_dict, rtol=0, atol=1e-6)
        assert [(p.step, p.name) for p in got[k].metrics] == \
            [(p.step, p.name) for p in want[k].metrics]
        tail = [e for e in uninterrupted[k].events[1:] if e[1] > done]
        assert [e[:2] for e in second[k].events[1:]] == [e[:2] for e in tail]
    resumed_plain = train_plain(killed[1], CPU)  # member 1's checkpoint of step 3
    assert_close_states(resumed_plain.state_dict, want[1].state_dict, rtol=0, atol=1e-6)


@pytest.mark.parametrize("leave", [False, True], ids=["all-stay", "leave-and-fail"])
def test_a_stacked_shard_used_next_on_the_same_device_stays_resident(leave: bool) -> None:
    """The residency cache of spilled fused arrays: same numbers, fewer promotes and bytes.

    With ``leave``, members clip, one ends early and one fails: the kept shard is written back
    before a member's rows leave the host tensors.
    """

    class Boom(TrainCallbacks):
        def on_step(self, event):
            if event.step == 2:
                raise RuntimeError("callback broke")

    clips = (0.5, None, 1.0) if leave else (None, None, None)
    specs = [member(60 + k, optimizer=OptimizerSpec(name="sgd", lr=0.1, momentum=0.9,
                                                    grad_clip=clip),
                    eval_data=None, eval_every=None, max_steps=3 if leave and k == 1 else 4)
             for k, clip in enumerate(clips)]
    callbacks = [None, None, Boom()] if leave else None
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_stacked(specs[0], 3, device)
    assert len(plan.shards) >= 3
    baseline = SpilledFusedJob(specs, plan, callbacks)
    while (task := baseline.next_task()) is not None:
        baseline.run(task, device)
    kept_results: list = [None] * 3

    def ended(index, result, error):
        kept_results[index] = result

    job = SpilledFusedJob(specs, plan, callbacks, on_member_end=ended)
    shard0 = sum(t.nbytes for t in job.store._promoted_hosts(0))  # K = 3 members' rows
    while (task := job.next_task()) is not None:
        job.run(task, device, keep=True)
    assert job.store.resident_shard(device) is None and device.meter.live_bytes == 0
    expected = train_fused_spilled(specs, device, plan, callbacks)
    for result, want in zip(kept_results, expected, strict=True):
        assert (result is None) == (want is None)
        if result is not None:
            assert_close_states(result.state_dict, want.state_dict, rtol=0, atol=0)
    # shard 0: a step's backward, then the next step's forward (unless a member left between)
    assert job.store.num_resident_hits >= (1 if leave else 3)
    assert job.store.num_promotes == baseline.store.num_promotes - job.store.num_resident_hits
    assert job.boundaries.swap_bytes < baseline.boundaries.swap_bytes
    if not leave:  # every hit saves one promote of shard 0's three members
        assert job.boundaries.swap_bytes == \
            baseline.boundaries.swap_bytes - job.store.num_resident_hits * shard0
