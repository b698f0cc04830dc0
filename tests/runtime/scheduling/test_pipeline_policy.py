"""Pipelined mode (Harmony PP): Sharded-LRTF's decision, the simulated step, bytes, plan output.

Driven with synthetic durations only; every expected time and byte count is computed by hand in
the comments.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.runtime.planning.pipeline_plan import pipeline_packs
from sweepmaster.runtime.scheduling.chains import JobSpec
from sweepmaster.runtime.scheduling.pipeline import PipelineShape, choose_packs, pipeline_step
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.scheduling.sim_model import Arrival, CostModel, Removal
from sweepmaster.runtime.scheduling.simulate import simulate
from tests.kit.sweeps import EXAMPLES

FREE = CostModel(bandwidth_bytes_per_s=math.inf)


def shape(num_shards: int, packs, *, forward_s=1.0, backward_s=2.0, microbatches=2,
          state=12, boundary=4, inputs=8) -> PipelineShape:
    return PipelineShape(forward_s=(forward_s,) * num_shards,
                         backward_s=(backward_s,) * num_shards,
                         state_bytes=(state,) * num_shards,
                         boundary_bytes=(boundary,) * (num_shards - 1) + (0,),
                         input_bytes=inputs, num_microbatches=microbatches, packs=tuple(packs))


def job(job_id: str, num_shards: int, num_steps: int, packs=None, **kw) -> JobSpec:
    """A Hydra chain of ``num_shards`` shards (forward 1 s, backward 2 s), pipelinable."""
    spec = JobSpec.from_shards(job_id, num_steps, [kw.get("forward_s", 1.0)] * num_shards,
                               [kw.get("backward_s", 2.0)] * num_shards, [4] * num_shards,
                               [kw.get("state", 12)] * num_shards)
    if packs is None:
        return spec
    return JobSpec(job_id, spec.step_tasks, num_steps, pipeline=shape(num_shards, packs, **kw))


def test_packs_are_balanced_in_time_and_fit_the_budget():
    # 5 shards of 3, 1, 1, 1, 2 s: over 2 devices the best split is 4 s | 4 s; over 3, 3 | 3 | 2
    assert pipeline_packs([3, 1, 1, 1, 2], [1] * 5, 10, 4, label_bytes=0) == [
        (0, 2, 5), (0, 1, 4, 5)]
    # each shard alone fills most of the budget: packs of one shard, so 4 devices or none
    assert pipeline_packs([1, 1, 1, 1], [6] * 4, 10, 3, label_bytes=0) == []
    assert pipeline_packs([1, 1, 1, 1], [6] * 4, 10, 8, label_bytes=0) == [(0, 1, 2, 3, 4)]
    assert pipeline_packs([1, 1, 1, 1], [6] * 4, 10, 8, label_bytes=4) == [(0, 1, 2, 3, 4)]
    assert pipeline_packs([1, 1, 1, 1], [6] * 4, 10, 8, label_bytes=5) == []  # 6 + 5 > 10


def test_the_last_packs_device_holds_the_labels_beside_it():
    # 4 shards of 4 bytes, budget 10: two packs of 8 bytes fit, unless the last pack's device
    # holds 3 bytes of token ids beside it (8 + 3 > 10): then the last pack is one shard
    assert pipeline_packs([1, 1, 1, 1], [4] * 4, 10, 3, label_bytes=2) == [(0, 2, 4)]
    assert pipeline_packs([1, 1, 1, 1], [4] * 4, 10, 3, label_bytes=3) == [(0, 2, 3, 4)]
    assert pipeline_packs([1, 1, 1, 1], [4] * 4, 10, 2, label_bytes=3) == []


def test_a_lone_job_pipelines_over_the_free_devices_and_keeps_its_packs():
    policy = ShardedLRTF(4, pipeline=True)
    policy.add_job(job("a", 4, 3, packs=[(0, 2, 4), (0, 1, 2, 3, 4)]))
    first = policy.next_pipeline()
    assert first is not None
    assert (first.job_id, first.first_index, first.num_tasks) == ("a", 0, 7)
    assert first.devices == (0, 1, 2, 3) and first.packs == ((0,), (1,), (2,), (3,))
    assert first.load
    assert policy.next_pipeline() is None
    # sequential seconds, its running step included: 3 steps x (1 + 1 + 1 + 3 + 2 + 2 + 2)
    assert policy.remaining_s("a") == pytest.approx(3 * 12.0)
    for device in range(4):
        assert policy.pipelined(device) is first
        with pytest.raises(ValueError, match="still running"):
            policy.next_task(device)
    assert not policy.pipeline_done(first)
    second = policy.next_pipeline()
    assert second is not None and second.first_index == 7
    assert second.devices == first.devices and not second.load  # the packs stayed there
    assert not policy.pipeline_done(second)
    third = policy.next_pipeline()
    assert third is not None and policy.pipeline_done(third)  # the job's last step
    assert policy.job_ids() == []


def test_pipelining_stops_when_more_jobs_arrive():
    policy = ShardedLRTF(4, pipeline=True)
    policy.add_job(job("a", 4, 3, packs=[(0, 2, 4), (0, 1, 2, 3, 4)]))
    decision = policy.next_pipeline()
    assert decision is not None and decision.devices == (0, 1, 2, 3)
    for other in "bcd":
        policy.add_job(job(other, 2, 1))
    policy.pipeline_done(decision)
    assert policy.next_pipeline() is None  # 4 ready jobs, 4 free devices: one task each
    tasks = [policy.next_task(d) for d in range(4)]
    assert sorted(t.job_id for t in tasks if t is not None) == ["a", "b", "c", "d"]
    a = next(t for t in tasks if t is not None and t.job_id == "a")
    assert a.index == 7  # a's next step, now as shard tasks


def test_each_other_ready_job_keeps_a_device():
    policy = ShardedLRTF(4, pipeline=True)
    policy.add_job(job("long", 4, 5, packs=[(0, 2, 4), (0, 1, 2, 3, 4)]))
    policy.add_job(job("short", 2, 1))  # no pipeline shape: never pipelines
    decision = policy.next_pipeline()
    assert decision is not None  # 2 ready jobs share 4 free devices: the longest takes 2
    assert decision.job_id == "long" and decision.cuts == (0, 2, 4)
    assert decision.devices == (0, 1)
    assert decision.est_seconds == pytest.approx(
        pipeline_step(shape(4, [(0, 2, 4)]), (0, 2, 4)).seconds)
    assert policy.next_pipeline() is None
    task = policy.next_task(2)
    assert task is not None and task.job_id == "short"


def test_free_devices_are_shared_among_ready_jobs_longest_first():
    policy = ShardedLRTF(8, pipeline=True)
    layouts = [(0, 2, 4), (0, 1, 3, 4), (0, 1, 2, 3, 4)]
    for job_id, num_steps in (("a", 5), ("b", 4), ("c", 3)):
        policy.add_job(job(job_id, 4, num_steps, packs=layouts))
    decisions = []
    while (decision := policy.next_pipeline()) is not None:
        decisions.append(decision)
    # 3 jobs on 8 devices: a takes ceil(8 / 3) = 3, b ceil(5 / 2) = 3, c the last 2
    assert [(d.job_id, d.devices, d.cuts) for d in decisions] == [
        ("a", (0, 1, 2), (0, 1, 3, 4)), ("b", (3, 4, 5), (0, 1, 3, 4)), ("c", (6, 7), (0, 2, 4))]


def test_no_pipeline_without_the_option_a_shape_or_a_step_boundary():
    plain = ShardedLRTF(4)
    plain.add_job(job("a", 4, 2, packs=[(0, 1, 2, 3, 4)]))
    assert plain.next_pipeline() is None
    policy = ShardedLRTF(4, pipeline=True)
    policy.add_job(job("a", 4, 2, packs=[(0, 1, 2, 3, 4)]))
    task = policy.next_task(0)  # a is mid-step until its 7 tasks of step 0 ran
    assert task is not None
    policy.task_done(task)
    assert policy.next_pipeline() is None
    with pytest.raises(ValueError, match="pipeline shape"):
        JobSpec("x", job("x", 3, 1).step_tasks, 1, pipeline=shape(2, [(0, 1, 2)]))


def test_simulated_pipelined_makespan_equals_the_hand_computed_one():
    # per step, M = 2 microbatches over 2 packs, compute only:
    #   forward: stages 1, 1 -> (2 + 1 * 1) / 2 = 1.5; backward: 2, 2 -> (4 + 1 * 2) / 2 = 3
    spec = job("a", 2, 2, packs=[(0, 1, 2)])
    result = simulate(ShardedLRTF(2, pipeline=True), [spec], FREE)
    assert result.makespan_s == pytest.approx(2 * 4.5)
    assert result.num_pipelined_steps == 2
    # unpipelined, the chain runs 1 + (1 + 2) + 2 = 6 s per step on one device
    assert simulate(ShardedLRTF(2), [spec], FREE).makespan_s == pytest.approx(12.0)


@pytest.mark.parametrize(("p2p", "makespan_s", "up", "down", "p2p_bytes"), [
    # links 4 B/s, p2p 8 B/s. Load: 12 B per device at 4 B/s = 3 s, in parallel.
    # A step: forward stages input 8/4 = 2, F0 1, crossing 4/8 = 0.5, F1 1 -> (4.5 + 2) / 2;
    # backward 2, 0.5, 2 -> (4.5 + 2) / 2: 6.5 s. Write-back 12 B per device: 3 s.
    # 3 + 6.5 + 6.5 + 3 = 19. Host up: 24 loaded + 2 x 8 inputs to each device (the first
    # pack's input, the last pack's labels: their copy is no stage); down: 24 written back;
    # p2p: 2 steps x (4 forward + 4 gradient).
    (8.0, 19.0, 56, 24, 16),
    # no p2p: each crossing is 4/4 = 1 s down then 1 s up; forward 2, 1, 1, 1, 1 -> (6 + 2) / 2
    # = 4, backward 2, 1, 1, 2 -> 4: 8 s a step; 3 + 8 + 8 + 3 = 22. Every crossing moves its
    # 4 B down and up, both ways: up 24 + 2 x (8 + 8 + 8), down 24 + 2 x 8.
    (None, 22.0, 72, 40, 0),
])
def test_pipelined_bytes_split_host_and_p2p(p2p, makespan_s, up, down, p2p_bytes):
    spec = job("a", 2, 2, packs=[(0, 1, 2)])
    cost = CostModel(bandwidth_bytes_per_s=4.0, p2p_bytes_per_s=p2p)
    result = simulate(ShardedLRTF(2, pipeline=True), [spec], cost)
    assert result.makespan_s == pytest.approx(makespan_s)
    assert (result.promote_bytes, result.demote_bytes, result.p2p_bytes) == (up, down, p2p_bytes)
    assert result.swap_bytes == up + down
    assert result.completion_s == {"a": pytest.approx(makespan_s)}


def test_a_job_too_big_for_a_pack_per_device_wraps_around():
    # 3 shards that fit no 2 devices one pack each: 3 packs on 2 devices, pack p on p % 2
    wrapped = dataclasses.replace(shape(3, []), wrap=((2, (0, 1, 2, 3)),), owned_bytes=(6, 6, 6),
                                  kept_bytes=(8, 4, 4))
    spec = JobSpec("a", job("a", 3, 2).step_tasks, 2, pipeline=wrapped)
    policy = ShardedLRTF(2, pipeline=True)
    policy.add_job(spec)
    decision = policy.next_pipeline()
    assert decision is not None and decision.cuts == (0, 1, 2, 3) and decision.load
    assert decision.devices == (0, 1) and decision.packs == ((0,), (1,))  # held between steps
    assert decision.lane_shards == ((0, 2), (1,))
    # per step, compute only: round 1 (packs 0, 1): forward (1 + 1 + 1) / 2 = 1.5, backward
    # (2 + 2 + 2) / 2 = 3; round 2 (pack 2): forward (1 + 1) / 2 = 1, backward (2 + 2) / 2 = 2
    step = pipeline_step(wrapped, (0, 1, 2, 3), num_devices=2)
    assert step.seconds == pytest.approx(7.5) == decision.est_seconds
    # device 0 swaps: pack 2 in for its forward (12), pack 0 back in with its parked input
    # (12 + 8) beside the token ids (8, to pack 0 and again to pack 2, the last: its labels);
    # out: both packs' updated weights (6 + 6), the input
    assert step.device_host_bytes == ((48, 20), (0, 0))
    assert step.p2p_bytes == 2 * (4 + 4)
    cost = CostModel(bandwidth_bytes_per_s=math.inf, p2p_bytes_per_s=math.inf)
    result = simulate(ShardedLRTF(2, pipeline=True), [spec], cost)
    assert result.makespan_s == pytest.approx(2 * 7.5) and result.num_pipelined_steps == 2
    # load 12 + 12; 2 steps; the first packs written back at the end (12 + 12)
    assert (result.promote_bytes, result.demote_bytes, result.p2p_bytes) == (
        24 + 2 * 48, 2 * 20 + 24, 2 * 16)


def test_a_job_spared_fewer_devices_than_its_fewest_packs_wraps_around_them():
    # 3 packs fit one per device, on 3 devices or more; on 2, the layout planned for 2 wraps
    wrapped = dataclasses.replace(shape(3, [(0, 1, 2, 3)]), wrap=((2, (0, 1, 2, 3)),))
    assert [choose_packs(wrapped, d) for d in (1, 2, 3, 4)] == [
        None, (0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)]
    policy = ShardedLRTF(4, pipeline=True)
    policy.add_job(JobSpec("a", job("a", 3, 2).step_tasks, 2, pipeline=wrapped))
    policy.add_job(job("b", 2, 1))  # no pipeline shape
    decision = policy.next_pipeline()  # 2 ready jobs share 4 free devices: a takes 2
    assert decision is not None and decision.job_id == "a" and decision.devices == (0, 1)
    assert decision.cuts == (0, 1, 2, 3) and decision.lane_shards == ((0, 2), (1,))
    # as test_a_job_too_big_for_a_pack_per_device_wraps_around: 1.5 + 3 + 1 + 2
    assert decision.est_seconds == pytest.approx(7.5)
    assert policy.next_pipeline() is None
    task = policy.next_task(2)
    assert task is not None and task.job_id == "b"


@pytest.mark.parametrize("wrap", [((3, (0, 1, 2, 3)),), ((1, (0, 1, 2, 3)),),
                                  ((2, (0, 1, 2, 3)), (2, (0, 1, 2, 3)))])
def test_a_wrap_around_layout_has_more_packs_than_its_devices(wrap):
    with pytest.raises(ValueError, match="wrap-around layout"):
        dataclasses.replace(shape(3, []), wrap=wrap)


@pytest.mark.parametrize(
        ("num_shards", "cuts", "num_devices", "p2p", "tied", "host", "p2p_bytes"), [
    # shard 1 (pack 1, device 1) owns it; pack 2 leaves device 0 before its update: device 0
    # writes the contribution, device 1 reads it
    (4, (0, 1, 2, 3, 4), 2, True, (1, (2,), 5), ((0, 5), (5, 0)), 0),
    # device 1 holds pack 1 only, which never leaves: it also writes the new value to the host,
    # for pack 2 to read when it comes back in
    (3, (0, 1, 2, 3), 2, True, (1, (2,), 5), ((0, 5), (5, 5)), 0),
    # one pack per device: the contribution and the value cross p2p, or without p2p through the
    # host, between the devices of packs 1 and 2 only
    (3, (0, 1, 2, 3), 3, True, (1, (2,), 5), ((0, 0), (0, 0), (0, 0)), 10),
    (3, (0, 1, 2, 3), 3, False, (1, (2,), 5), ((0, 0), (5, 5), (5, 5)), 0),
    # owner and borrower in one pack: nothing crosses
    (3, (0, 2, 3), 2, True, (0, (1,), 5), ((0, 0), (0, 0)), 0),
])
def test_a_tied_contribution_moves_between_the_devices_of_its_packs(
        num_shards, cuts, num_devices, p2p, tied, host, p2p_bytes):
    untied = dataclasses.replace(shape(num_shards, []), wrap=((num_devices, cuts),)
                                 if num_devices < len(cuts) - 1 else (), packs=(cuts,),
                                 owned_bytes=(6,) * num_shards)
    before = pipeline_step(untied, cuts, num_devices=num_devices, p2p=p2p)
    after = pipeline_step(dataclasses.replace(untied, tied=(tied,)), cuts,
                          num_devices=num_devices, p2p=p2p)
    assert tuple((u - a, d - b) for (u, d), (a, b) in zip(
        after.device_host_bytes, before.device_host_bytes, strict=True)) == host
    assert after.p2p_bytes - before.p2p_bytes == p2p_bytes


def test_a_tied_parameter_needs_an_earlier_owner():
    with pytest.raises(ValueError, match="not increasing shards"):
        dataclasses.replace(shape(3, [(0, 1, 3)]), tied=((2, (1,), 5),))


def test_the_simulator_returns_to_one_task_per_device_when_a_job_arrives():
    lone = job("a", 2, 3, packs=[(0, 1, 2)])
    late = job("b", 2, 1)
    result = simulate(ShardedLRTF(2, pipeline=True), [lone, Arrival(1.0, late)], FREE)
    # a's first step runs pipelined alone (0 .. 4.5 s); then a and b run one task per device,
    # a's second step and b's only one side by side, 1 + 3 + 2 = 6 s (4.5 .. 10.5 s); then a is
    # alone again and pipelines its last step (10.5 .. 15 s)
    assert [d.first_index for d in result.pipelined_steps["a"]] == [0, 6]
    assert "b" not in result.pipelined_steps
    bars = [g for g in result.gantt if g.kind != "pipeline"]
    assert min(g.start_s for g in bars) == pytest.approx(4.5)
    assert sorted((g.job_id, g.task_index) for g in bars) == [
        ("a", 3), ("a", 4), ("a", 5), ("b", 0), ("b", 1), ("b", 2)]
    assert result.completion_s["b"] == pytest.approx(10.5)
    assert result.makespan_s == pytest.approx(15.0)


def test_a_job_removed_during_a_pipelined_step_stops_after_it():
    spec = job("a", 2, 3, packs=[(0, 1, 2)])
    result = simulate(ShardedLRTF(2, pipeline=True), [spec], CostModel(4.0, p2p_bytes_per_s=8.0),
                      removals=[Removal(1.0, "a")])
    # its load (3 s) and first step (6.5 s) run; nothing is written back for a removed job
    assert result.makespan_s == pytest.approx(9.5)
    assert result.num_pipelined_steps == 1 and result.completion_s == {}
    assert (result.promote_bytes, result.demote_bytes, result.p2p_bytes) == (24 + 2 * 8, 0, 8)


def test_plan_shows_packs_per_device_and_bytes_of_each_kind(tmp_path: Path) -> None:
    def plan(*settings: str, devices: str = "cpu:3x256MiB") -> str:
        result = CliRunner().invoke(
            app, ["plan", str(EXAMPLES / "spill-cpu.yaml"), "--devices", devices,
                  *(arg for setting in settings for arg in ("--set", setting)),
                  "--storage", f"sqlite:///{tmp_path / 'x.db'}"], env={"COLUMNS": "220"})
        assert result.exit_code == 0, result.output
        return result.stdout

    out = plan("train.checkpoint_every=off")
    assert out.count("pipelines when runnable jobs are fewer than free devices") == 2
    for header in ("packs per device", "p2p/step", "host/step", "load"):
        assert header in out
    assert "cpu:0: shard 0, cpu:1: shard 1" in out
    assert "never pipelines" not in out and "pipelining is off" not in out
    # spill-cpu.yaml evaluates and checkpoints every 2 steps: it pipelines all the same
    out = plan()
    assert out.count("packs per device") == 2 and "never pipelines" not in out
    out = plan("train.checkpoint_every=off", "resources.pipeline=off")
    assert out.count("pipelining is off (resources.pipeline: off)") == 2
    assert out.count("packs per device") == 2
    # no two of its 3 shards fit one device of 240 MiB: its packs wrap around the two devices
    out = plan("train.checkpoint_every=off", devices="cpu:2x240MiB")
    assert out.count("cpu:0: shard 0, cpu:1: shard 1, cpu:0: shard 2") == 2
    assert "never pipelines" not in out

    from sweepmaster.sweep.plan import plan_sweep

    config = load_sweep_config(EXAMPLES / "spill-cpu.yaml")
    sweep_plan = plan_sweep(config, devices="cpu:3x256MiB",
                            storage=f"sqlite:///{tmp_path / 'x.db'}")
    for planned in sweep_plan.jobs:
        assert planned.pipeline is not None and planned.plan is not None
        first, second = planned.plan.shards  # two shards, one per device
        (layout,) = planned.pipeline.layouts
        assert layout.devices == ("cpu:0", "cpu:1") and layout.packs == ((0,), (1,))
        assert layout.runnable == (1, 2)  # 3 devices: alone, or beside one other job
        assert layout.host_bytes_per_step == 2 * first.input_bytes  # token ids, labels
        # the boundary activation and its gradient; the tied head's gradient and new weights
        assert layout.p2p_bytes_per_step == 2 * first.output_bytes + 2 * second.borrowed_bytes
        assert layout.host_bytes_per_step_without_p2p == (
            2 * first.input_bytes + 2 * layout.p2p_bytes_per_step)
        assert layout.load_bytes == sum(s.param_bytes + s.optimizer_bytes
                                        for s in planned.plan.shards)


def test_plan_shows_the_wrap_around_layout_of_fewer_devices_than_packs(tmp_path: Path) -> None:
    from sweepmaster.sweep.plan import plan_sweep

    # no two of its 3 shards fit one device of 240 MiB: alone it takes all 3 devices, one pack
    # each; beside another runnable job it may take 2, and wraps its 3 packs around them
    config = load_sweep_config(EXAMPLES / "spill-cpu.yaml")
    sweep_plan = plan_sweep(config, devices="cpu:3x240MiB",
                            storage=f"sqlite:///{tmp_path / 'x.db'}")
    for planned in sweep_plan.jobs:
        assert planned.pipeline is not None
        assert [(layout.devices, layout.packs, layout.runnable)
                for layout in planned.pipeline.layouts] == [
            (("cpu:0", "cpu:1", "cpu:0"), ((0,), (1,), (2,)), (2, 2)),
            (("cpu:0", "cpu:1", "cpu:2"), ((0,), (1,), (2,)), (1, 1))]


def wrapped_job(job_id: str, num_steps: int, forward_s: float, backward_s: float) -> JobSpec:
    """3 shards with no layout one pack per device: only 3 packs wrapped around 2 devices."""
    wrapped = dataclasses.replace(shape(3, [], forward_s=forward_s, backward_s=backward_s),
                                  wrap=((2, (0, 1, 2, 3)),))
    spec = job(job_id, 3, num_steps, forward_s=forward_s, backward_s=backward_s)
    return JobSpec(job_id, spec.step_tasks, num_steps, pipeline=wrapped)


# Links 4 B/s, p2p 8 B/s. A wrap-around step of 3 packs on 2 devices (M = 2, forward f and
# backward b a shard): round 1 (packs 0, 1) forward stages input 8/4 = 2, f, crossing 4/8 = 0.5,
# f, crossing 0.5; backward b, 0.5, b; round 2 (pack 2) forward f; backward b, 0.5. Device 0
# swaps pack 2's 12 B in for its forward and pack 0's 12 B back in for its backward: 24 / 4 =
# 6 s after the flow. As shard tasks on one device: f + f + (f + b) + b + b = 3 f + 3 b.
LINKS = {"host_bytes_per_s": 4.0, "p2p_bytes_per_s": 8.0}


def test_a_job_whose_wrap_around_step_is_slower_runs_shard_tasks():
    # f = 1, b = 2: (7 + 2) / 2 + (4.5 + 2) / 2 + (1 + 1) / 2 + (2.5 + 2) / 2 + 6 = 16 s
    # pipelined against 9 s as shard tasks
    light = wrapped_job("a", 2, 1.0, 2.0)
    assert pipeline_step(light.pipeline, (0, 1, 2, 3), num_devices=2, **LINKS).seconds == (
        pytest.approx(16.0))
    assert choose_packs(light.pipeline, 2, step_s=9.0, **LINKS) is None
    assert choose_packs(light.pipeline, 2, **LINKS) == (0, 1, 2, 3)  # no gate: it fits
    policy = ShardedLRTF(2, pipeline=True, **LINKS)
    policy.add_job(light)
    assert policy.next_pipeline() is None
    task = policy.next_task(0)
    assert task is not None and (task.job_id, task.index) == ("a", 0)
    # simulated at the same links: every step runs as shard tasks, as without pipelining
    cost = CostModel(bandwidth_bytes_per_s=4.0, p2p_bytes_per_s=8.0)
    gated = simulate(ShardedLRTF(2, pipeline=True, **LINKS), [light], cost)
    plain = simulate(ShardedLRTF(2), [light], cost)
    assert gated.num_pipelined_steps == 0
    assert (gated.makespan_s, gated.swap_bytes) == (plain.makespan_s, plain.swap_bytes)


def test_a_job_whose_wrap_around_step_is_faster_pipelines_beside_one_that_is_not():
    # f = 8, b = 16: (35 + 16) / 2 + (32.5 + 16) / 2 + (8 + 8) / 2 + (16.5 + 16) / 2 + 6 = 68 s
    # pipelined against 72 s as shard tasks; the light job's 16 s against 9 s (above)
    light, heavy = wrapped_job("light", 10, 1.0, 2.0), wrapped_job("heavy", 1, 8.0, 16.0)
    assert pipeline_step(heavy.pipeline, (0, 1, 2, 3), num_devices=2, **LINKS).seconds == (
        pytest.approx(68.0))
    policy = ShardedLRTF(4, pipeline=True, **LINKS)
    policy.add_job(light)  # 90 s remaining: the longest, but pipelined it would be slower
    policy.add_job(heavy)  # 72 s
    decision = policy.next_pipeline()  # 2 ready jobs share 4 free devices: 2 each
    assert decision is not None and decision.job_id == "heavy"
    assert decision.devices == (0, 1) and decision.cuts == (0, 1, 2, 3)
    # its estimate stays compute only (copies instant): round 1 (16 + 8) / 2 + (32 + 16) / 2,
    # round 2 (8 + 8) / 2 + (16 + 16) / 2: 60 s
    assert decision.est_seconds == pytest.approx(60.0)
    assert policy.next_pipeline() is None
    task = policy.next_task(2)
    assert task is not None and task.job_id == "light"


def test_of_two_layouts_that_fit_the_share_the_faster_one_is_taken():
    # 4 shards (forward 4 s, backward 8 s), M = 2, host links instant, p2p 1 B/s: a crossing of
    # 4 B takes 4 s. Packs (0, 2, 4): forward 8, 4, 8 -> (20 + 8) / 2 = 14; backward 16, 4, 16
    # -> (36 + 16) / 2 = 26: 40 s. Packs (0, 1, 2, 3, 4): forward 4 x 4 s and 3 crossings ->
    # (28 + 4) / 2 = 16; backward 4 x 8 s and 3 crossings -> (44 + 8) / 2 = 26: 42 s. As shard
    # tasks: 4 x 4 + 4 x 8 = 48 s. Both beat the shard tasks; 2 packs beat 4.
    spec = job("a", 4, 2, packs=[(0, 2, 4), (0, 1, 2, 3, 4)], forward_s=4.0, backward_s=8.0)
    assert spec.pipeline is not None
    slow_p2p = {"p2p_bytes_per_s": 1.0}
    assert [pipeline_step(spec.pipeline, cuts, **slow_p2p).seconds
            for cuts in spec.pipeline.packs] == [pytest.approx(40.0), pytest.approx(42.0)]
    assert choose_packs(spec.pipeline, 4, step_s=48.0, **slow_p2p) == (0, 2, 4)
    assert choose_packs(spec.pipeline, 4) == (0, 1, 2, 3, 4)  # instant copies: 36 s each, tie
    policy = ShardedLRTF(4, pipeline=True, **slow_p2p)
    policy.add_job(spec)
    decision = policy.next_pipeline()
    assert decision is not None and decision.cuts == (0, 2, 4) and decision.devices == (0, 1)


def test_the_gate_scales_compute_by_the_measured_ratio_not_the_copies():
    # the light job of test_a_job_whose_wrap_around_step_is_slower_runs_shard_tasks: 16 s
    # pipelined (10 s of flow with its copies, 6 s of swaps) against 9 s as shard tasks. Its
    # tasks measured 8 times their estimates: compute 8 f = 8, 8 b = 16 with the same copies,
    # as the heavy job of the test above: 68 s pipelined against 8 x 9 = 72 s
    light = wrapped_job("a", 2, 1.0, 2.0)
    assert light.pipeline is not None
    assert choose_packs(light.pipeline, 2, step_s=9.0, speed=8.0, **LINKS) == (0, 1, 2, 3)
    policy = ShardedLRTF(2, pipeline=True, **LINKS)
    policy.add_job(light)
    assert policy.next_pipeline() is None  # not measured yet: 16 s against 9 s
    for _ in range(5):  # its first step as shard tasks, each 8 times its estimate
        task = policy.next_task(0)
        assert task is not None and task.job_id == "a"
        policy.task_done(task, 8 * task.est_seconds)
    assert policy.remaining_s("a") == pytest.approx(8 * 9.0)
    decision = policy.next_pipeline()
    assert decision is not None and (decision.first_index, decision.cuts) == (5, (0, 1, 2, 3))
