"""A job that runs out of device memory in its first step is re-planned with less and restarted.

The memory runs out for real: bytes of "another process" are counted on the device's meter (a
tensor it tracks), which the planner was not told about, so the job's own task meets the
meter's ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import traceback

import optuna
import pytest
import torch

import sweepmaster
from sweepmaster.runtime import (
    Device,
    ReplanEvent,
    ShardExecutor,
    SpilledJob,
    VirtualDevice,
    plan_job,
    plan_memory,
    train_plain,
    train_spilled,
)
from sweepmaster.runtime.execution.replan import MAX_REPLANS
from sweepmaster.runtime.planning.memplan import MemoryPlanError
from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.runtime.training.fused_spill import train_fused_spilled
from sweepmaster.sweep import SweepObserver
from sweepmaster.sweep.trial_callbacks import TrialCallbacks
from tests.kit.fused import assert_equals_plain, member
from tests.kit.spill import Recorder, assert_weights, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 500_000  # bytes: the tiny GPT-2 spills into 3 shards here
HANG_GUARD_S = 300  # not a timing assertion: every job here ends within seconds


class OtherProcess(Recorder):
    """Records the job's events; holds ``num_bytes`` on the device, released at the first re-plan
    unless ``keeps``."""

    def __init__(self, device: VirtualDevice, num_bytes: int, keeps: bool = False) -> None:
        super().__init__()
        self.held: torch.Tensor | None = torch.empty(num_bytes, dtype=torch.uint8)
        device.meter.track(self.held)
        self.keeps = keeps
        self.replans: list[ReplanEvent] = []

    def on_replan(self, event: ReplanEvent) -> None:
        self.replans.append(event)
        if not self.keeps:
            self.held = None


def fresh_result(spec, executor: ShardExecutor, event: ReplanEvent):
    """A fresh job of the re-planned plan, alone on a device of the executor's budget."""
    device = executor.planning_device
    plan = plan_job(spec, device, budget_bytes=event.budget_bytes)
    assert len(plan.shards) == event.num_shards
    try:
        memory = plan_memory(spec, plan, device=device)
    except MemoryPlanError:
        memory = None
    alone = VirtualDevice("cpu:alone", budget_bytes=device.budget_bytes)
    return train_spilled(spec, alone, plan, memory_plan=memory)


def run(spec, budget: int, other_bytes: int, *, keeps: bool = False):
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    other = OtherProcess(device, other_bytes, keeps)
    with ShardExecutor([device]) as executor:
        plan = executor.plan(spec)
        result = executor.submit(spec, other).result(timeout=HANG_GUARD_S)
        fresh = fresh_result(spec, executor, other.replans[-1])
    other.held = None
    assert device.meter.live_bytes == 0
    return plan, result, other, fresh


def test_a_spilled_job_that_runs_out_of_memory_in_its_first_step_gets_more_shards() -> None:
    spec = tiny_spec("adamw", name="trial-3", max_steps=3)
    plan, result, other, fresh = run(spec, BUDGET, BUDGET // 2)
    assert plan.spill and len(plan.shards) == 3
    [event] = other.replans  # released at once: one re-plan
    assert event.message.startswith("job trial-3 ran out of memory on cpu:0 in its first step; "
                                    f"re-planned: {event.num_shards} shards, microbatch ")
    assert event.attempt == 1 and event.budget_bytes < plan.peak_bytes
    assert event.num_shards > len(plan.shards) or event.smallest_microbatch_size < 4
    assert result.num_replans == 1 and result.steps == 3
    assert_weights(result.state_dict, fresh.state_dict)  # bitwise: a fresh job of the new plan
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    # the failed attempt's start and step-0 evaluation reached the receiver once
    assert len(other.starts) == 1 and [e.step for e in other.evals] == [0, 2, 3]
    assert [e.step for e in other.steps] == [1, 2, 3]
    assert result.history("eval_loss") == fresh.history("eval_loss")


def test_a_job_of_one_shard_that_runs_out_of_memory_in_its_first_step_spills() -> None:
    spec = tiny_spec("sgd", max_steps=2)
    budget = 4 * 2**20
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    with ShardExecutor([device]) as executor:
        plain_bytes = executor.plan(spec).plain_bytes
        assert not executor.will_spill(spec)
    plan, result, other, fresh = run(spec, budget, budget - plain_bytes // 2)
    assert not plan.spill and len(plan.shards) == 1
    [event] = other.replans
    assert event.budget_bytes < plain_bytes and result.num_replans == 1
    assert result.swap_bytes > 0 and result.steps == 2  # it spilled
    assert_weights(result.state_dict, fresh.state_dict)
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)


def test_a_re_plan_keeps_the_executor_s_microbatch_size_and_activation_setting() -> None:
    spec = tiny_spec("adamw", name="trial-3", max_steps=2)
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    other = OtherProcess(device, BUDGET // 2)
    with ShardExecutor([device], microbatch_size=2, plan_activations=False) as executor:
        result = executor.submit(spec, other).result(timeout=HANG_GUARD_S)
    other.held = None
    [event] = other.replans
    assert event.microbatch_size <= 2 and result.num_replans == 1
    # the same plan, made with the executor's settings, with Hydra's recompute of every activation
    plan = plan_job(spec, device, budget_bytes=event.budget_bytes, microbatch_size=2)
    assert len(plan.shards) == event.num_shards
    fresh = train_spilled(spec, VirtualDevice("cpu:alone", budget_bytes=BUDGET), plan)
    assert_weights(result.state_dict, fresh.state_dict)
    assert result.history("eval_loss") == fresh.history("eval_loss")
    assert result.peak_device_bytes <= fresh.peak_device_bytes  # a memory plan keeps more


def test_memory_another_process_keeps_is_planned_around() -> None:
    spec = tiny_spec("adamw", max_steps=2)
    plan, result, other, fresh = run(spec, BUDGET, BUDGET * 3 // 10, keeps=True)
    assert len(other.replans) == result.num_replans >= 1  # each re-plan asks for less
    assert [e.attempt for e in other.replans] == list(range(1, result.num_replans + 1))
    budgets = [plan.peak_bytes] + [e.budget_bytes for e in other.replans]
    assert budgets == sorted(budgets, reverse=True)
    assert result.peak_device_bytes is not None and result.peak_device_bytes <= BUDGET
    assert_weights(result.state_dict, fresh.state_dict)


class TakesTheDeviceAtStep(Recorder):
    """Another process fills the device right after the job's first step."""

    def __init__(self, device: VirtualDevice) -> None:
        super().__init__()
        self.device = device
        self.held: torch.Tensor | None = None
        self.replans: list[ReplanEvent] = []

    def on_step(self, event) -> None:
        super().on_step(event)
        if event.step == 1:
            meter = self.device.meter
            self.held = torch.empty(meter.budget_bytes - meter.live_bytes, dtype=torch.uint8)
            meter.track(self.held)

    def on_replan(self, event: ReplanEvent) -> None:
        self.replans.append(event)


def test_out_of_memory_after_the_first_step_still_fails_the_job() -> None:
    spec = tiny_spec("adamw", max_steps=3)
    device = VirtualDevice("cpu:0", budget_bytes=4 * 2**20)
    other = TakesTheDeviceAtStep(device)
    with ShardExecutor([device]) as executor:
        with pytest.raises(torch.OutOfMemoryError, match="cpu:0 out of memory"):
            executor.fit(spec, other)
    assert [e.step for e in other.steps] == [1] and other.replans == []
    other.held = None
    assert device.meter.live_bytes == 0


def test_a_job_that_never_fits_fails_after_the_last_re_plan() -> None:
    spec = tiny_spec("adamw", max_steps=2)
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    other = OtherProcess(device, BUDGET - 20_000, keeps=True)  # the device is all but full
    with ShardExecutor([device]) as executor:
        with pytest.raises(torch.OutOfMemoryError, match="cpu:0 out of memory"):
            executor.fit(spec, other)
    assert len(other.replans) == MAX_REPLANS and other.steps == []
    other.held = None
    assert device.meter.live_bytes == 0


def test_the_python_api_tells_the_user_callbacks_and_reports_once() -> None:
    spec = tiny_spec("adamw", max_steps=2)
    study = optuna.create_study()
    trial = study.ask()
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    other = OtherProcess(device, BUDGET // 2)
    with sweepmaster.Executor([device]) as executor:
        result = executor.fit(spec, trial, other)
    assert len(other.replans) == result.num_replans == 1
    assert [e.step for e in other.evals] == [0, 2]
    assert study.trials[0].intermediate_values == {2: result.history("eval_loss")[-1][1]}


def test_a_restart_after_the_first_jit_updates_trains_from_the_spec() -> None:
    """Out of memory in step 0's second backward task: the last shard was already updated."""
    spec = tiny_spec("sgd", max_steps=3)  # no clipping: shard 2 updates in its backward
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    other = OtherProcess(device, 0)
    tasks: list[tuple[str, int, int]] = []

    def fill_after_the_last_backward(record) -> None:  # another process, between two tasks
        tasks.append((record.kind, record.shard, record.step))
        if (record.kind, record.shard, record.step) == ("backward", 2, 0) and not other.replans:
            meter = device.meter
            other.held = torch.empty(meter.budget_bytes - meter.live_bytes, dtype=torch.uint8)
            meter.track(other.held)

    with ShardExecutor([device], on_task=fill_after_the_last_backward) as executor:
        assert len(executor.plan(spec).shards) == 3
        result = executor.fit(spec, other)
        fresh = fresh_result(spec, executor, other.replans[-1])
    [event] = other.replans
    # shard 2's backward (and jit update) ran; the next task ran out of memory (in its own
    # promote, recorded, or in an early fetch of activations before it), and the job began
    # again with its step-0 evaluation
    updated = tasks.index(("backward", 2, 0))
    assert tasks[updated + 1 : updated + 3] in ([("eval", 0, 0), ("eval", 1, 0)],
                                                [("backward", 1, 0), ("eval", 0, 0)])
    assert event.attempt == 1
    assert result.num_replans == 1 and result.steps == 3
    assert_weights(result.state_dict, fresh.state_dict)
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    assert device.meter.live_bytes == 0


class Messages(SweepObserver):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_a_launch_shows_each_re_plan_as_one_message() -> None:
    observer = Messages()
    trial = optuna.create_study().ask()
    callbacks = TrialCallbacks(trial, None, observer, "eval_loss")  # a re-plan records nothing
    callbacks.on_replan(ReplanEvent("trial-3", "cuda:0", 1, 3 * 2**30, 6, 2, 2))
    assert observer.lines == ["job trial-3 ran out of memory on cuda:0 in its first step; "
                              "re-planned: 6 shards, microbatch 2"]
    assert callbacks.num_shards == 6  # the trial's device statistics name the new plan's
    callbacks.on_replan(ReplanEvent("trial-3", "cuda:0", 2, 2**30, 1, 4, 1))
    assert observer.lines[-1].endswith("re-planned: 1 shard, microbatch 1-4")


@pytest.mark.parametrize("fits", [False, True], ids=["spilled", "fits"])
def test_a_fused_array_is_re_planned_with_its_members(fits: bool) -> None:
    # A spilled array gets smaller stacked shards; an array whose estimate fits its device
    # (while "another process" holds most of it) spills as stacked shards.
    specs = [member(10), member(11)]
    budget = 4 * 2**20 if fits else 2 * 2**20
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    members = [OtherProcess(device, budget - 2**20 if fits else budget // 2), Recorder()]
    with ShardExecutor([device], spill="auto" if fits else "always") as executor:
        planned = executor.fused_spec(specs)
        assert executor.will_spill(planned) is not fits
        peak = executor.stacked_plan(planned, 2).peak_bytes
        futures = executor.submit_fused(specs, members, name="array")
        results = [future.result(timeout=HANG_GUARD_S) for future in futures]
    [event] = members[0].replans  # each member hears it; the first releases the memory
    assert event.job == "array" and event.attempt == 1
    assert event.budget_bytes < (budget if fits else peak)
    fresh_plan = plan_stacked(planned, 2, executor.planning_device,
                              budget_bytes=event.budget_bytes)
    assert len(fresh_plan.shards) == event.num_shards
    alone = VirtualDevice("cpu:alone", budget_bytes=budget)
    fresh = train_fused_spilled(specs, alone, fresh_plan)
    for spec, result, expected, receiver in zip(specs, results, fresh, members, strict=True):
        assert expected is not None and result.num_replans == 1
        assert result.swap_bytes > 0  # it spilled
        assert_weights(result.state_dict, expected.state_dict)  # a fresh spilled array's
        assert_equals_plain(result, spec, "sgd")
        assert len(receiver.starts) == 1 and sum(e.step == 0 for e in receiver.evals) == 1
    members[0].held = None
    assert device.meter.live_bytes == 0


def test_a_prefetch_the_device_has_no_memory_for_is_dropped() -> None:
    # Planned peaks are estimates: a shard promoted ahead of its task may not fit after all.
    # The prefetch is dropped (nothing of it stays allocated) and the task promotes its shard.
    spec = tiny_spec("adamw", name="short", max_steps=2)
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_job(spec, device)
    job = SpilledJob(spec, plan)
    other = torch.empty(BUDGET - plan.shards[0].param_bytes // 2, dtype=torch.uint8)
    device.meter.track(other)
    held = device.meter.live_bytes
    job.prefetch(job.next_task(), device, headroom_bytes=BUDGET)
    assert job.store.num_prefetch_refusals == 1 and job.store.num_prefetches == 0
    assert device.meter.live_bytes == held
    del other
    assert device.meter.live_bytes == 0
    while (task := job.next_task()) is not None:
        job.run(task, device)
    expected = train_spilled(spec, VirtualDevice("cpu:1", budget_bytes=BUDGET), plan)
    assert_weights(job.result().state_dict, expected.state_dict)


def test_an_early_fetch_of_activations_the_device_has_no_memory_for_is_dropped() -> None:
    # A memory plan may fetch a backward task's first activations during the task before it.
    # When the device has no room for them after all, that fetch is dropped like a shard
    # prefetch (nothing of it stays allocated) and the backward task fetches them itself.
    spec = tiny_spec("adamw", max_steps=2)
    budget = 2 * BUDGET  # room beside the last shard's backward for an early fetch
    device = VirtualDevice("cpu:0", budget_bytes=budget)
    plan = plan_job(spec, device)
    last = len(plan.shards) - 1
    greedy = plan_memory(spec, plan, device=device)
    decisions = [[LayerDecision(False, (shard.index != last,) * len(d.swap))
                  for d in shard.decisions] for shard in greedy.shards]
    memory = plan_memory(spec, plan, device=device, decisions=decisions)
    assert memory.shards[last - 1].early_fetch_bytes > 0
    job = SpilledJob(spec, plan, memory_plan=memory)
    while (task := job.next_task()) is not None and task.kind != "backward":
        job.run(task, device)
    assert task is not None and task.shard == last
    ahead = job.peek_task()
    assert ahead is not None and (ahead.kind, ahead.shard) == ("backward", last - 1)
    other = torch.empty(budget - device.meter.live_bytes - 1024, dtype=torch.uint8)
    device.meter.track(other)
    held = device.meter.live_bytes
    # the activations' early fetch is refused; the shard's prefetch too, where the plan's
    # peaks (from measured seconds) let it be tried at all
    job.prefetch(ahead, device)
    assert job.store.num_prefetch_refusals >= 1 and job.store.num_prefetches == 0
    assert device.meter.live_bytes == held
    del other
    while (task := job.next_task()) is not None:
        job.run(task, device)
    expected = train_spilled(spec, VirtualDevice("cpu:1", budget_bytes=budget), plan,
                             memory_plan=memory)
    assert_weights(job.result().state_dict, expected.state_dict)
    job.store.release()
    assert device.meter.live_bytes == 0


def test_a_memory_planned_pass_that_runs_out_of_memory_leaves_nothing_on_the_device() -> None:
    # A plan that swaps every activation of the first shards and keeps the last shard's (as
    # autograd would); another process holds a fifth of the device, so the last shard's
    # training task runs out of memory part way. Autograd's saved outputs must not hold their
    # own graph in a reference cycle, or that pass's activations would stay allocated after the
    # job is released.
    spec = tiny_spec("adamw", max_steps=2)
    device = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    plan = plan_job(spec, device)
    last = len(plan.shards) - 1
    greedy = plan_memory(spec, plan, device=device)  # for the activations of each layer
    decisions = [[LayerDecision(False, (shard.index != last,) * len(d.swap))
                  for d in shard.decisions] for shard in greedy.shards]
    memory = plan_memory(spec, plan, device=device, decisions=decisions)
    assert memory.shards[last].codes == "K" * len(decisions[last])
    job = SpilledJob(spec, plan, memory_plan=memory)
    other = torch.empty(BUDGET // 5, dtype=torch.uint8)
    device.meter.track(other)
    with pytest.raises(torch.OutOfMemoryError) as failed:
        while (task := job.next_task()) is not None:
            job.run(task, device)
    assert (task.shard, task.phase) == (last, "train")
    traceback.clear_frames(failed.value.__traceback__)
    del failed
    job.store.release()
    del other
    assert device.meter.live_bytes == 0
