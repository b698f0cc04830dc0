"""Fused arrays in the executor: one job, a future per member, the fusion degree and its cache."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from sweepmaster.runtime import JobCancelledError, ShardExecutor, TrainCallbacks, train_plain
from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.execution.fused_jobs import check_fused_fits
from sweepmaster.runtime.execution.policy_chain import shard_chain
from sweepmaster.runtime.planning import fusion_degree
from sweepmaster.runtime.planning.fusion_degree import (
    FusionMeasurement,
    check_fusion_mode,
    fused_bytes_estimate,
    fusion_cache_key,
    with_step_seconds,
)
from sweepmaster.runtime.planning.partition import plan_job
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.scheduling.residency import PEAK_MARGIN
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.workload import OptimizerSpec
from tests.kit.caches import DictCache, KeyedCacheSuite
from tests.kit.fused import CPU, MARKS, TIGHT, assert_close_states, spec
from tests.kit.records import (
    Timeline,
    assert_one_task_at_a_time,
    hand_out_order,
    num_runs,
    recorded_durations,
    replay,
)
from tests.kit.spill import MiB

pytestmark = MARKS



def without_step_seconds(measurements: list[FusionMeasurement]) -> list[FusionMeasurement]:
    """What the store keeps of measurements: all but ``step_seconds``."""
    return [dataclasses.replace(m, step_seconds=0.0) for m in measurements]


class TestDictCache(KeyedCacheSuite):
    """The dict double these tests hand the executor keeps the contract of the store's caches."""

    @pytest.fixture
    def cache(self) -> DictCache:
        return DictCache(stored=without_step_seconds)

    @pytest.fixture
    def values(self) -> tuple[list[FusionMeasurement], list[FusionMeasurement]]:
        return ([FusionMeasurement(1, 1000.0, 90_000, True, 0.0)],
                [FusionMeasurement(1, 900.0, 80_000, True, 0.0),
                 FusionMeasurement(2, 0.0, 0, False, 0.0)])


class WatchOther(TrainCallbacks):
    """Member callbacks that look at another member's future while this one trains."""

    def __init__(self) -> None:
        self.futures: list = []
        self.ready = threading.Event()
        self.seen: dict[int, tuple[bool, bool]] = {}

    def on_start(self, event):
        assert self.ready.wait(30)

    def on_step(self, event):
        self.seen[event.step] = (self.futures[0].done(), self.futures[1].done())


def test_members_resolve_independently_and_equal_plain_training() -> None:
    specs = [spec(1, max_steps=2, eval_every=None), spec(2, max_steps=6)]
    watcher = WatchOther()
    timeline = Timeline()
    with ShardExecutor("cpu:1x32MiB", on_task=timeline) as executor:
        futures = executor.submit_fused(specs, [None, watcher])
        watcher.futures = futures
        watcher.ready.set()
        results = [future.result() for future in futures]
    # member 0 left after its 2 steps: its future was resolved while member 1 still trained
    assert watcher.seen[2] == (False, False) and watcher.seen[3] == (True, False)
    for member, result in zip(specs, results, strict=True):
        expected = train_plain(member, CPU)
        assert result.steps == member.total_steps and not result.pruned
        assert result.objective == pytest.approx(expected.objective, rel=1e-6)
        assert_close_states(result.state_dict, expected.state_dict, **TIGHT)
        assert 0 < result.peak_device_bytes <= 32 * MiB
    # the array fits: one stacked shard, one task per step of its longest member
    assert {(r.job, r.shard, r.device) for r in timeline.records} == {
        ("trial-1+trial-2", 0, "cpu:0")}
    training = [r for r in timeline.records if r.kind != "eval"]
    assert [(r.kind, r.step) for r in training] == [("backward", s) for s in range(6)]
    assert max(r.peak_bytes for r in timeline.records) == results[1].peak_device_bytes


def test_a_failing_or_raising_member_fails_alone() -> None:
    class Boom(TrainCallbacks):
        def on_step(self, event):
            if event.step == 2:
                raise RuntimeError("callback broke")

    specs = [spec(1), spec(2, OptimizerSpec(name="sgd", lr=1e30)), spec(3)]
    with ShardExecutor("cpu:1x32MiB") as executor:
        futures = executor.submit_fused(specs, [None, None, Boom()], name="array")
        with pytest.raises(FloatingPointError, match="trial-2.*non-finite"):
            futures[1].result()
        with pytest.raises(RuntimeError, match="callback broke"):
            futures[2].result()
        result = futures[0].result()
    assert_close_states(result.state_dict, train_plain(specs[0], CPU).state_dict, **TIGHT)


def test_a_pruned_member_leaves_and_the_others_go_on() -> None:
    class PruneAt2(TrainCallbacks):
        def on_eval(self, event):
            return event.step == 2

    specs = [spec(1), spec(2)]
    with ShardExecutor("cpu:1x32MiB") as executor:
        pruned, complete = (f.result() for f in executor.submit_fused(specs, [PruneAt2(), None]))
    assert pruned.pruned and pruned.steps == 2 and not complete.pruned and complete.steps == 5
    expected = train_plain(specs[0], CPU, PruneAt2())
    assert_close_states(pruned.state_dict, expected.state_dict, **TIGHT)
    assert_close_states(complete.state_dict, train_plain(specs[1], CPU).state_dict, **TIGHT)


def test_a_queued_array_cancelled_fails_every_member() -> None:
    gate, started = threading.Event(), threading.Event()

    class Wait(TrainCallbacks):
        def on_start(self, event):
            started.set()
            assert gate.wait(30)

    with ShardExecutor("cpu:1x32MiB") as executor:
        blocker = executor.submit(spec(9, max_steps=1), Wait())
        assert started.wait(30)  # the blocker holds the device: the array can only queue
        futures = executor.submit_fused([spec(1), spec(2)], name="queued")
        assert executor.cancel("queued")
        gate.set()
        blocker.result()
    for future in futures:
        with pytest.raises(JobCancelledError):
            future.result()


def test_submit_fused_refuses_what_cannot_be_one_array() -> None:
    with ShardExecutor("cpu:1x32MiB") as executor:
        with pytest.raises(ValueError, match="architecture key"):
            executor.submit_fused([spec(1), spec(2, batch_size=2)])
        with pytest.raises(ValueError, match="architecture key"):
            executor.submit_fused([spec(1), spec(2, OptimizerSpec(lr=1e-3))])  # adamw + sgd
        with pytest.raises(ValueError, match="callback"):
            executor.submit_fused([spec(1), spec(2)], [None])
        [single] = executor.submit_fused([spec(1)])  # one member: a plain job
        assert single.result().steps == 5
    plain_bytes = ShardExecutor("cpu:1x32MiB").plan(spec(1)).plain_bytes
    budget = int(1.5 * plain_bytes)
    with ShardExecutor(f"cpu:1x{budget}") as small:
        assert not small.will_spill(spec(1))
        with pytest.raises(ValueError, match=r"fused array of 2 members needs about .* budget"):
            small.submit_fused([spec(1), spec(2)])
        assert small.fusion_choice(spec(1)).k == 1  # "off"
    with ShardExecutor(f"cpu:1x{plain_bytes // 2}") as tiny:
        assert tiny.will_spill(spec(1))  # members that spill fuse as stacked shards, if they fit
        with pytest.raises(ValueError, match="layer 'embed' of 2 fused members needs"):
            tiny.submit_fused([spec(1), spec(2)])


def test_a_fused_array_measured_out_of_memory_is_refused_without_a_size() -> None:
    device = VirtualDevice("cpu:small", budget_bytes=32 * 2**20)
    plan = plan_job(spec(1), device)
    measured = FusionMeasurement(k=2, trials_tokens_per_s=0.0, peak_bytes=0, fits=False,
                                 step_seconds=0.0)  # what an OOM during the measurement leaves
    with pytest.raises(ValueError, match=r"^a fused array of 2 members ran out of the "
                       r"32\.0 MiB budget of cpu:small when measured; fuse fewer"):
        check_fused_fits([spec(1), spec(2)], plan, device, measured)


def test_fixed_fusion_degree_is_capped_by_what_fits() -> None:
    plan = ShardExecutor("cpu:1x32MiB").plan(spec(1))
    budget = fused_bytes_estimate(plan, 3)
    assert fused_bytes_estimate(plan, 4) > budget
    choice = ShardExecutor(f"cpu:1x{budget}", fusion=8).fusion_choice(spec(1))
    assert (choice.k, choice.source) == (3, "capped")
    assert "8 asked" in choice.note and "only 3 fit cpu:0" in choice.note
    assert ShardExecutor("cpu:1x32MiB", fusion=2).fusion_choice(spec(1)).source == "fixed"
    spilled = ShardExecutor(f"cpu:1x{plan.plain_bytes // 2}", fusion=4).fusion_choice(spec(1))
    assert (spilled.k, spilled.source) == (1, "spills")
    with pytest.raises(ValueError, match="fusion: expected auto, off or an integer >= 1"):
        ShardExecutor("cpu", fusion=0)
    assert [check_fusion_mode(v) for v in ("auto", "off", 3)] == ["auto", "off", 3]


def test_auto_measures_once_as_a_job_and_reuses_the_cache(monkeypatch) -> None:
    monkeypatch.setattr(fusion_degree, "FUSION_MEASURE_SHARE", None)  # however short the job
    cache = DictCache(stored=without_step_seconds)
    timeline = Timeline()
    member = spec(1, batch_size=2)
    plan = ShardExecutor("cpu:1x32MiB").plan(member)
    budget = fused_bytes_estimate(plan, 2) + plan.plain_bytes // 4  # room for 2, not for 4
    with ShardExecutor(f"cpu:1x{budget}", fusion="auto", fusion_cache=cache,
                  on_task=timeline) as executor:
        choice = executor.fusion_choice(member)
        again = executor.fusion_choice(dataclasses.replace(member, seed=5))
    assert choice.source == "measured" and again == choice
    assert [(m.k, m.fits) for m in choice.measurements] == [(1, True), (2, True), (4, False)]
    assert choice.k in (1, 2)  # whichever measured faster: the choice follows the measurement
    [measure] = [r for r in timeline.records if r.kind == "measure"]
    assert measure.job.startswith("measure-fusion-") and measure.peak_bytes <= budget
    assert cache.num_puts == 1 and len(cache.entries) == 1
    [(key, stored_budget, kind)] = cache.entries
    assert (key, stored_budget, kind) == (fusion_cache_key(member), budget, "cpu")

    # another executor (a relaunch) reads the cache and measures nothing
    relaunch = Timeline()
    with ShardExecutor(f"cpu:1x{budget}", fusion="auto", fusion_cache=cache,
                  on_task=relaunch) as executor:
        cached = executor.fusion_choice(member)
        futures = executor.submit_fused([member, dataclasses.replace(member, seed=2)])
        assert all(f.result().steps == 5 for f in futures)
    assert cached.source == "cached" and cached.k == choice.k
    assert cached.measurements == tuple(with_step_seconds(cached.measurements, 2 * 16))
    assert "measure" not in {r.kind for r in relaunch.records} and cache.num_puts == 1


def test_the_host_cpu_is_planned_once_and_not_cached() -> None:
    """The host's budget is its free RAM, which moves: plans keyed by it were re-made per job."""

    cache = DictCache()
    executor = ShardExecutor("cpu", plan_cache=cache)
    first = executor.plan(spec(1))
    assert executor.plan(spec(2)) is first
    assert cache.entries == {}
    virtual = ShardExecutor("cpu:1x32MiB", plan_cache=cache)
    assert virtual.plan(spec(1)).budget_bytes == 32 * MiB and len(cache.entries) == 1



@pytest.mark.parametrize(("opt", "budget"), [
    (OptimizerSpec(lr=3e-3, weight_decay=0.1), 900 * 2**10),
    (OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
     750 * 2**10),
], ids=["adamw", "sgd"])
def test_two_spilled_arrays_sharing_a_small_device_train_as_alone(opt, budget) -> None:
    """Both arrays' members complete with plain's weights on a budget their plan just fits.

    The embedding shard's just-in-time update is the tightest task: its metered peak must stay
    within the stacked plan's, or a budget the plan fits runs out of memory (a prefetch of the
    other array's shard beside it too).
    """
    arrays = [[spec(seed, opt=opt, max_steps=3) for seed in pair] for pair in ((1, 2), (3, 4))]
    with ShardExecutor(f"cpu:1x{budget}", spill="always") as executor:
        plan = executor.stacked_plan(arrays[0][0], 2)
        assert len(plan.shards) >= 2 and plan.peak_bytes <= budget
        futures = [executor.submit_fused(members, name=f"array-{i}")
                   for i, members in enumerate(arrays)]
        results = [[future.result() for future in group] for group in futures]
    for members, group in zip(arrays, results, strict=True):
        for member, result in zip(members, group, strict=True):
            expected = train_plain(member, CPU)
            assert result.steps == 3 and 0 < result.peak_device_bytes <= budget
            assert_close_states(result.state_dict, expected.state_dict, rtol=1e-5, atol=1e-5)


def test_an_array_and_a_job_that_fit_interleave_their_steps_and_stay_resident() -> None:
    """A fused array that fits and a single job that fits, on one device under Sharded-LRTF.

    Both are one shard (the array one stacked shard of its K members): one task per step, which
    the policy interleaves; the budget holds either's step beside what the other keeps, so each
    keeps its shard resident with its optimizer state and promotes it once. Every member equals
    ``train_plain``.
    """
    adamw = OptimizerSpec(lr=1e-3)
    members = [spec(k, adamw, max_steps=4, eval_every=None) for k in (1, 2, 3)]
    # about as many seconds as the array's 4 steps of 3 members: the policy alternates them
    single = spec(4, adamw, name="single", max_steps=10, eval_every=None)
    roomy = VirtualDevice("cpu:9", budget_bytes=64 * MiB)
    probes = [plan_stacked(members[0], len(members), roomy).shards[0],
              plan_job(single, roomy).shards[0]]
    steps = [(s.backward_peak_bytes + s.optimizer_bytes) * (1 + PEAK_MARGIN) for s in probes]
    kept = [s.param_bytes + s.optimizer_bytes for s in probes]
    budget = int(max(steps[0] + kept[1], steps[1] + kept[0])) + 1
    timeline = Timeline()
    with ShardExecutor(f"cpu:1x{budget}", on_task=timeline) as executor:
        assert not executor.will_spill(single)
        plans = [executor.stacked_plan(members[0], len(members)), executor.plan(single)]
        assert all(len(plan.shards) == 1 for plan in plans)
        with executor._state.condition:  # the worker waits until both jobs are submitted
            futures = [*executor.submit_fused(members, name="array"), executor.submit(single)]
        results = [future.result(timeout=300) for future in futures]
        [device] = executor.devices
    # in whatever order the device ran them: each fits beside what the other keeps, so each
    # is promoted once (a job run wholly before the other promotes once too)
    assert device.meter.live_bytes == 0
    assert max(r.peak_bytes for r in timeline.records) <= budget
    for name, num_steps in (("array", 4), ("single", 10)):
        training = [r for r in timeline.records if r.job == name and r.kind != "eval"]
        assert [(r.kind, r.shard, r.step) for r in training] == [
            ("backward", 0, s) for s in range(num_steps)]
    for member, result in zip([*members, single], results, strict=True):
        expected = train_plain(member, CPU)
        diff = max((result.state_dict[n] - t).abs().max().item()
                   for n, t in expected.state_dict.items())
        print(f"{member.name}: max abs weight diff {diff:.3g}, swap {result.swap_bytes} B")
        assert_close_states(result.state_dict, expected.state_dict, rtol=0, atol=1e-5)
        assert result.num_promotes == 1  # resident from its first step to its last
    # the order is what Sharded-LRTF decides from the chains and the seconds the tasks took:
    # replayed (deterministic), it interleaves the array's steps and the single job's
    chains = [shard_chain("array", plans[0], members[0].total_steps),
              shard_chain("single", plans[1], single.total_steps,
                          eval_rows=0 if single.eval_data is None else len(single.eval_data),
                          eval_every=single.eval_every)]
    replayed = replay(ShardedLRTF(1, device_bytes=budget), chains,
                      recorded_durations(timeline.records, chains))
    assert_one_task_at_a_time(replayed)
    order = [job for _, job, _ in hand_out_order(replayed)]
    assert num_runs(order).keys() == {"array", "single"}
    assert all(runs > 1 for runs in num_runs(order).values())  # not one contiguous block each
    assert replayed.num_promotes == len(chains)  # each kept its shard beside the other's steps
    # the array's weights went to the device once and came back once with its optimizer state
    # (made there by its first step): its state did not travel each step
    array = [r for r in timeline.records if r.job == "array"]
    assert sum(r.swap_bytes for r in array) == results[0].swap_bytes
    assert results[0].swap_bytes < 2 * kept[0]


def test_an_array_on_the_host_cpu_trains_in_place() -> None:
    members = [spec(1, max_steps=3), spec(2, OptimizerSpec(name="sgd", lr=0.05), max_steps=3)]
    timeline = Timeline()
    with ShardExecutor("cpu", on_task=timeline) as executor:
        results = [f.result() for f in executor.submit_fused(members, name="array")]
        [device] = executor.devices
    stats = device.transfers
    assert (stats.promote_bytes, stats.demote_bytes, stats.num_promotes, stats.num_demotes) == (
        0, 0, 0, 0)
    assert all(r.swap_bytes == 0 for r in results)
    assert all(r.swap_bytes == 0 for r in timeline.records)
    training = [r for r in timeline.records if r.kind != "eval"]
    assert [(r.kind, r.shard, r.step) for r in training] == [("backward", 0, s) for s in range(3)]
    for member, result in zip(members, results, strict=True):
        assert_close_states(result.state_dict, train_plain(member, CPU).state_dict, **TIGHT)
