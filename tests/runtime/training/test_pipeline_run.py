"""A spilled job pipelined over virtual devices: p2p copies, exactness, bytes, budgets."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from transformers import GPT2LMHeadModel

from sweepmaster.runtime import (
    Device,
    PipelinedRun,
    ShardExecutor,
    SpilledJob,
    VirtualDevice,
    make_plan,
    profile_model,
    train_pipelined,
    train_plain,
)
from sweepmaster.runtime.devices.host_syncs import HostSyncCounter
from sweepmaster.runtime.execution.jobs import SpilledRun
from sweepmaster.runtime.planning.pipeline_plan import (
    pipeline_device_bytes,
    pipeline_reserve_bytes,
    pipeline_resident_bytes,
    pipeline_state_stays,
    pipeline_wrap,
)
from sweepmaster.runtime.planning.update_site import with_update_on
from sweepmaster.runtime.scheduling.chains import JobSpec
from sweepmaster.runtime.scheduling.pipeline import (
    PipelineDecision,
    choose_packs,
    lanes,
    pipeline_step,
)
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob, train_fused_spilled
from sweepmaster.runtime.training.pipeline_lanes import PipelineLanes
from sweepmaster.runtime.training.shard_trainer import ShardTrainer
from sweepmaster.runtime.training.spill import train_spilled
from sweepmaster.runtime.training.training_state import checkpoint_files
from sweepmaster.sweep.plan import pipeline_shape
from sweepmaster.workload import OptimizerSpec, TrainSpec
from tests.kit.fused import assert_equals_plain as assert_member_equals_plain
from tests.kit.fused import member
from tests.kit.lora import SPILL_BUDGET as LORA_BUDGET
from tests.kit.lora import SPILLED_MEMBERS as LORA_MEMBERS
from tests.kit.lora import PruneAt2, assert_equals_alone
from tests.kit.records import replay
from tests.kit.spill import (
    MiB,
    Recorder,
    assert_weights,
    forced_plan,
    plain_result,
    random_blocks,
    tiny_config,
    tiny_plan,
    tiny_spec,
)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),  # vmap
]

BUDGET = MiB  # plain training of the tiny GPT-2 needs about 1.4 MiB: it spills


def devices(num: int, budget: int = BUDGET) -> list[VirtualDevice]:
    return [VirtualDevice(f"cpu:{i}", budget_bytes=budget) for i in range(num)]


# ---------------------------------------------------------------- p2p


def test_p2p_copies_between_devices_are_counted_apart_from_swaps() -> None:
    a, b = devices(2, budget=1024)
    host = [torch.arange(6.0), torch.ones(2, dtype=torch.int64)]
    on_a = a.transfer.promote(host)
    with a.meter.metering():  # a pack computing on a sends: counted on b only
        copies = a.transfer.p2p(on_a, b).wait_device()
    assert all(torch.equal(c, h) for c, h in zip(copies, host, strict=True))
    assert copies[0].untyped_storage().data_ptr() != on_a[0].untyped_storage().data_ptr()
    assert a.meter.live_bytes == b.meter.live_bytes == 40
    assert (a.transfers.p2p_out_bytes, a.transfers.num_p2p_out, a.transfers.p2p_in_bytes) == (
        40, 2, 0)
    assert (b.transfers.p2p_in_bytes, b.transfers.num_p2p_in, b.transfers.p2p_bytes) == (40, 2, 40)
    assert (a.transfers.swap_bytes, b.transfers.swap_bytes) == (40, 0)  # the promote only

    on_a[0].add_(1)
    a.transfer.p2p(on_a[:1], b, outs=copies[:1]).wait_device()  # into b's tensors
    assert torch.equal(copies[0], host[0] + 1) and b.meter.live_bytes == 40
    assert b.transfers.p2p_in_bytes == 64

    with pytest.raises(torch.OutOfMemoryError):
        a.transfer.p2p([torch.zeros(300)], b)  # 1200 bytes more than b's budget


# ---------------------------------------------------------------- exactness, bytes, budgets


def assert_equals_plain_within_budget(result, recorder, pool, budget: int) -> None:
    """``tiny_spec("adamw-clip")`` pipelined: plain training's numbers and events, every
    device within ``budget`` and freed at the end."""
    expected = plain_result("adamw-clip")
    # dropout masks are the full batch's: only the order of float sums differs (2 microbatches)
    assert_weights(result.state_dict, expected.state_dict, exact=False)
    for name in ("train_loss", "eval_loss"):
        assert [v for _, v in result.history(name)] == pytest.approx(
            [v for _, v in expected.history(name)], abs=1e-5)
    assert result.history("lr") == expected.history("lr")
    assert [e.step for e in recorder.steps] == [1, 2, 3, 4, 5]
    assert [e.step for e in recorder.evals] == [0, 2, 4, 5]
    for device in pool:
        assert 0 < device.meter.peak_bytes <= budget
        assert device.meter.live_bytes == 0


@pytest.mark.parametrize("num_devices", [2, 3])
def test_pipelined_training_equals_plain_with_predicted_bytes(num_devices: int) -> None:
    spec = tiny_spec("adamw-clip")  # dropout on, grad_clip, tied wte (shard 0 and the head)
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    assert plan.spill and plan.plain_bytes > BUDGET
    shape = pipeline_shape(plan, 3)
    assert shape is not None
    cuts = next(c for c in shape.packs if len(c) - 1 == num_devices)
    assert all(pipeline_state_stays(plan, cuts))
    pool = devices(num_devices)
    recorder = Recorder()
    result = train_pipelined(spec, pool, plan, cuts, recorder)

    assert_equals_plain_within_budget(result, recorder, pool, BUDGET)
    assert result.device == ",".join(d.name for d in pool)
    assert result.peak_device_bytes == max(d.meter.peak_bytes for d in pool)

    # device -> device: the plan's prediction per step, the clip's scalars, the evaluations
    batch, block = spec.batch_size, spec.train_data.shape[1]
    num_eval = spec.eval_data.shape[0]
    boundaries = [plan.shards[b - 1].output_bytes for b in cuts[1:-1]]
    owned = SpilledJob(spec, plan).members._owned
    owned_later = sum(len(owned[s]) for s in range(cuts[1], cuts[-1]))
    clip_bytes = 4 * owned_later + 4 * (num_devices - 1)  # norms to pack 0, coefficients back
    per_step = pipeline_step(shape, cuts).p2p_bytes + clip_bytes
    per_eval = sum(b * num_eval // batch for b in boundaries)
    assert pipeline_step(shape, cuts).p2p_bytes == 2 * sum(boundaries) + 2 * sum(
        s.borrowed_bytes for s in plan.shards[cuts[1]:])
    assert result.p2p_bytes == 5 * per_step + 4 * per_eval
    assert sum(d.transfers.p2p_in_bytes for d in pool) == result.p2p_bytes
    assert sum(d.transfers.p2p_out_bytes for d in pool) == result.p2p_bytes

    # host -> device: the packs once, then only token ids (to the first and the last pack)
    load = sum(s.param_bytes for s in plan.shards)
    ids = 5 * 2 * batch * block * 8 + 4 * 2 * num_eval * block * 8
    assert sum(d.transfers.promote_bytes for d in pool) == load + ids
    # device -> host: the final write-back of the updated weights and the optimizer state
    write_back = sum(s.owned_param_bytes + s.optimizer_bytes for s in plan.shards)
    assert sum(d.transfers.demote_bytes for d in pool) == write_back
    assert result.swap_bytes == load + ids + write_back


def test_one_microbatch_pipelined_is_bitwise_plain() -> None:
    spec = tiny_spec("sgd", max_steps=3)
    plan = tiny_plan(spec, budget=BUDGET)  # microbatch = batch: plain's very operations
    result = train_pipelined(spec, devices(2), plan, (0, 2, 4))
    expected = train_plain(spec, Device("cpu"))
    assert_weights(result.state_dict, expected.state_dict)
    for name in ("train_loss", "eval_loss"):
        assert result.history(name) == expected.history(name), name


def test_a_state_without_room_travels_at_each_update() -> None:
    spec = tiny_spec("adamw", max_steps=2, eval_data=None)
    plan = tiny_plan(spec, budget=900_000)  # a single microbatch: shard 2's peak is high
    cuts = (0, 2, 3, 4)
    stays = pipeline_state_stays(plan, cuts)
    assert stays == [True, True, False, True]
    pool = devices(3, budget=900_000)
    result = train_pipelined(spec, pool, plan, cuts)
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    assert all(0 < d.meter.peak_bytes <= 900_000 for d in pool)
    state = plan.shards[2].optimizer_bytes
    # step 1 creates shard 2's state on the device (nothing to promote); it goes home after each
    # update, and comes back for step 2's
    assert pool[1].transfers.promote_bytes == plan.shards[2].param_bytes + state
    assert pool[1].transfers.demote_bytes == plan.shards[2].owned_param_bytes + 2 * state


def tasks_then_pipelined_and_back(job, cuts, one: Device, two: Device) -> None:
    """Step 1 by shard tasks on ``one``, steps 2 and 3 pipelined over both, the rest on ``two``."""
    while (task := job.next_task()) is not None and job.members.step < 1:
        job.run(task, one, keep=True)
    assert job.compute.defers  # applied when the packs come in
    pipe = PipelinedRun(job, [one, two], cuts)
    pipe.step()  # step 2, then its evaluation, then step 3
    pipe.evaluate()
    pipe.step()
    pipe.unload()
    while (task := job.next_task()) is not None:
        job.run(task, two)


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 2, 3, 4)])  # one pack per device, wrapped
def test_a_job_goes_from_shard_tasks_to_pipelined_steps_and_back(cuts) -> None:
    spec = tiny_spec("adamw-clip", max_steps=4)  # a shard-task step defers clipped updates
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    one, two = devices(2)
    job = SpilledJob(spec, plan)
    tasks_then_pipelined_and_back(job, cuts, one, two)
    result = job.result()
    expected = train_plain(spec, Device("cpu"))
    assert_weights(result.state_dict, expected.state_dict, exact=False)
    assert [v for _, v in result.history("eval_loss")] == pytest.approx(
        [v for _, v in expected.history("eval_loss")], abs=1e-5)
    assert one.meter.live_bytes == two.meter.live_bytes == 0


# ---------------------------------------------------------------- wrap-around

#: (cut points, budget): 3 packs on 2 devices where no two packs fit (the planner's wrap-around
#: layout), and 4 packs on 2 devices
WRAPS = [((0, 2, 3, 4), 600_000), ((0, 1, 2, 3, 4), BUDGET)]


def test_the_planner_wraps_around_when_no_pack_per_device_fits() -> None:
    plan = tiny_plan(tiny_spec("adamw-clip"), microbatch_size=2, budget=600_000)
    shape = pipeline_shape(plan, 2)
    assert shape is not None and shape.packs == () and shape.wrap == ((2, (0, 2, 3, 4)),)
    assert choose_packs(shape, 2) == (0, 2, 3, 4)
    roomy = pipeline_shape(tiny_plan(tiny_spec(), microbatch_size=2, budget=BUDGET), 2)
    assert roomy is not None and roomy.wrap == () and choose_packs(roomy, 2) == (0, 2, 4)


@pytest.mark.parametrize(("cuts", "budget"), WRAPS)
def test_wrap_around_training_equals_plain_within_budget(cuts, budget) -> None:
    spec = tiny_spec("adamw-clip")  # dropout on, grad_clip, tied wte (shard 0 and the head)
    plan = tiny_plan(spec, microbatch_size=2, budget=budget)
    pool = devices(2, budget)
    recorder = Recorder()
    result = train_pipelined(spec, pool, plan, cuts, recorder)
    assert_equals_plain_within_budget(result, recorder, pool, budget)


def pipelined_steps(job: ShardTrainer, pipe: PipelinedRun) -> list[list[tuple[int, int, int]]]:
    """Run ``job``'s steps through ``pipe``; per step, per device: bytes host -> device,
    device -> host and device -> device in (deferred updates: applied as packs come in)."""
    moved = []
    while (task := job.next_task()) is not None:
        if task.phase != "train":
            pipe.update()
            continue
        before = [(d.transfers.promote_bytes, d.transfers.demote_bytes, d.transfers.p2p_in_bytes)
                  for d in pipe.devices]
        pipe.step()
        moved.append([(d.transfers.promote_bytes - b[0], d.transfers.demote_bytes - b[1],
                       d.transfers.p2p_in_bytes - b[2])
                      for d, b in zip(pipe.devices, before, strict=True)])
    return moved


def assert_steady_steps_move_the_predicted_bytes(steady, job: ShardTrainer, shape, cuts,
                                                 num_members: int = 1) -> None:
    """Each of ``steady`` (steps that follow a step run the same way, on 2 devices) moves, per
    device, the host bytes ``pipeline_step`` predicts and its device -> device bytes."""
    plan = job.plan
    step = pipeline_step(shape, cuts, num_devices=2)
    # a device of one pack: a state without room beside it travels at each update (not modelled)
    stays = pipeline_state_stays(plan, cuts, 2)
    travels = [0, 0]
    for d, packs in enumerate(lanes(len(cuts) - 1, 2)):
        if len(packs) == 1:
            shards = range(cuts[packs[0]], cuts[packs[0] + 1])
            travels[d] = sum(plan.shards[s].optimizer_bytes for s in shards if not stays[s])
    # device -> device: boundaries both ways, tied contributions and values of devices' first
    # packs; under grad_clip the norms of the second device's packs and its coefficient (4
    # bytes per member each)
    norms = sum(len(job.members.owned_keys(s)) for p in lanes(len(cuts) - 1, 2)[1]
                for s in range(cuts[p], cuts[p + 1]))
    clip = 4 * num_members * (norms + 1) if plan.grad_clip else 0
    for moved in steady:
        for d, ((up, down), (real_up, real_down, _)) in enumerate(
                zip(step.device_host_bytes, moved, strict=True)):
            assert real_up == up + travels[d], d
            assert real_down == down + travels[d], d
        assert sum(p2p for _, _, p2p in moved) == step.p2p_bytes + clip


@pytest.mark.parametrize(("cuts", "budget"), WRAPS)
@pytest.mark.parametrize("opt_name", ["adamw-clip", "adamw"])
def test_wrap_around_steps_move_the_predicted_bytes(cuts, budget, opt_name) -> None:
    spec = tiny_spec(opt_name, eval_data=None, max_steps=4)
    plan = tiny_plan(spec, microbatch_size=2, budget=budget)
    shape = pipeline_shape(plan, 2)
    assert shape is not None
    pool = devices(2, budget)
    job = SpilledJob(spec, plan)
    pipe = PipelinedRun(job, pool, cuts)
    moved = pipelined_steps(job, pipe)
    # steps 3 and 4 follow a step that ran the same way: the steady state the model predicts
    assert_steady_steps_move_the_predicted_bytes(moved[2:], job, shape, cuts)
    # the head's tied wte goes through the host: only boundaries cross device to device
    assert pipeline_step(shape, cuts, num_devices=2).p2p_bytes == 2 * sum(
        plan.shards[b - 1].output_bytes for b in cuts[1:-1])
    pipe.unload()
    result = job.result()
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    assert all(0 < d.meter.peak_bytes <= budget and d.meter.live_bytes == 0 for d in pool)
    assert result.p2p_bytes == sum(p2p for step in moved for _, _, p2p in step)
    assert sum(d.transfers.p2p_in_bytes for d in pool) == result.p2p_bytes


# ---------------------------------------------------------------- peaks


@pytest.fixture
def late_lane(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The device named in the returned list takes every message of its neighbours late.

    Its thread pauses 30 ms before it takes an activation, a gradient or a tied contribution
    (a descheduled thread on a loaded machine, forced): the other lanes run ahead of it.
    """
    import time

    late: list[str] = []
    take = PipelineLanes.get

    def take_late(self, source):  # type: ignore[no-untyped-def]
        queues = [(self.downstream, 1), (self.upstream, 0), (self.tied, 0)]
        receiver = next(self.packs[i + shift].device.name for qs, shift in queues
                        for i, q in enumerate(qs) if q is source)
        if receiver in late:
            time.sleep(0.03)
        return take(self, source)

    monkeypatch.setattr(PipelineLanes, "get", take_late)
    return late


@pytest.mark.parametrize(("cuts", "budget"), [((0, 2, 4), BUDGET), ((0, 1, 2, 4), BUDGET),
                                              *WRAPS])
def test_a_devices_peak_is_the_planned_worst_case_however_late_the_other_lanes(
        cuts, budget, late_lane) -> None:
    # a gradient stays on its sender until the sender's own fixed point, not until whenever the
    # previous pack copies it: one device late (each in turn) leaves every peak the same
    spec = tiny_spec("adamw-clip", max_steps=2)
    plan = tiny_plan(spec, microbatch_size=2, budget=budget)
    num_devices = min(len(cuts) - 1, 2 if (cuts, budget) in WRAPS else 3)
    planned = pipeline_device_bytes(plan, cuts, num_devices)
    peaks = []
    for late in [f"cpu:{d}" for d in range(num_devices)]:
        late_lane[:] = [late]
        pool = devices(num_devices, budget)
        train_pipelined(spec, pool, plan, cuts)
        peaks.append([d.meter.peak_bytes for d in pool])
    assert all(p == peaks[0] for p in peaks), peaks
    assert all(0 < peak <= limit <= budget for peak, limit in zip(
        peaks[0], planned, strict=True)), (peaks[0], planned)


def test_an_evaluation_keeps_one_block_in_flight_to_a_devices_first_pack(late_lane) -> None:
    # 32 evaluation blocks: the next device takes each as it comes (one in flight), so its
    # peak is the same whether it or the sender is late, whatever the evaluation's size
    spec = tiny_spec("sgd", max_steps=1, eval_data=random_blocks(64, seed=9))
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    peaks = []
    for late in ("cpu:0", "cpu:1"):
        late_lane[:] = [late]
        pool = devices(2)
        pipe = PipelinedRun(SpilledJob(spec, plan), pool, (0, 2, 4))
        pipe.load()
        pipe.evaluate()
        peaks.append([d.meter.peak_bytes for d in pool])
        pipe.unload()
    assert peaks[0] == peaks[1], peaks
    assert all(peak <= limit for peak, limit in zip(
        peaks[0], pipeline_device_bytes(plan, (0, 2, 4)), strict=True))


@pytest.mark.parametrize(("cuts", "budget"), [((0, 2, 4), BUDGET), *WRAPS])
def test_an_evaluations_peak_does_not_grow_with_its_size(cuts, budget) -> None:
    # 256 evaluation blocks (64 training batches), then 4: each chunk's token ids come in as a
    # pack takes it, and under wrap-around the blocks for a pack that is not its device's first
    # wait on the host until that pack takes them, so a device's peak is within its plan and
    # the same
    plan = tiny_plan(tiny_spec("sgd"), microbatch_size=2, budget=budget)
    planned = pipeline_device_bytes(plan, cuts, 2)
    peaks = []
    for num_eval in (256, 4):
        spec = tiny_spec("sgd", max_steps=1, eval_data=random_blocks(num_eval, seed=9))
        expected = train_plain(spec, Device("cpu")).history("eval_loss")[0][1]
        batch = spec.batch_size
        # a block goes down where a pack sends it to a device's later pack, and up there
        parked = [0, 0]
        for p in range(2, len(cuts) - 1):  # pack p is not its device's first
            parked[(p - 1) % 2] += plan.shards[cuts[p] - 1].output_bytes * num_eval // batch
        pool = devices(2, budget)
        recorder = Recorder()
        pipe = PipelinedRun(SpilledJob(spec, plan, recorder), pool, cuts)
        pipe.load()
        for device in pool:
            device.meter.reset_peak()
        demoted = [d.transfers.demote_bytes for d in pool]
        p2p = sum(d.transfers.p2p_in_bytes for d in pool)
        pipe.evaluate()
        peaks.append([d.meter.peak_bytes for d in pool])
        assert all(0 < peak <= limit <= budget for peak, limit in zip(
            peaks[-1], planned, strict=True)), (num_eval, peaks[-1], planned)
        assert [d.transfers.demote_bytes - b for d, b in zip(pool, demoted, strict=True)] == parked
        # only the crossing to the second device's first pack goes device to device
        crossing = plan.shards[cuts[1] - 1].output_bytes * num_eval // batch
        assert sum(d.transfers.p2p_in_bytes for d in pool) - p2p == crossing
        pipe.unload()
        assert [e.eval_loss for e in recorder.evals] == pytest.approx([expected], abs=1e-5)
    assert peaks[0] == peaks[1], peaks


def test_wrap_around_needs_two_devices_at_most_one_per_pack() -> None:
    spec = tiny_spec()
    job = SpilledJob(spec, tiny_plan(spec, budget=BUDGET))
    with pytest.raises(ValueError, match="distinct devices"):
        PipelinedRun(job, devices(1), (0, 2, 4))
    with pytest.raises(ValueError, match="distinct devices"):
        PipelinedRun(job, devices(5), (0, 1, 2, 3, 4))


# ---------------------------------------------------------------- fewer spare devices than packs

#: The tiny GPT-2 cut into its 5 layers (embed | block.0 | block.1 | block.2 | head) at a budget
#: where one pack per device needs 4 devices (``(0, 1, 2, 3, 5)``): on 2 or 3 devices it wraps
#: around, 4 packs on 2 devices (two each), 5 on 3 (two, two, one)
FIVE_LAYERS, TIGHT = [0, 1, 2, 3, 4, 5], 400_000
SPARE_WRAPS = {2: (0, 1, 2, 3, 5), 3: (0, 1, 2, 3, 4, 5)}


def tight_plan(spec):
    plan = tiny_plan(spec, microbatch_size=2, budget=TIGHT, cuts=FIVE_LAYERS)
    assert pipeline_shape(plan, 4).packs == ((0, 1, 2, 3, 5),)  # fewest packs that fit: 4
    return plan


def test_sharded_lrtf_wraps_a_job_around_the_devices_it_can_spare() -> None:
    spec = tiny_spec("adamw-clip", eval_every=None, max_steps=3)
    plan = tight_plan(spec)
    big = SpilledRun("big", spec, plan, None, None, pipeline_devices=4).chain()
    assert big.pipeline is not None and big.pipeline.wrap == tuple(SPARE_WRAPS.items())
    # a job that updates on the host (ZeRO-Offload) is never pipelined: packs keep its state
    unclipped = tiny_spec("adamw", eval_every=None, max_steps=3)
    host = with_update_on(tight_plan(unclipped), unclipped.optimizer, "host")
    assert host.update_on == "host"
    assert SpilledRun("host", unclipped, host, None, None,
                      pipeline_devices=4).chain().pipeline is None
    short = JobSpec.from_shards("short", 1, [1.0, 1.0], [2.0, 2.0], [4, 4], [12, 12])
    policy = ShardedLRTF(4, pipeline=True)
    policy.add_job(big)
    policy.add_job(short)
    # 2 ready jobs share 4 free devices: big may take 2, fewer than its fewest packs that fit
    decision = policy.next_pipeline()
    assert decision is not None and decision.job_id == "big"
    assert decision.devices == (0, 1) and decision.cuts == SPARE_WRAPS[2] and decision.load
    assert decision.lane_shards == ((0, 2), (1, 3, 4))  # packs 0, 2 | packs 1, 3
    planned = pipeline_device_bytes(plan, decision.cuts, 2)
    assert max(planned) <= TIGHT, planned
    assert policy.next_pipeline() is None
    task = policy.next_task(2)
    assert task is not None and task.job_id == "short"
    # the same policy replayed with the plan's seconds (no clock): the first step over 2
    # devices; the short job keeps device 2 for its 3 s, so big's next steps take the other 3
    result = replay(ShardedLRTF(4, pipeline=True), [big, short])
    assert [(d.devices, d.cuts) for d in result.pipelined_steps["big"]] == [
        ((0, 1), SPARE_WRAPS[2]), ((0, 1, 3), SPARE_WRAPS[3]), ((0, 1, 3), SPARE_WRAPS[3])]
    assert max(pipeline_device_bytes(plan, SPARE_WRAPS[3], 3)) <= TIGHT


@pytest.mark.parametrize("num_devices", [2, 3])
def test_wrap_around_over_fewer_devices_than_the_fewest_packs_equals_plain(num_devices) -> None:
    spec = tiny_spec("adamw-clip")  # dropout on, grad_clip, tied wte (shard 0 and the head)
    plan = tight_plan(spec)
    cuts = choose_packs(pipeline_shape(plan, 4), num_devices)
    assert cuts == SPARE_WRAPS[num_devices]
    pool = devices(num_devices, TIGHT)
    recorder = Recorder()
    result = train_pipelined(spec, pool, plan, cuts, recorder)
    assert_equals_plain_within_budget(result, recorder, pool, TIGHT)
    planned = pipeline_device_bytes(plan, cuts, num_devices)
    assert all(0 < d.meter.peak_bytes <= limit <= TIGHT
               for d, limit in zip(pool, planned, strict=True)), planned
    assert sum(d.transfers.p2p_in_bytes for d in pool) == result.p2p_bytes > 0


# ---------------------------------------------------------------- layouts within the budget


def assert_offered_layouts_fit(plan, max_devices: int = 3) -> None:
    """Every layout ``pipeline_shape`` offers, on every device count it may run on, plans each
    device's peak within the plan's budget."""
    for devices_offered in range(2, max_devices + 1):
        shape = pipeline_shape(plan, devices_offered)
        assert shape is not None
        for cuts in shape.packs:
            planned = pipeline_device_bytes(plan, cuts)
            assert max(planned) <= plan.budget_bytes, (cuts, planned)
        for num_devices, cuts in shape.wrap:
            planned = pipeline_device_bytes(plan, cuts, num_devices)
            assert max(planned) <= plan.budget_bytes, (cuts, num_devices, planned)
        # every device count it may be spared gets a layout: one pack per device, or else
        # the wrap-around layout planned for that count, whenever one fits
        for spare in range(2, devices_offered + 1):
            cuts = choose_packs(shape, spare)
            if cuts is None:
                assert not pipeline_wrap(plan, spare), spare
                assert all(len(c) - 1 > spare for c in shape.packs), spare
                continue
            planned = pipeline_device_bytes(plan, cuts, min(spare, len(cuts) - 1))
            assert max(planned) <= plan.budget_bytes, (cuts, spare, planned)


def edge_plan(edge: str):
    """``tiny_spec("adamw-clip")`` (2 steps) planned at a budget 1 byte short of its
    ``(0, 2, 4)`` layout's last pack beside the step's token ids: the pack alone (``"labels"``),
    or with every optimizer state of its shards (``"states"``). The shards are those at
    ``BUDGET``."""
    spec = tiny_spec("adamw-clip", max_steps=2)
    roomy = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    last = sum(pipeline_resident_bytes(roomy)[2:])
    if edge == "states":
        last += sum(s.optimizer_bytes for s in roomy.shards[2:])
    plan = tiny_plan(spec, microbatch_size=2, budget=last + roomy.shards[0].input_bytes - 1)
    assert plan.shards == roomy.shards
    return spec, plan


def test_a_last_pack_that_fits_only_without_the_labels_is_not_offered() -> None:
    # the (0, 2, 4) layout's last pack fits the budget, but its device holds the step's token
    # ids (its labels) too: that device's planned peak is over the budget, so two devices get
    # the wrap-around layout and three the layout whose last pack is the head alone
    spec, plan = edge_plan("labels")
    last = sum(pipeline_resident_bytes(plan)[2:])
    labels = plan.shards[0].input_bytes
    assert last < plan.budget_bytes < last + labels
    assert pipeline_device_bytes(plan, (0, 2, 4))[1] == last + labels
    shape = pipeline_shape(plan, 3)
    assert shape is not None and shape.packs == ((0, 2, 3, 4),)
    two = pipeline_shape(plan, 2)
    assert two is not None and two.packs == () and two.wrap == ((2, (0, 2, 3, 4)),)
    assert choose_packs(two, 2) == (0, 2, 3, 4)
    assert_offered_layouts_fit(plan)
    # pipelined as offered: the weights of plain training, every device within its plan
    pool = devices(2, plan.budget_bytes)
    result = train_pipelined(spec, pool, plan, (0, 2, 3, 4))
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    planned = pipeline_device_bytes(plan, (0, 2, 3, 4), 2)
    assert all(0 < d.meter.peak_bytes <= limit <= plan.budget_bytes
               for d, limit in zip(pool, planned, strict=True)), planned


def test_an_optimizer_state_without_room_beside_the_labels_travels() -> None:
    # the (0, 2, 4) layout's last pack and all its states fit the budget, not beside the
    # step's token ids too: the head's state (the pack's last) travels at each update
    spec, plan = edge_plan("states")
    shape = pipeline_shape(plan, 2)
    assert shape is not None and shape.packs == ((0, 2, 4),)
    assert pipeline_state_stays(plan, (0, 2, 4)) == [True, True, True, False]
    held = sum(pipeline_resident_bytes(plan)[2:]) + plan.shards[2].optimizer_bytes
    assert pipeline_device_bytes(plan, (0, 2, 4))[1] == held + plan.shards[0].input_bytes
    assert_offered_layouts_fit(plan)
    pool = devices(2, plan.budget_bytes)
    result = train_pipelined(spec, pool, plan, (0, 2, 4))
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    planned = pipeline_device_bytes(plan, (0, 2, 4))
    assert all(0 < d.meter.peak_bytes <= limit <= plan.budget_bytes
               for d, limit in zip(pool, planned, strict=True)), planned
    # step 1 creates the head's state on its device, it goes home; step 2 brings it back
    state = plan.shards[3].optimizer_bytes
    assert pool[1].transfers.demote_bytes == sum(
        s.owned_param_bytes + (s.optimizer_bytes if s.index == 2 else 0)
        for s in plan.shards[2:]) + 2 * state


@pytest.mark.parametrize("opt_name", ["adamw-clip", "sgd"])
def test_every_layout_offered_plans_each_device_within_the_budget(opt_name) -> None:
    # budgets one byte either side of each span of shards as a pack, alone, with its states,
    # beside a pack boundary's reserve and beside the step's token ids
    roomy = tiny_plan(tiny_spec(opt_name), microbatch_size=2, budget=BUDGET)
    resident = pipeline_resident_bytes(roomy)
    labels, reserve = roomy.shards[0].input_bytes, pipeline_reserve_bytes(roomy)
    budgets = set()
    for start in range(4):
        for stop in range(start + 1, 5):
            alone = sum(resident[start:stop])
            states = sum(s.optimizer_bytes for s in roomy.shards[start:stop])
            for held in (alone, alone + states):
                for beside in (0, labels, reserve, reserve + labels):
                    budgets |= {held + beside - 1, held + beside}
    assert len(budgets) > 100
    for budget in sorted(budgets):
        if budget >= max(resident):
            assert_offered_layouts_fit(dataclasses.replace(roomy, budget_bytes=budget))


# ---------------------------------------------------------------- errors


def test_packs_must_match_devices_and_shards() -> None:
    spec = tiny_spec()
    plan = tiny_plan(spec, budget=BUDGET)
    job = SpilledJob(spec, plan)
    with pytest.raises(ValueError, match="cut points"):
        PipelinedRun(job, devices(1), (0, 4))
    with pytest.raises(ValueError, match="cut points"):
        PipelinedRun(job, devices(2), (0, 2, 5))
    with pytest.raises(ValueError, match="distinct devices"):
        PipelinedRun(job, devices(3), (0, 2, 4))
    a = VirtualDevice("cpu:0", budget_bytes=BUDGET)
    with pytest.raises(ValueError, match="distinct devices"):
        PipelinedRun(job, [a, a], (0, 2, 4))


def test_a_pack_out_of_memory_fails_the_run_without_hanging() -> None:
    spec = tiny_spec("sgd", max_steps=2, eval_data=None)
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    roomy, tight = VirtualDevice("cpu:0", budget_bytes=BUDGET), VirtualDevice(
        "cpu:1", budget_bytes=300_000)  # the second pack loads, then runs out computing
    with pytest.raises(torch.OutOfMemoryError, match="cpu:1"):
        train_pipelined(spec, [roomy, tight], plan, (0, 2, 4))


def test_a_pruned_job_stops_after_its_evaluation() -> None:
    spec = tiny_spec("sgd")
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    recorder = Recorder(prune_at=2)
    pool = devices(2)
    result = train_pipelined(spec, pool, plan, (0, 2, 4), recorder)
    assert result.pruned and result.steps == 2
    assert [e.step for e in recorder.evals] == [0, 2]
    assert all(d.meter.live_bytes == 0 for d in pool)


# ---------------------------------------------------------------- the executor


def test_executor_pipelines_the_tail_of_a_sweep_every_trial_exact() -> None:
    specs = [tiny_spec(name, eval_every=None, max_steps=steps, name=f"job-{name}")
             for name, steps in (("adamw-clip", 8), ("sgd", 2), ("adamw", 2))]
    pool = devices(2)
    records = []
    with ShardExecutor(pool, spill="always", pipeline=True, plan_activations=False,
                  on_task=records.append) as executor:
        assert all(pipeline_shape(executor.plan(spec), 2).packs for spec in specs)
        futures = [executor.submit(spec) for spec in specs]
        results = [future.result() for future in futures]
    for spec, result in zip(specs, results, strict=True):
        expected = train_plain(spec, Device("cpu"))
        assert_weights(result.state_dict, expected.state_dict, exact=False)
        assert result.steps == spec.total_steps
    kinds = {(r.job, r.kind) for r in records}
    # three jobs on two devices: shard tasks at first; the longest job (Sharded-LRTF runs it
    # whenever it is ready) has steps left once the short ones end, and runs them pipelined
    assert ("job-adamw-clip", "pipeline") in kinds
    assert {("job-sgd", "forward"), ("job-adamw", "forward")} <= kinds
    assert results[0].p2p_bytes > 0
    pipelined = [r for r in records if r.kind == "pipeline"]
    assert {r.device for r in pipelined} == {"cpu:0", "cpu:1"}  # a lane on each device
    # each record counts what its device sent: together, every p2p byte of the job, once
    assert sum(r.p2p_bytes for r in pipelined) == results[0].p2p_bytes
    assert all(r.p2p_bytes == 0 for r in records if r.kind != "pipeline")
    assert all(d.meter.live_bytes == 0 for d in pool)


def test_executor_wraps_a_lone_job_around_two_devices_exact() -> None:
    spec = tiny_spec("adamw-clip", eval_every=None, max_steps=3, name="big")
    pool = devices(2, 600_000)
    records = []
    with ShardExecutor(pool, spill="always", pipeline=True, plan_activations=False,
                  on_task=records.append) as executor:
        shape = pipeline_shape(executor.plan(spec), 2)
        assert shape is not None and not shape.packs
        assert [(d, len(cuts) - 1 > d) for d, cuts in shape.wrap] == [(2, True)]
        result = executor.submit(spec).result()
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    pipelined = [r for r in records if r.kind == "pipeline"]
    assert {r.device for r in pipelined} == {"cpu:0", "cpu:1"} and len(pipelined) == 2 * 3
    assert sum(r.p2p_bytes for r in pipelined) == result.p2p_bytes > 0
    assert all(0 < d.meter.peak_bytes <= 600_000 and d.meter.live_bytes == 0 for d in pool)


def test_packs_kept_between_steps_leave_before_another_job_uses_a_device() -> None:
    spec = tiny_spec("adamw-clip", eval_every=None, max_steps=3)
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    run = SpilledRun("job", spec, plan, None, None, pipeline_devices=2)
    assert run.chain().pipeline is not None
    pool = devices(2)
    decision = PipelineDecision("job", 0, 7, (0, 1), (0, 2, 4), True, 0.0)
    run.run_pipelined(decision, pool)  # the evaluation at step 0, then step 1
    assert run.pipeline_devices == pool and run.resident_shard(pool[1]) == 2
    assert all(d.meter.live_bytes > 0 for d in pool)
    run.discard_prefetch(pool[1])  # another job's task comes to cpu:1: every pack goes home
    assert run.pipeline_devices == [] and all(d.meter.live_bytes == 0 for d in pool)
    while (task := run.job.next_task()) is not None:  # the rest as shard tasks
        run.job.run(task, pool[0])
    result = run.result()
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)


def test_pipeline_needs_sharded_lrtf() -> None:
    with pytest.raises(ValueError, match="sharded-lrtf"):
        ShardExecutor(devices(2), pipeline=True, policy="round-robin")


# ---------------------------------------------------------------- checkpoints


class StopAt(Recorder):
    """Interrupts the run after step ``step`` (a kill between steps)."""

    def __init__(self, step: int | None) -> None:
        super().__init__()
        self.step = step

    def on_step(self, event):
        super().on_step(event)
        if event.step == self.step:
            raise KeyboardInterrupt


def test_a_pipelined_job_checkpoints_as_its_shard_tasks_do_and_resumes_exactly(tmp_path) -> None:
    # evaluated and checkpointed every 2 steps (after the evaluation), grad_clip: the packs go
    # home before each checkpoint, which holds what the spilled job's would
    def spec(name: str):
        return tiny_spec("adamw-clip", state_dir=tmp_path / name, checkpoint_every=2)

    plan = tiny_plan(spec("x"), microbatch_size=2, budget=BUDGET)
    shape = pipeline_shape(plan, 2)
    assert shape is not None
    cuts = next(c for c in shape.packs if len(c) - 1 == 2)
    piped = train_pipelined(spec("piped"), devices(2), plan, cuts)
    spilled = train_spilled(spec("spilled"), VirtualDevice("cpu:9", budget_bytes=BUDGET), plan)
    steps = [int(p.name[5:14]) for p in checkpoint_files(tmp_path / "piped")]
    assert steps == [int(p.name[5:14]) for p in checkpoint_files(tmp_path / "spilled")]
    assert steps[0] == 4  # the newest two of 2, 4 and the end
    for got, want in zip(checkpoint_files(tmp_path / "piped"),
                         checkpoint_files(tmp_path / "spilled"), strict=True):
        a, b = (torch.load(path, weights_only=False) for path in (got, want))
        assert a["step"] == b["step"]
        for name, value in b["model"].items():  # only float sums of microbatches differ
            torch.testing.assert_close(a["model"][name], value, rtol=1e-5, atol=1e-6)
    assert_weights(piped.state_dict, spilled.state_dict, exact=False)

    killed = StopAt(3)
    with pytest.raises(KeyboardInterrupt):
        train_pipelined(spec("killed"), devices(2), plan, cuts, killed)
    assert [int(p.name[5:14]) for p in checkpoint_files(tmp_path / "killed")] == [2]
    again = StopAt(None)
    resumed = train_pipelined(spec("killed"), devices(2), plan, cuts, again)
    assert [e.step for e in again.steps] == [3, 4, 5]  # from its checkpoint of step 2
    assert_weights(resumed.state_dict, piped.state_dict)  # bitwise: the same pipelined steps


# ---------------------------------------------------------------- fused arrays (K = 3)

#: (optimizer, pack cut points): three members' stacked plan of 4 shards pipelined on two
#: devices, one pack per device or wrapped around (more packs than devices)
FUSED = [(opt_name, cuts) for opt_name in ("sgd", "adamw")
         for cuts in ((0, 2, 4), (0, 1, 2, 3, 4))]
#: The stacked plan's budget: 4 shards (the packs' devices have twice as much)
FUSED_PLAN_MIB = {"sgd": 1.0, "adamw": 1.25}


def fused_members(opt_name: str, clip: float | None, **overrides) -> list[TrainSpec]:
    """Three members (AdamW: each its own lr; SGD with momentum), dropout on unless overridden."""
    specs = [member(seed, opt_name, **overrides) for seed in range(3)]
    return [dataclasses.replace(s, optimizer=dataclasses.replace(s.optimizer, grad_clip=clip))
            for s in specs]


def fused_plan(specs: list[TrainSpec], opt_name: str):
    """The 4-shard stacked plan (2 microbatches of the batch of 3) and its pipeline shape."""
    budget = int(FUSED_PLAN_MIB[opt_name] * MiB)
    plan = plan_stacked(specs[0], len(specs), VirtualDevice("cpu:9", budget_bytes=budget),
                        microbatch_size=2)
    assert len(plan.shards) == 4 and plan.spill
    shape = pipeline_shape(plan, 2, num_members=len(specs))
    assert shape is not None
    return plan, shape


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize(("opt_name", "cuts"), FUSED)
def test_a_pipelined_fused_array_trains_every_member_as_plain(opt_name, cuts, clip) -> None:
    specs = fused_members(opt_name, clip)  # dropout on, tied wte, evaluated every 2 steps
    plan, _ = fused_plan(specs, opt_name)
    budget = 2 * plan.budget_bytes
    pool = devices(2, budget)
    ended = {}
    job = SpilledFusedJob(specs, plan, on_member_end=lambda k, r, e: ended.setdefault(k, (r, e)))
    PipelinedRun(job, pool, cuts).run()
    assert job.members.stopped and sorted(ended) == [0, 1, 2]
    # the array's own shard tasks on one device: the same operations, the same numbers
    tasks = train_fused_spilled(specs, VirtualDevice("cpu:9", budget_bytes=budget), plan)
    for k, (spec, alone) in enumerate(zip(specs, tasks, strict=True)):
        result, error = ended[k]
        assert error is None and alone is not None
        # every member's weights, losses and evaluations are its plain training's
        assert_member_equals_plain(result, spec, opt_name)
        assert_weights(result.state_dict, alone.state_dict)
        assert result.p2p_bytes == job.bookkeeping.p2p_bytes > 0
        assert result.device == "cpu:0,cpu:1"
    assert all(0 < d.meter.peak_bytes <= budget and d.meter.live_bytes == 0 for d in pool)


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize(("opt_name", "cuts"), FUSED)
def test_a_pipelined_fused_array_moves_the_predicted_bytes(opt_name, cuts, clip) -> None:
    # with dropout: every pass (forward and recompute) draws its members' noise again on the
    # device of the shard's pack, promoting nothing for it
    specs = fused_members(opt_name, clip, eval_data=None, eval_every=None, max_steps=5)
    plan, shape = fused_plan(specs, opt_name)
    assert sum(shape.pass_bytes) == 0
    pool = devices(2, 2 * plan.budget_bytes)
    job = SpilledFusedJob(specs, plan)
    moved = pipelined_steps(job, PipelinedRun(job, pool, cuts))
    # steps 3 and 4 follow a step that ran the same way; after step 5 the members leave (the
    # packs go home first)
    assert len(moved) == 5
    assert_steady_steps_move_the_predicted_bytes(moved[2:4], job, shape, cuts, num_members=3)
    assert job.members.stopped and all(d.meter.live_bytes == 0 for d in pool)


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 2, 3, 4)])  # one pack per device, wrapped
def test_a_fused_array_with_a_memory_plan_goes_from_shard_tasks_to_pipelined_steps_and_back(
        cuts) -> None:
    specs = fused_members("adamw", 1.0, max_steps=4)  # a shard-task step defers clipped updates
    plan, _ = fused_plan(specs, "adamw")
    one, two = devices(2, 2 * plan.budget_bytes)
    memory = plan_stacked_memory(specs[0], 3, plan, device=one)
    ended = {}
    job = SpilledFusedJob(specs, plan, memory_plan=memory,
                          on_member_end=lambda k, r, e: ended.setdefault(k, (r, e)))
    tasks_then_pipelined_and_back(job, cuts, one, two)
    for k, spec in enumerate(specs):
        result, error = ended[k]
        assert error is None
        assert_member_equals_plain(result, spec, "adamw")
    assert one.meter.live_bytes == two.meter.live_bytes == 0


def test_a_pipelined_lora_array_trains_every_adapter_as_alone() -> None:
    # one frozen base promoted with each pack (the embeddings alone in the first, which
    # computes no gradient), ranks and adapter dropouts differ, one member clips, one is
    # pruned after step 2; a pack per shard, wrapped around two devices
    planned = stacked_spec(LORA_MEMBERS)
    plan = plan_stacked(planned, 3, VirtualDevice("cpu:9", budget_bytes=LORA_BUDGET),
                        microbatch_size=2)
    assert len(plan.shards) >= 3 and plan.shards[0].stop == 1
    callbacks = [None, PruneAt2(), None]
    ended = {}
    job = SpilledFusedJob(LORA_MEMBERS, plan, callbacks, planned=planned,
                          on_member_end=lambda k, r, e: ended.setdefault(k, (r, e)))
    pool = devices(2, 2 * LORA_BUDGET)
    PipelinedRun(job, pool, range(len(plan.shards) + 1)).run()
    for k, (spec, receiver) in enumerate(zip(LORA_MEMBERS, callbacks, strict=True)):
        result, error = ended[k]
        assert error is None
        assert_equals_alone(result, spec, receiver)
    assert ended[1][0].pruned and all(d.meter.live_bytes == 0 for d in pool)


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 2, 3, 4)])
def test_a_pipelined_lora_array_moves_the_predicted_bytes(cuts) -> None:
    # shards of other microbatch sizes pipelined at the most microbatches: each pass promotes
    # the members' dropout scales and LoRA scalings once per microbatch of the pipeline; the
    # base's embeddings (which train nothing) run no backward
    specs = [dataclasses.replace(s, eval_data=None, eval_every=None, max_steps=5)
             for s in LORA_MEMBERS]
    planned = stacked_spec(specs)
    plan = plan_stacked(planned, 3, VirtualDevice("cpu:9", budget_bytes=LORA_BUDGET),
                        microbatch_size=2)
    assert len({shard.microbatch_size for shard in plan.shards}) > 1
    shape = pipeline_shape(plan, 2, num_members=3)
    assert shape is not None and plan.shards[0].num_owned_params == 0
    pool = devices(2, 2 * plan.budget_bytes)
    job = SpilledFusedJob(specs, plan, planned=planned)
    moved = pipelined_steps(job, PipelinedRun(job, pool, cuts))
    assert len(moved) == 5
    assert_steady_steps_move_the_predicted_bytes(moved[2:4], job, shape, cuts, num_members=3)
    assert job.members.stopped and all(d.meter.live_bytes == 0 for d in pool)


def test_members_leave_and_join_a_pipelined_fused_array_at_step_boundaries() -> None:
    # members end after 2, 3 and 4 steps; a fourth joins the first free slot (after step 2):
    # the packs go home before each change and load again with the array's new rows
    specs = [member(seed, "sgd", max_steps=2 + seed) for seed in range(3)]
    joiner = member(7, "sgd", max_steps=3)
    offered = [joiner]

    def refill(free: int, array_step: int) -> list:
        taken = [(spec, None) for spec in offered[:free]]
        del offered[:free]
        return taken

    plan, _ = fused_plan(specs, "sgd")
    pool = devices(2, 2 * plan.budget_bytes)
    ended = {}
    job = SpilledFusedJob(specs, plan, refill=refill,
                          on_member_end=lambda k, r, e: ended.setdefault(k, (r, e)))
    PipelinedRun(job, pool, (0, 1, 2, 3, 4)).run()
    assert job.members.stacked.joined_step == [0, 0, 0, 2] and sorted(ended) == [0, 1, 2, 3]
    for k, spec in enumerate([*specs, joiner]):
        result, error = ended[k]
        assert error is None
        assert_member_equals_plain(result, spec, "sgd")
    assert all(d.meter.live_bytes == 0 for d in pool)


@pytest.mark.parametrize("plan_activations", [False, True])  # a memory plan off and on
def test_executor_pipelines_a_lone_spilled_fused_array_every_member_exact(
        plan_activations: bool, monkeypatch) -> None:
    # members end after 2, 3 and 4 steps (the packs go home before each leaves), clip their
    # gradients, evaluate every 2 steps and at their end
    specs = [member(seed, "sgd", max_steps=2 + seed, name=f"member-{seed}",
                    optimizer=OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, grad_clip=1.0))
             for seed in range(3)]
    pool = devices(2)
    records = []
    chains: list[JobSpec] = []  # what the executor gives its policy
    add_job = ShardedLRTF.add_job
    monkeypatch.setattr(ShardedLRTF, "add_job",
                        lambda policy, job: (chains.append(job), add_job(policy, job))[1])
    with ShardExecutor(pool, spill="always", pipeline=True, plan_activations=plan_activations,
                  microbatch_size=2, on_task=records.append) as executor:
        plan = executor.stacked_plan(specs[0], 3)
        shape = pipeline_shape(plan, 2, num_members=3)
        assert shape is not None and choose_packs(shape, 2) is not None
        results = [f.result() for f in executor.submit_fused(specs, name="array")]
    for spec, result in zip(specs, results, strict=True):
        assert_member_equals_plain(result, spec, "sgd")
    # which steps the real run pipelined is its worker threads' timing (a worker may take a
    # shard task before the other asks for a pipelined step); what Sharded-LRTF decides from
    # the array's chain (the profile's estimates: with a memory plan the shard tasks' step may
    # be predicted the quicker) and the seconds its tasks took is not. Replayed with the run's
    # seconds or the estimates alone (deterministic), it pipelines every step over both devices
    # exactly when the cost model's gate does, and without a memory plan it always does
    [chain] = chains
    assert chain.pipeline is not None
    num_steps = chain.num_tasks // len(chain.step_tasks)
    assert num_steps == 4
    cuts = choose_packs(chain.pipeline, 2, step_s=sum(t.est_seconds for t in chain.step_tasks))
    assert cuts is not None or plan_activations
    seconds = max(r.end_s for r in records) - min(r.start_s for r in records)  # the run's
    assert seconds > 0
    recorded = {(chain.job_id, i): seconds / chain.num_tasks for i in range(chain.num_tasks)}
    for durations in (recorded, None):  # the run's seconds, or the plan's estimates
        replayed = replay(ShardedLRTF(2, device_bytes=BUDGET, pipeline=True), [chain],
                          durations)
        decided = [(d.devices, d.cuts) for d in replayed.pipelined_steps.get("array", [])]
        assert decided == ([] if cuts is None else [((0, 1), cuts)] * num_steps)
        assert ({g.kind for g in replayed.gantt} == {"pipeline"}) == (cuts is not None)
    pipelined = [r for r in records if r.kind == "pipeline"]
    # each record counts what its device sent: together, every p2p byte of the array, once
    assert sum(r.p2p_bytes for r in pipelined) == results[-1].p2p_bytes
    assert (results[-1].p2p_bytes > 0) == bool(pipelined)
    assert all(d.meter.live_bytes == 0 for d in pool)


# ---------------------------------------------------------------- memory plan


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 2, 3, 4)])  # one pack per device, wrapped
def test_a_pipelined_step_recomputes_whatever_the_memory_plan(cuts) -> None:
    # the memory plan is the shard tasks': a pipelined step runs Hydra's recompute, which is
    # what the pipeline's cost model (built from the job plan alone) plans
    spec = tiny_spec("adamw-clip")
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    runs = []
    for planned in (True, False):
        pool = devices(2)
        memory = forced_plan(spec, plan, ["S", "S", "RS", "K"]) if planned else None
        job = SpilledJob(spec, plan, memory_plan=memory)
        PipelinedRun(job, pool, cuts).run()
        runs.append((job, pool))
    (job, pool), (hydra, hydra_pool) = runs
    assert job.memory_plan is not None and job.memory_plan.shards[0].swap_bytes > 0
    result = job.result()
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    assert job.passes.activation_swap_bytes == 0 and job.passes.plan_mismatches == 0
    # the same bytes moved and the same peaks as without a memory plan
    assert (result.swap_bytes, result.p2p_bytes) == (hydra.boundaries.swap_bytes,
                                                     hydra.bookkeeping.p2p_bytes)
    assert [d.meter.peak_bytes for d in pool] == [d.meter.peak_bytes for d in hydra_pool]
    assert all(d.meter.live_bytes == 0 for d in pool)


def test_a_job_with_a_memory_plan_swaps_activations_in_its_shard_tasks_only() -> None:
    # steps 1, 4 and 5 by shard tasks move what the memory plan says; steps 2 and 3 pipelined
    spec = tiny_spec("adamw-clip")
    plan = tiny_plan(spec, microbatch_size=2, budget=BUDGET)
    memory = forced_plan(spec, plan, ["S", "S", "RS", "K"])
    one, two = devices(2, 4 * MiB)
    job = SpilledJob(spec, plan, memory_plan=memory)
    tasks_then_pipelined_and_back(job, (0, 2, 4), one, two)
    assert_weights(job.result().state_dict, plain_result("adamw-clip").state_dict, exact=False)
    assert job.passes.activation_swap_bytes == 3 * sum(s.swap_bytes for s in memory.shards) > 0
    assert job.passes.num_recompute_fallbacks == 0 and job.passes.plan_mismatches == 0
    assert one.meter.live_bytes == two.meter.live_bytes == 0


# ---------------------------------------------------------------- grad_clip, tied later


def tied_blocks() -> torch.nn.Module:
    """The tiny GPT-2 with block.2's ``c_fc`` weight tied to block.1's (and wte to the head)."""
    model = GPT2LMHeadModel(tiny_config())
    model.transformer.h[2].mlp.c_fc.weight = model.transformer.h[1].mlp.c_fc.weight
    return model


def tied_blocks_plan(spec: TrainSpec, budget: int = BUDGET):
    """One shard per layer: block.1 (shard 2) owns block.2's (shard 3) weight."""
    return make_plan(profile_model(spec, 2), spec.optimizer, [0, 1, 2, 3, 4, 5],
                     VirtualDevice("cpu:9", budget_bytes=budget))


def test_grad_clip_with_a_tied_parameter_owned_by_a_later_pack_equals_plain() -> None:
    # the owner's clipped update waits for its pack to come back; the pack holding a copy
    # waits for the updated value (evaluated every 2 steps: after deferred updates too)
    spec = tiny_spec("adamw-clip", model=tied_blocks)
    plan = tied_blocks_plan(spec)
    assert plan.shards[3].borrowed_bytes > 0 and plan.grad_clip
    pool = devices(2)
    recorder = Recorder()
    result = train_pipelined(spec, pool, plan, (0, 1, 2, 3, 4, 5), recorder)
    expected = train_plain(spec, Device("cpu"))
    assert_weights(result.state_dict, expected.state_dict, exact=False)
    assert [v for _, v in result.history("eval_loss")] == pytest.approx(
        [v for _, v in expected.history("eval_loss")], abs=1e-5)
    assert all(0 < d.meter.peak_bytes <= BUDGET and d.meter.live_bytes == 0 for d in pool)


@pytest.mark.parametrize("cuts", [
    (0, 1, 2, 3, 4, 5),  # block.1's pack 2 is device 0's second: block.2's pack 3 writes to it
    (0, 2, 3, 4, 5),  # block.1's pack 1 is device 1's: device 0 writes, device 1 reads
    (0, 2, 3, 5),  # pack 1 never leaves device 1: it writes the new value for pack 2 too
    (0, 2, 4, 5),  # block.1 and block.2 in one pack: only wte's contribution crosses
])
def test_a_later_tied_owner_moves_the_predicted_bytes(cuts) -> None:
    spec = tiny_spec("adamw-clip", model=tied_blocks, eval_data=None, max_steps=4)
    plan = tied_blocks_plan(spec)
    shape = pipeline_shape(plan, 2)
    assert shape is not None
    job = SpilledJob(spec, plan)
    pipe = PipelinedRun(job, devices(2), cuts)
    moved = pipelined_steps(job, pipe)
    assert_steady_steps_move_the_predicted_bytes(moved[2:], job, shape, cuts)
    pipe.unload()
    assert_weights(job.result().state_dict, train_plain(spec, Device("cpu")).state_dict,
                   exact=False)


def test_a_later_tied_owner_goes_from_shard_tasks_to_pipelined_steps_and_back() -> None:
    spec = tiny_spec("adamw-clip", model=tied_blocks, max_steps=4)  # block.1's update deferred
    plan = tied_blocks_plan(spec)
    one, two = devices(2)
    job = SpilledJob(spec, plan)
    tasks_then_pipelined_and_back(job, (0, 1, 2, 3, 4, 5), one, two)
    expected = train_plain(spec, Device("cpu"))
    assert_weights(job.result().state_dict, expected.state_dict, exact=False)
    assert one.meter.live_bytes == two.meter.live_bytes == 0


# ---------------------------------------------------------------- host syncs


def pipelined_step_syncs(job: ShardTrainer, pipe: PipelinedRun, monkeypatch) -> list[dict]:
    """Run ``job``'s steps through ``pipe``; the host syncs of each step after the first, by
    call, on the calling thread and on every lane's thread together."""
    counted: list = []

    def counting(self, work, barrier_action=None):  # type: ignore[no-untyped-def]
        def counted_work(lane):  # type: ignore[no-untyped-def]
            with HostSyncCounter() as counter:
                work(lane)
            counted.append(counter.counts)

        return run(self, counted_work, barrier_action)

    run = PipelineLanes.run
    monkeypatch.setattr(PipelineLanes, "run", counting)
    per_step = []
    while (task := job.next_task()) is not None:
        if task.phase != "train":
            pipe.evaluate() if task.phase == "eval" else pipe.update()
            continue
        counted.clear()
        with HostSyncCounter() as counter:
            pipe.step()
        total = sum(counted, Counter(counter.counts))
        if task.step > 0:  # the first: a warm-up
            per_step.append(dict(total))
    pipe.unload()
    return per_step


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 2, 3, 4)])  # one pack per device, wrapped
def test_a_pipelined_steps_host_syncs_do_not_grow_with_its_microbatches_or_packs(
        cuts, monkeypatch) -> None:
    # dropout, grad_clip and the tied wte: wrapped, the packs park their kept inputs, their
    # gradients (deferred updates) and the head's contribution to wte on the host; the host
    # waits once per step, where the step reports its results, for 1, 2 or 4 microbatches
    spec = tiny_spec("adamw-clip", eval_every=None, max_steps=3)
    for microbatch_size in (4, 2, 1):
        plan = tiny_plan(spec, microbatch_size=microbatch_size, budget=4 * BUDGET)
        job = SpilledJob(spec, plan)
        assert len(job.boundaries.microbatches(0)) == 4 // microbatch_size
        pool = devices(2, 4 * BUDGET)
        steps = pipelined_step_syncs(job, PipelinedRun(job, pool, cuts), monkeypatch)
        assert steps == [{"wait:results": 1}] * 2, (microbatch_size, steps)
        assert job.boundaries.swap_bytes > 0 and all(d.meter.live_bytes == 0 for d in pool)
