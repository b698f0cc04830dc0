"""The SHARP executor: many jobs on few devices, each ending with its plain training's weights."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

from sweepmaster.runtime import (
    Device,
    JobCancelledError,
    ShardExecutor,
    TaskRecord,
    VirtualDevice,
    train_plain,
)
from sweepmaster.runtime.execution.policy_chain import shard_chain
from sweepmaster.runtime.planning.partition import plan_job
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.scheduling.residency import PEAK_MARGIN
from tests.kit.records import (
    Timeline,
    assert_never_overlaps,
    assert_one_task_at_a_time,
    hand_out_order,
    num_runs,
    recorded_durations,
    replay,
)
from tests.kit.spill import OPTIMIZERS, MiB, Recorder, assert_weights, tiny_config, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 500_000  # bytes: the tiny GPT-2 needs 2.5x this and more to train plainly


def four_specs():
    return [
        tiny_spec("adamw", name="a", seed=1, max_steps=4),
        tiny_spec("sgd", name="b", seed=2, max_steps=3),
        tiny_spec("adamw-clip", name="c", seed=3, max_steps=4),
        tiny_spec("adamw", name="d", seed=4, max_steps=2,
                  optimizer=dataclasses.replace(OPTIMIZERS["adamw"], lr=1e-2)),
    ]


def test_four_spilled_jobs_share_two_devices_and_match_plain_training() -> None:
    timeline = Timeline()
    specs = four_specs()
    with ShardExecutor(f"cpu:2x{BUDGET}", on_task=timeline) as executor:
        plans = [executor.plan(spec) for spec in specs]
        assert all(plan.spill and len(plan.shards) >= 2 for plan in plans)
        assert all(plan.plain_bytes > 2 * BUDGET for plan in plans)
        recorders = [Recorder() for _ in specs]
        futures = [executor.submit(s, r) for s, r in zip(specs, recorders, strict=True)]
        results = [future.result() for future in futures]
        devices = executor.devices
    for spec, result, recorder in zip(specs, results, recorders, strict=True):
        expected = train_plain(spec, Device("cpu"))
        assert_weights(result.state_dict, expected.state_dict, exact=False)
        assert [e.step for e in recorder.steps] == list(range(1, spec.total_steps + 1))
        assert result.swap_bytes > 0 and result.steps == spec.total_steps
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= BUDGET
    # a device runs one task at a time; a job one task at a time
    for records in (*timeline.by("device").values(), *timeline.by("job").values()):
        assert_never_overlaps(records)
    # which device ran what is the threads' timing; what the policy decides from the chains and
    # the seconds the tasks took is not: both devices work, from the first task on
    chains = [shard_chain(spec.name, plan, spec.total_steps)
              for spec, plan in zip(specs, plans, strict=True)]
    replayed = replay(ShardedLRTF(2), chains, recorded_durations(timeline.records, chains))
    assert_one_task_at_a_time(replayed)
    assert {device for device, _, _ in hand_out_order(replayed)[:2]} == {0, 1}
    assert replayed.completion_s.keys() == {spec.name for spec in specs}
    # every job ran 2S-1 training tasks per step; the records add up to its swap volume
    for spec, plan, result in zip(specs, plans, results, strict=True):
        records = timeline.by("job")[spec.name]
        training = [r for r in records if r.kind in ("forward", "backward")]
        assert len(training) == spec.total_steps * plan.num_tasks_per_step
        assert sum(r.swap_bytes for r in records) == result.swap_bytes
    assert all(d.meter.live_bytes == 0 for d in devices)
    assert all(r.peak_bytes is not None and r.peak_bytes <= BUDGET for r in timeline.records)


def test_a_failing_job_fails_alone() -> None:
    bad = tiny_spec("sgd", name="bad", max_steps=3, eval_data=None,
                    optimizer=dataclasses.replace(OPTIMIZERS["sgd"], lr=1e30))
    good = tiny_spec("adamw", name="good", max_steps=3)
    with ShardExecutor(f"cpu:2x{BUDGET}") as executor:
        bad_future, good_future = executor.submit(bad), executor.submit(good)
        with pytest.raises(FloatingPointError, match="non-finite train loss"):
            bad_future.result()
        result = good_future.result()
    assert_weights(result.state_dict, train_plain(good, Device("cpu")).state_dict, exact=False)


def test_out_of_memory_fails_the_job_with_its_reason() -> None:
    spec = tiny_spec("adamw", max_steps=1)
    with ShardExecutor(f"cpu:1x{BUDGET}", spill="never") as executor:
        with pytest.raises(torch.OutOfMemoryError, match="cpu:0 out of memory"):
            executor.fit(spec)
        small = tiny_config(n_layer=1, n_embd=8)
        assert executor.fit(tiny_spec("adamw", max_steps=1, batch_size=1, model=small)).steps == 1


def test_pruned_job_leaves_and_the_others_go_on() -> None:
    specs = [tiny_spec("adamw", name="pruned", max_steps=5), tiny_spec("sgd", name="kept")]
    recorders = [Recorder(prune_at=2), Recorder()]
    with ShardExecutor(f"cpu:2x{BUDGET}") as executor:
        pruned, kept = (executor.submit(s, r).result()
                        for s, r in zip(specs, recorders, strict=True))
    assert pruned.pruned and pruned.steps == 2
    assert not kept.pruned and kept.steps == specs[1].total_steps
    assert_weights(kept.state_dict, train_plain(specs[1], Device("cpu")).state_dict, exact=False)


def test_fitting_and_spilled_jobs_mix() -> None:
    timeline = Timeline()
    small = tiny_spec("sgd", name="small", max_steps=3, batch_size=2,
                      model=tiny_config(n_layer=1, n_embd=16))
    large = tiny_spec("adamw", name="large", max_steps=3)
    with ShardExecutor(f"cpu:2x{BUDGET}", on_task=timeline) as executor:
        small_plan, large_plan = executor.plan(small), executor.plan(large)
        assert not small_plan.spill and large_plan.spill
        assert len(small_plan.shards) == 1 and len(large_plan.shards) >= 2
        small_result, large_result = (executor.submit(s).result() for s in (small, large))
    # the job that fits is one shard: one task per step (forward, loss, backward and update)
    training = [r for r in timeline.records if r.job == "small" and r.kind != "eval"]
    assert [(r.kind, r.shard, r.step) for r in training] == [("backward", 0, s) for s in range(3)]
    assert sum(r.swap_bytes for r in timeline.records if r.job == "small") == \
        small_result.swap_bytes
    assert_weights(small_result.state_dict, train_plain(small, Device("cpu")).state_dict,
                   exact=False)
    assert_weights(large_result.state_dict, train_plain(large, Device("cpu")).state_dict,
                   exact=False)


def test_jobs_that_fit_interleave_their_steps_and_stay_resident() -> None:
    """Two jobs that fit one device, default settings: step-sized tasks (S = 1) under SHARP.

    Sharded-LRTF interleaves their steps; the budget holds one job's step beside what the other
    keeps, so each keeps its weights and optimizer state resident and promotes them once.
    """
    specs = [tiny_spec("adamw-clip", name="r1", seed=1, max_steps=4, eval_data=None),
             tiny_spec("sgd", name="r2", seed=2, max_steps=4)]
    probes = [plan_job(spec, VirtualDevice("cpu:9", budget_bytes=64 * MiB)).shards[0]
              for spec in specs]
    steps = [(s.backward_peak_bytes + s.optimizer_bytes) * (1 + PEAK_MARGIN) for s in probes]
    kept = [s.param_bytes + s.optimizer_bytes for s in probes]
    budget = int(max(steps[0] + kept[1], steps[1] + kept[0])) + 1
    timeline = Timeline()
    with ShardExecutor(f"cpu:1x{budget}", on_task=timeline) as executor:
        plans = [executor.plan(spec) for spec in specs]
        assert all(not plan.spill and len(plan.shards) == 1 for plan in plans)
        with executor._state.condition:  # the worker waits until both jobs are submitted
            futures = [executor.submit(spec) for spec in specs]
        results = [future.result(timeout=300) for future in futures]
        [device] = executor.devices
    # in whatever order the device ran them: each fits beside what the other keeps, so each
    # is promoted once (a job run wholly before the other promotes once too)
    assert device.meter.live_bytes == 0
    assert max(r.peak_bytes for r in timeline.records) <= budget
    for spec, result in zip(specs, results, strict=True):
        expected = train_plain(spec, Device("cpu")).state_dict
        assert_weights(result.state_dict, expected, exact=False)
        diff = max((result.state_dict[name] - tensor).abs().max().item()
                   for name, tensor in expected.items())
        print(f"{spec.name}: max abs weight diff {diff:.3g}")
        training = [r for r in timeline.records if r.job == spec.name and r.kind != "eval"]
        assert [(r.kind, r.shard, r.step) for r in training] == [
            ("backward", 0, s) for s in range(spec.total_steps)]
        assert result.num_promotes == 1  # resident from its first step to its last
    # the order is what Sharded-LRTF decides from the chains and the seconds the tasks took:
    # replayed (deterministic), it interleaves the steps of both
    chains = [shard_chain(spec.name, plan, spec.total_steps,
                          eval_rows=0 if spec.eval_data is None else len(spec.eval_data),
                          eval_every=spec.eval_every)
              for spec, plan in zip(specs, plans, strict=True)]
    replayed = replay(ShardedLRTF(1, device_bytes=budget), chains,
                      recorded_durations(timeline.records, chains))
    assert_one_task_at_a_time(replayed)
    order = [job for _, job, _ in hand_out_order(replayed)]
    assert all(runs > 1 for runs in num_runs(order).values())  # not one contiguous block each
    assert replayed.num_promotes == len(specs)  # each kept its shard beside the other's steps


@pytest.mark.parametrize("opt_name", ["adamw", "adamw-clip"])
def test_a_job_on_the_host_cpu_trains_in_place(opt_name: str) -> None:
    spec = tiny_spec(opt_name, name="host", max_steps=3)
    timeline = Timeline()
    with ShardExecutor("cpu", on_task=timeline) as executor:
        assert len(executor.plan(spec).shards) == 1
        result = executor.fit(spec)
        [device] = executor.devices
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict)  # bitwise
    stats = device.transfers
    assert (stats.promote_bytes, stats.demote_bytes, stats.num_promotes, stats.num_demotes) == (
        0, 0, 0, 0)
    assert result.swap_bytes == 0 and all(r.swap_bytes == 0 for r in timeline.records)
    training = [r for r in timeline.records if r.kind != "eval"]
    assert [(r.kind, r.shard, r.step) for r in training] == [("backward", 0, s) for s in range(3)]


def test_same_names_are_made_unique_and_cancel_stops_a_waiting_job() -> None:
    timeline = Timeline()
    gate = threading.Event()

    class Waits(Recorder):
        def on_start(self, event):
            gate.wait(timeout=60)
            super().on_start(event)

    spec = tiny_spec("adamw", name="job", max_steps=2)
    executor = ShardExecutor(f"cpu:1x{64 * MiB}", on_task=timeline)
    first = executor.submit(spec, Waits())  # holds the only device until the gate opens
    second = executor.submit(spec)
    assert executor.cancel("job#1") and not executor.cancel("nope")
    gate.set()
    with pytest.raises(JobCancelledError):
        second.result()
    assert first.result().steps == 2
    executor.close()
    assert {r.job for r in timeline.records} == {"job"}
    with pytest.raises(RuntimeError, match="closed"):
        executor.submit(spec)


def test_policies_by_name_and_unknown_policy() -> None:
    specs = four_specs()[:2]
    expected = [train_plain(spec, Device("cpu")) for spec in specs]
    for policy in ("task-parallel-fifo", "round-robin", "model-parallel"):
        with ShardExecutor(f"cpu:2x{BUDGET}", policy=policy) as executor:
            results = [f.result() for f in [executor.submit(spec) for spec in specs]]
        for result, plain in zip(results, expected, strict=True):
            assert_weights(result.state_dict, plain.state_dict, exact=False)
    with pytest.raises(ValueError, match="unknown policy"):
        ShardExecutor("cpu", policy="fastest")
    with pytest.raises(ValueError, match="fresh and for 2 devices"):
        ShardExecutor(f"cpu:2x{BUDGET}", policy=ShardedLRTF(1))
    with ShardExecutor(f"cpu:1x{BUDGET}", policy=ShardedLRTF(1)) as executor:
        assert executor.policy_name == "sharded-lrtf"


def test_virtual_devices_split_the_threads_and_close_restores_them() -> None:
    before = (os.cpu_count() or 1) // 2 + 1  # not what two devices split the cores into
    torch.set_num_threads(before)
    seen: list[int] = []  # the thread count each task ran with

    def note_threads(record: TaskRecord) -> None:
        seen.append(torch.get_num_threads())

    with ShardExecutor(f"cpu:2x{BUDGET}", on_task=note_threads) as executor:
        executor.fit(tiny_spec("sgd", max_steps=1))
    assert set(seen) == {max(1, (os.cpu_count() or 1) // 2)}
    assert torch.get_num_threads() == before


def test_close_with_cancel_fails_the_waiting_jobs() -> None:
    gate = threading.Event()

    class Waits(Recorder):
        def on_start(self, event):
            assert gate.wait(timeout=300)  # holds the only device until close was called
            super().on_start(event)

    devices = [VirtualDevice("cpu:0", budget_bytes=BUDGET)]
    executor = ShardExecutor(devices)
    first, *rest = four_specs()
    futures = [executor.submit(first, Waits()), *(executor.submit(spec) for spec in rest)]
    executor.close(wait=False, cancel=True)
    gate.set()
    executor.close()  # waits for the workers
    for future in futures:  # the running job's task finished first, then it was cancelled too
        with pytest.raises(JobCancelledError):
            future.result(timeout=300)
    assert devices[0].meter.live_bytes == 0


def test_spilled_jobs_with_memory_plans_prefetch_beside_each_other_within_the_budget() -> None:
    # Prefetch beside another job's task reads the peak of the plan the task really runs (its
    # memory plan's, near the budget), not the full-recompute plan's.
    budget = 24 * MiB
    model = tiny_config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=64,
                        resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    generator = torch.Generator().manual_seed(5)
    data = torch.randint(0, 2048, (24, 64), generator=generator)
    # SGD: AdamW's normalised step turns the microbatches' fp32 rounding (1e-9 here) into 1e-5
    specs = [tiny_spec("sgd", name=f"wide-{i}", seed=i, model=model, train_data=data,
                       eval_data=None, batch_size=8, max_steps=2) for i in range(3)]
    timeline = Timeline()
    with ShardExecutor("cpu:1x24MiB", on_task=timeline) as executor:
        assert executor.memory_plan(specs[0]) is not None  # prefetch and memory plans are on
        futures = [executor.submit(spec) for spec in specs]
        results = [future.result(timeout=600) for future in futures]
        [device] = executor.devices
    for spec, result in zip(specs, results, strict=True):
        assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict,
                       exact=False)
        assert result.peak_device_bytes is not None and result.peak_device_bytes <= budget
    assert all(r.peak_bytes is not None and r.peak_bytes <= budget for r in timeline.records)
    assert device.meter.live_bytes == 0
