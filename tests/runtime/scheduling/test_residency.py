"""The residency cache: a shard whose next task runs on the same device stays there."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Collection

import pytest

from sweepmaster.runtime import Device, ShardExecutor, SpilledJob, VirtualDevice, train_plain
from sweepmaster.runtime.execution.jobs import SpilledRun
from sweepmaster.runtime.execution.policy_chain import shard_chain
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory
from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.runtime.planning.partition import plan_cache_key, plan_job
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.policies import RoundRobin, ShardedLRTF, TaskParallelFIFO
from sweepmaster.runtime.scheduling.residency import PEAK_MARGIN, Residency
from sweepmaster.runtime.scheduling.sim_model import CostModel
from sweepmaster.runtime.scheduling.simulate import simulate
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.spill import train_spilled
from tests.kit.fused import forced_stacked_plan
from tests.kit.fused import member as fused_member
from tests.kit.lora import SPILL_BUDGET as LORA_BUDGET
from tests.kit.lora import SPILLED_MEMBERS as LORA_MEMBERS
from tests.kit.records import (
    Timeline,
    assert_one_task_at_a_time,
    hand_out_order,
    num_runs,
    recorded_durations,
    replay,
)
from tests.kit.spill import Recorder, assert_weights, tiny_spec
from tests.runtime.test_executor import BUDGET

pytestmark = pytest.mark.usefixtures("one_thread")


def same_shard_pairs(job: SpilledJob) -> int:
    """Consecutive tasks of one shard in the job's sequence: each keeps its shard resident."""
    tasks, ahead = [], 0
    while (task := job.peek_task(ahead)) is not None:
        tasks.append(task)
        ahead += 1
    return sum(a.shard == b.shard for a, b in zip(tasks, tasks[1:], strict=False))


@pytest.mark.parametrize("opt_name", ["adamw-clip", "sgd"])
def test_a_shard_used_next_on_the_same_device_is_not_demoted(opt_name: str) -> None:
    spec = tiny_spec(opt_name, name="kept", max_steps=4)
    timeline = Timeline()
    with ShardExecutor(f"cpu:1x{BUDGET}", plan_activations=False, on_task=timeline) as executor:
        plan = executor.plan(spec)
        kept = executor.submit(spec, Recorder()).result(timeout=300)
        [device] = executor.devices
    assert device.meter.live_bytes == 0
    # the same tasks without the cache: every task promotes its shard and demotes it
    baseline = train_spilled(spec, VirtualDevice("cpu:9", budget_bytes=BUDGET), plan,
                             Recorder())
    assert_weights(kept.state_dict, baseline.state_dict)  # same numbers, bit for bit
    assert_weights(kept.state_dict, train_plain(spec, Device("cpu")).state_dict, exact=False)
    job = SpilledJob(spec, plan)
    hits = same_shard_pairs(job)
    assert hits >= spec.total_steps - 1  # shard 0: its backward, then the next step's forward
    shard_bytes = sum(t.nbytes for t in job.members.shard_tensors(0))
    assert kept.num_promotes == baseline.num_promotes - hits
    assert kept.swap_bytes == baseline.swap_bytes - hits * shard_bytes
    assert kept.peak_device_bytes is not None and kept.peak_device_bytes <= BUDGET
    assert sum(r.swap_bytes for r in timeline.records) == kept.swap_bytes


@pytest.mark.parametrize("update_on", ["auto", "host"])
def test_simulated_promotes_saved_by_residency_equal_the_measured_ones(update_on: str) -> None:
    # Round-robin on one device decides the same order whatever the tasks' seconds, so the
    # executor and the simulator run the same tasks in the same order, and keep the same shards
    # (the residency cache's rule on the same planned peaks and shard bytes). Updated on the
    # host (ZeRO-Offload), an updated shard leaves the device: neither keeps it.
    specs = [tiny_spec("sgd", name="a", seed=1, eval_data=None, max_steps=3),
             tiny_spec("sgd", name="b", seed=2, eval_data=None, max_steps=5)]
    gate = threading.Event()

    class Waits(Recorder):
        def on_start(self, event):
            assert gate.wait(timeout=300)  # until both jobs are submitted
            super().on_start(event)

    with ShardExecutor(f"cpu:1x{BUDGET}", policy="round-robin",
                       plan_activations=False, update_on=update_on) as executor:
        plans = [executor.plan(spec) for spec in specs]
        assert all(plan.update_on == ("host" if update_on == "host" else "device")
                   for plan in plans)
        futures = [executor.submit(specs[0], Waits()), executor.submit(specs[1])]
        gate.set()
        results = [future.result(timeout=300) for future in futures]
    # the same jobs' tasks without the cache
    baselines = [train_spilled(spec, VirtualDevice("cpu:9", budget_bytes=BUDGET), plan)
                 for spec, plan in zip(specs, plans, strict=True)]
    for result, baseline in zip(results, baselines, strict=True):
        assert_weights(result.state_dict, baseline.state_dict)
    measured_saved = (sum(b.swap_bytes for b in baselines) - sum(r.swap_bytes for r in results))
    chains = [shard_chain(spec.name, plan, spec.total_steps)
              for spec, plan in zip(specs, plans, strict=True)]
    simulated = simulate(RoundRobin(1, device_bytes=BUDGET), chains,
                         CostModel(bandwidth_bytes_per_s=math.inf))
    every_promote = sum(task.promote_bytes + task.other_promote_bytes
                        for chain in chains for task in chain.tasks())
    assert every_promote - simulated.promote_bytes == measured_saved
    assert (measured_saved > 0) == (update_on == "auto")
    saved_promotes = sum(b.num_promotes for b in baselines) - sum(r.num_promotes for r in results)
    assert simulated.num_promotes == sum(c.num_tasks for c in chains) - saved_promotes


class SwapsActivations:
    """Plan cache whose memory plans swap every activation.

    Which activations mu-TWO's greedy swaps depends on the copy bandwidth measured here; a
    forced plan swaps whatever the timings, and is still checked against the budget.
    """

    def __init__(self) -> None:
        self.plans: dict[str, JobPlan] = {}
        self.memory: dict[str, MemoryPlan] = {}

    def get(self, key: str, budget_bytes: int, device_kind: str) -> JobPlan | None:
        return self.plans.get(key)

    def put(self, key: str, budget_bytes: int, device_kind: str, plan: JobPlan) -> None:
        self.plans.setdefault(key, plan)

    def get_memory_plan(self, key: str, budget_bytes: int, device_kind: str) -> MemoryPlan | None:
        return self.memory.get(key)

    def put_memory_plan(self, key: str, budget_bytes: int, device_kind: str,
                        plan: MemoryPlan) -> None:
        self.memory.setdefault(key, plan)

    def force(self, spec, plan: JobPlan, device: Device) -> None:
        """Plan ``spec``'s activations on ``device``: every one is swapped."""
        greedy = plan_memory(spec, plan, device=device)  # for the activations of each layer
        decisions = [[LayerDecision.swap_all(len(d.swap)) for d in shard.decisions]
                     for shard in greedy.shards]
        key = plan_cache_key(spec, None)
        assert key is not None
        self.memory[key] = plan_memory(spec, plan, device=device, decisions=decisions)


#: A device budget a tiny job fits: planned for it, the job is one shard (S = 1).
FITS = 64 * 2**20

#: A budget that three tiny members with dropout fit only as 4 stacked shards of one layer.
BUDGET_1MIB = 2**20

#: Members of the fused arrays of one stacked shard the swap-volume tests train (K).
ARRAY_K = 3


def fused_members(spec, num_members: int):
    """``num_members`` members of ``spec``'s architecture, dropout included (seeds differ)."""
    return [dataclasses.replace(spec, name=f"{spec.name}{k}" if k else spec.name,
                                seed=spec.seed + 10 * k) for k in range(num_members)]


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize(("members", "layout"), [("dropout", "spilled"), ("dropout", "planned"),
                                                 ("dropout", "whole"), ("lora", "spilled"),
                                                 ("lora", "planned")])
def test_each_task_of_a_fused_array_with_dropout_moves_its_chain_bytes(
    members: str, layout: str
) -> None:
    # K = 3 members with dropout: no layer pass promotes noise (each member's is drawn again on
    # the device from its generator state, so masks never cross). Spilled (4 stacked shards of
    # one layer) under Hydra's
    # recompute, under a memory plan that recomputes some layers (their noise drawn again in
    # the backward task) and swaps others (not again), or one stacked shard kept resident
    # between its steps. Run as the executor runs them (a shard whose next task is its own
    # stays: a spilled array's first shard from its backward to the next step's forward), each
    # task moves exactly what its chain's task counts. LoRA members
    # (ranks, alphas and adapter dropouts differ; one clips) evaluate every 2 steps: every pass
    # of a shard with adapters promotes their scalings too, training or evaluating (the base's
    # embeddings and head: none), and the backward task of the base's embeddings (a first shard
    # that trains nothing) runs no pass but sends the step's clip coefficient home.
    if members == "lora":
        specs = [dataclasses.replace(spec, max_steps=3) for spec in LORA_MEMBERS]
        planned = stacked_spec(specs)
        plan = plan_stacked(planned, 3, VirtualDevice("cpu:plan", budget_bytes=LORA_BUDGET),
                            microbatch_size=2)
        assert plan.grad_clip and plan.shards[0].num_owned_params == 0
        assert plan.shards[0].noise_bytes[0] == 0
        assert [shard.scaling_bytes for shard in plan.shards] == [0, 3 * 4, 3 * 4, 0]
    else:
        specs = [fused_member(seed, eval_data=None, max_steps=3) for seed in (1, 2, 3)]
        planned = specs[0]
        plan = plan_stacked(planned, 3, VirtualDevice("cpu:plan", budget_bytes=BUDGET_1MIB),
                            whole=layout == "whole")
    assert len(plan.shards) == (1 if layout == "whole" else 4)
    assert not any(sum(shard.noise_bytes) for shard in plan.shards)  # drawn on the device
    memory = forced_stacked_plan(specs, plan, ["R", "S", "R", "R"]) if layout == "planned" \
        else None
    eval_data, eval_every = specs[0].eval_data, specs[0].eval_every
    chain = shard_chain("array", plan, 3, eval_rows=0 if eval_data is None else len(eval_data),
                        eval_every=eval_every, memory_plan=memory, num_members=3)
    device = VirtualDevice("cpu:0", budget_bytes=4 * BUDGET_1MIB)
    job = SpilledFusedJob(specs, plan, planned=planned, memory_plan=memory)
    resident, changed = False, 0
    for expected in chain.tasks():  # as the executor runs them (SpilledRun.run)
        before = job.boundaries.swap_bytes
        while (task := job.next_task()) is not None:  # evaluation tasks, then the training one
            job.run(task, device, keep=True)
            if task.phase == "train":
                break
        assert task is not None and task.shard == expected.shard
        assert task.est_seconds == pytest.approx(expected.est_seconds)  # the memory plan's
        if expected.index == chain.num_tasks - 1:  # the last evaluation, deferred updates
            while (following := job.next_task()) is not None:
                job.run(following, device, keep=True)
        following = job.next_task()
        stays = following is not None and following.shard == task.shard
        changed = expected.write_back_bytes or changed  # the last changing task's, when it leaves
        assert job.boundaries.swap_bytes - before == (
            (0 if resident else expected.promote_bytes) + expected.other_promote_bytes
            + expected.demote_bytes + (0 if stays else changed)), expected
        resident, changed = stays, changed if stays else 0
    assert job.next_task() is None and device.meter.live_bytes == 0


def run_together(specs, num_devices: int, policy: str, *, swap: bool = False,
                 budget: int = BUDGET, fit: Collection[str] = (), fused: Collection[str] = ()):
    """Train ``specs`` on one executor, every job the policy's before any task starts.

    ``swap``: under memory plans that swap activations (else Hydra's full recompute).
    ``budget``: each device's (bytes); the jobs are planned for ``BUDGET`` whatever it is, so
    a larger one leaves room for shards kept beside a task. ``fit``: names of jobs planned for
    ``FITS`` instead, so one shard each, kept with its optimizer state across steps (their
    architectures must differ from the others'). ``fused``: names of specs trained as a fused
    array of :data:`ARRAY_K` members of one stacked shard (:func:`fused_members`), planned for
    the device and kept with its optimizer state across steps like a job that fits.

    Returns:
        Per spec its job's chain and result (an array's: its first member's, whose swap
        bytes are the array's), the devices, the task records, and per spec the results of
        every member of its job.
    """
    timeline = Timeline()
    cache = SwapsActivations()
    members = [fused_members(spec, ARRAY_K) if spec.name in fused else [spec] for spec in specs]
    for spec in specs:
        key = plan_cache_key(spec, None)
        if key not in cache.plans and spec.name not in fused:
            planned = FITS if spec.name in fit else BUDGET
            cache.plans[key] = plan_job(spec, VirtualDevice("cpu:9", budget_bytes=planned))
    with ShardExecutor(f"cpu:{num_devices}x{budget}", policy=policy, plan_activations=swap,
                  plan_cache=cache, on_task=timeline) as executor:
        plans = [executor.stacked_plan(executor.fused_spec(m), len(m), whole=True)
                 if len(m) > 1 else executor.plan(m[0]) for m in members]
        if swap:
            for spec, plan in zip(specs, plans, strict=True):
                if spec.name not in fused:
                    cache.force(spec, plan, executor.planning_device)
        memory = [executor.memory_plan(m[0]) if len(m) == 1 else None for m in members]
        with executor._state.condition:  # the workers wait until every job is submitted
            futures = [executor.submit_fused(m, name=m[0].name) for m in members]
        every = [[future.result(timeout=300) for future in job] for job in futures]
        devices = executor.devices
    results = [job[0] for job in every]
    chains = [shard_chain(spec.name, plan, spec.total_steps,
                          eval_rows=0 if spec.eval_data is None else len(spec.eval_data),
                          eval_every=spec.eval_every, memory_plan=memory_plan,
                          num_members=len(m))
              for spec, plan, memory_plan, m in zip(specs, plans, memory, members, strict=True)]
    if swap:
        assert all(m is not None and all(s.codes == "S" * len(s.decisions) for s in m.shards)
                   for spec, m in zip(specs, memory, strict=True) if spec.name not in fused)
    return chains, results, devices, timeline.records, every


#: Per mix of jobs: the names of the jobs of one shard, of the fused arrays of one stacked shard
#: (K = ``ARRAY_K``), the devices' budget (bytes). Two jobs of one shard on one device: a step
#: with its state beside it has no room for the other job's kept weights and state, which are
#: evicted (written back) and promoted again. a of one shard (a smaller batch: another
#: architecture) beside b spilled: a's step evicts b's kept shard 0; a's weights and state stay
#: beside b's tasks. a a fused array of one stacked shard (a smaller batch) beside b spilled:
#: the array's steps keep its K members' weights and state, and b's shard 0 beside them.
MIXES = {"spilled": ((), (), BUDGET), "one-shard": (("a", "b"), (), 1_800_000),
         "mixed": (("a",), (), 1_300_000), "fused": ((), ("a",), 4_000_000)}


@pytest.mark.parametrize(("opt_name", "evaluate", "swap", "mix"),
                         [("sgd", False, False, "spilled"), ("sgd", True, False, "spilled"),
                          ("adamw-clip", False, False, "spilled"),
                          ("adamw-clip", True, False, "spilled"),
                          ("sgd", False, True, "spilled"), ("adamw-clip", True, True, "spilled"),
                          ("adamw", False, False, "one-shard"), ("sgd", True, False, "one-shard"),
                          ("adamw-clip", True, False, "one-shard"),
                          ("adamw", False, False, "mixed"), ("adamw-clip", True, False, "mixed"),
                          ("adamw", False, False, "fused"), ("adamw-clip", True, False, "fused"),
                          ("sgd", True, True, "fused")])
def test_simulated_swap_volume_equals_the_measured_one_on_one_device(
    opt_name: str, evaluate: bool, swap: bool, mix: str
) -> None:
    # Round-robin on one device hands out the same tasks in the same order whatever their
    # seconds, so the executor and the simulator keep the same shards resident: b keeps its
    # shard 0 between steps once a has finished. 3 and 5 steps: the chains' first steps (no
    # optimizer state yet, no deferred update), steady steps and last step all run; with
    # evaluation (every 2 steps, at step 0 and at the end) the passes and the deferred updates
    # they apply run too. With ``swap``, memory plans (mu-TWO) swap activations: offloaded in
    # forward tasks (the last shard: in its backward task), fetched in backward tasks. A job
    # of one shard keeps its weights and optimizer state across its steps (an evaluation sends
    # the state home) and writes them back once, when evicted or at its end.
    fit, fused, budget = MIXES[mix]
    extra = {} if evaluate else {"eval_data": None}
    specs = [tiny_spec(opt_name, name="a", seed=1, max_steps=3, **extra),
             tiny_spec(opt_name, name="b", seed=2, max_steps=5, **extra)]
    if mix in ("mixed", "fused"):
        specs[0] = dataclasses.replace(specs[0], batch_size=2)
    chains, results, [device], _, every = run_together(specs, 1, "round-robin", swap=swap,
                                                       budget=budget, fit=fit, fused=fused)
    assert [c.step_tasks[0].kind == "step" for c in chains] == [
        s.name in (*fit, *fused) for s in specs]
    for spec, job in zip(specs, every, strict=True):
        members = fused_members(spec, ARRAY_K) if spec.name in fused else [spec]
        for member, result in zip(members, job, strict=True):
            assert_weights(result.state_dict, train_plain(member, Device("cpu")).state_dict,
                           exact=False)
    simulated = simulate(RoundRobin(1, device_bytes=budget), chains,
                         CostModel(bandwidth_bytes_per_s=math.inf))
    assert simulated.device_promote_bytes == (device.transfers.promote_bytes,)
    assert simulated.device_demote_bytes == (device.transfers.demote_bytes,)
    assert simulated.swap_bytes == sum(r.swap_bytes for r in results)
    assert simulated.num_promotes < sum(c.num_tasks for c in chains)  # b kept its shard 0


@pytest.mark.parametrize(("opt_name", "swap", "mix"),
                         [("sgd", False, "spilled"), ("adamw-clip", False, "spilled"),
                          ("adamw-clip", True, "spilled"), ("adamw", False, "mixed"),
                          ("adamw", False, "fused")])
def test_simulated_swap_volume_equals_the_measured_one_per_device(
    opt_name: str, swap: bool, mix: str
) -> None:
    # Task parallelism pins each job to one device; which device gets which job depends on
    # which worker asks first, so devices are matched through the job they ran. ``swap``:
    # under memory plans that swap every activation. ``mix``: as in the test above (a of one
    # shard keeps its weights and state on its device across its steps).
    fit, fused, budget = MIXES[mix]
    specs = [tiny_spec(opt_name, name="a", seed=1, eval_data=None, max_steps=3),
             tiny_spec(opt_name, name="b", seed=2, eval_data=None, max_steps=4)]
    if mix in ("mixed", "fused"):
        specs[0] = dataclasses.replace(specs[0], batch_size=2)
    chains, results, devices, records, _ = run_together(
        specs, 2, "task-parallel-fifo", swap=swap, budget=budget, fit=fit, fused=fused)
    simulated = simulate(TaskParallelFIFO(2, device_bytes=budget), chains,
                         CostModel(bandwidth_bytes_per_s=math.inf))
    real = {r.job: [d.name for d in devices].index(r.device) for r in records}
    sim = {g.job_id: g.device for g in simulated.gantt}
    assert sorted(real.values()) == sorted(sim.values()) == [0, 1]  # one job per device
    for spec in specs:
        measured = devices[real[spec.name]].transfers
        assert simulated.device_promote_bytes[sim[spec.name]] == measured.promote_bytes
        assert simulated.device_demote_bytes[sim[spec.name]] == measured.demote_bytes
    assert simulated.swap_bytes == sum(r.swap_bytes for r in results)


#: A device budget that fits the largest planned peak of a job planned for ``BUDGET`` (with the
#: residency cache's margin) and another job's shard 0 kept beside it.
ROOMY = 600_000


@pytest.mark.parametrize(("opt_name", "evaluate", "swap"),
                         [("sgd", False, False), ("adamw-clip", False, False),
                          ("sgd", True, False), ("adamw-clip", True, True)])
def test_two_jobs_keep_their_shards_beside_each_other_when_the_device_has_room(
    opt_name: str, evaluate: bool, swap: bool
) -> None:
    # Round-robin interleaves a's and b's tasks on one device. Each keeps its shard 0 from its
    # backward to its next step's forward (or evaluation pass); on a device with room for a
    # task beside the other job's kept shard, both stay resident across the other job's tasks.
    # The simulator, given the same budget, keeps the same shards: equal bytes, not
    # approximately. The tasks' planned peaks are the memory plans' with ``swap``, and an
    # evaluation pass's where a task runs one.
    extra = {} if evaluate else {"eval_data": None}
    specs = [tiny_spec(opt_name, name="a", seed=1, max_steps=3, **extra),
             tiny_spec(opt_name, name="b", seed=2, max_steps=5, **extra)]
    measured, simulated_promotes = {}, {}
    for budget in (BUDGET, ROOMY):
        chains, results, [device], records, _ = run_together(specs, 1, "round-robin",
                                                             swap=swap, budget=budget)
        for spec, result in zip(specs, results, strict=True):
            assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict,
                           exact=False)
        assert max(r.peak_bytes for r in records) <= budget  # the kept shards metered too
        simulated = simulate(RoundRobin(1, device_bytes=budget), chains,
                             CostModel(bandwidth_bytes_per_s=math.inf))
        assert simulated.device_promote_bytes == (device.transfers.promote_bytes,)
        assert simulated.device_demote_bytes == (device.transfers.demote_bytes,)
        assert simulated.swap_bytes == sum(r.swap_bytes for r in results)
        measured[budget] = sum(r.num_promotes for r in results)  # deferred updates' too
        simulated_promotes[budget] = simulated.num_promotes
    # on ROOMY no step boundary loses its shard 0 to the other job's tasks
    num_tasks = sum(c.num_tasks for c in chains)
    step_boundaries = sum(spec.total_steps - 1 for spec in specs)
    assert simulated_promotes[ROOMY] == num_tasks - step_boundaries
    saved = simulated_promotes[BUDGET] - simulated_promotes[ROOMY]
    assert measured[BUDGET] - measured[ROOMY] == saved > 0


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_a_job_of_one_shard_kept_resident_moves_its_weights_and_state_once(opt_name: str) -> None:
    """A job that fits (one shard) keeps weights and optimizer state on its device between steps.

    Only evaluations (forward tasks, no update) send the optimizer state home; the numbers are
    plain training's, bit for bit.
    """
    spec = tiny_spec(opt_name, name="resident", max_steps=5, eval_every=2)
    device = VirtualDevice("cpu:0", budget_bytes=64 * 2**20)
    plan = plan_job(spec, device)
    assert len(plan.shards) == 1 and not plan.spill
    job = SpilledJob(spec, plan)
    while (task := job.next_task()) is not None:
        job.run(task, device, keep=True)
    result = job.result()
    assert device.meter.live_bytes == 0
    assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict)
    assert job.store.num_promotes == 1 and \
        job.store.num_resident_hits == len(job.bookkeeping.step_swap_bytes) + 3
    baseline = train_spilled(spec, VirtualDevice("cpu:1", budget_bytes=64 * 2**20), plan)
    # each task of the baseline promotes the weights (9 tasks), and each of its 5 updates
    # moves the state and writes the weights back; here the weights move once each way and the
    # state once per run of updates between evaluations (3); token ids move alike
    assert baseline.num_promotes == 9
    assert result.swap_bytes * 2 < baseline.swap_bytes


class _TriedLock:
    """A job's lock that tells when a thread other than the test's tries to take it."""

    def __init__(self) -> None:
        self.inner = threading.Lock()
        self.tried = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.tried.set()
        return self.inner.acquire(blocking, timeout)

    def release(self) -> None:
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def test_a_prefetch_of_a_job_busy_elsewhere_leaves_before_another_job_runs_there() -> None:
    # Job "x" prefetched its next shard onto the device (as the lookahead of the task before),
    # then its lock is taken elsewhere (its task on another device, say) as job "y" comes to
    # the device. Its copies must leave before y's task runs: y's plan counts the device as
    # its own, and nothing else frees them until x runs again.
    x_spec = tiny_spec("sgd", name="x", seed=1, eval_data=None, max_steps=2)
    y_spec = tiny_spec("sgd", name="y", seed=2, eval_data=None, max_steps=1)
    with ShardExecutor(f"cpu:1x{BUDGET}", plan_activations=False) as executor:
        [device] = executor.devices
        x = SpilledRun("x", x_spec, executor.plan(x_spec), None, None)
        x.prefetch(device, BUDGET)
        assert device.meter.live_bytes > 0  # its next shard's copies
        lock = x.lock = _TriedLock()  # type: ignore[assignment]
        executor._state.prefetched_on[0] = x
        lock.inner.acquire()  # x is busy elsewhere
        future = executor.submit(y_spec)
        assert lock.tried.wait(timeout=300)  # y's worker came for x's copies
        lock.inner.release()
        future.result(timeout=300)
        assert device.meter.live_bytes == 0  # x's copies left (y's task freed its own)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("fits", [True, False])
def test_jobs_of_one_shard_under_sharp_stay_resident_while_they_fit(
    opt_name: str, fits: bool
) -> None:
    """Two jobs of one shard (S = 1: a step per task) share one device under Sharded-LRTF.

    Each keeps its weights and optimizer state on the device across its steps. With room for
    one's step beside what the other keeps, both stay: each promotes its weights once. Without
    it, the other job's step evicts the kept one (written back) and it is promoted again; the
    numbers are plain training's either way.
    """
    specs = [tiny_spec(opt_name, name="r1", seed=1, eval_data=None, max_steps=4),
             tiny_spec(opt_name, name="r2", seed=2, eval_data=None, max_steps=3)]
    probe = plan_job(specs[0], VirtualDevice("cpu:9", budget_bytes=64 * 2**20))
    [shard] = probe.shards
    step_peak = (shard.backward_peak_bytes + shard.optimizer_bytes) * (1 + PEAK_MARGIN)
    kept = shard.param_bytes + shard.optimizer_bytes
    budget = int(step_peak + kept) + 1 if fits else int(step_peak) + 1
    timeline = Timeline()
    with ShardExecutor(f"cpu:1x{budget}", spill="always", plan_activations=False,
                  on_task=timeline) as executor:
        plan = executor.plan(specs[0])
        assert len(plan.shards) == 1
        with executor._state.condition:  # the worker waits until both jobs are submitted
            futures = [executor.submit(spec) for spec in specs]
        results = [future.result(timeout=300) for future in futures]
        [device] = executor.devices
    assert device.meter.live_bytes == 0
    assert max(r.peak_bytes for r in timeline.records) <= budget
    for spec, result in zip(specs, results, strict=True):
        assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict)
        training = [r for r in timeline.records if r.job == spec.name and r.kind != "demote"]
        assert [(r.kind, r.shard, r.step) for r in training] == [
            ("backward", 0, s) for s in range(spec.total_steps)]
    # In whatever order the device ran them: when the other's step fits beside what a job
    # keeps, it is promoted once; when it does not, that step evicts the job's shard (written
    # back) and the job is promoted once per unbroken run of its steps.
    ran = sorted((r for r in timeline.records if r.kind != "demote"), key=lambda r: r.start_s)
    real_runs = num_runs(r.job for r in ran)
    assert [r.num_promotes for r in results] == [
        1 if fits else real_runs[spec.name] for spec in specs]
    assert sum(r.kind == "demote" for r in timeline.records) == sum(
        r.num_promotes - 1 for r in results)
    # The order is what Sharded-LRTF decides from the chains and the seconds the tasks took:
    # replayed (deterministic), r1 runs steps after r2 started, and the simulated residency
    # cache promotes as the executor's does.
    chains = [shard_chain(spec.name, plan, spec.total_steps) for spec in specs]
    replayed = replay(ShardedLRTF(1, device_bytes=budget), chains,
                      recorded_durations(timeline.records, chains))
    assert_one_task_at_a_time(replayed)
    order = [job for _, job, _ in hand_out_order(replayed)]
    assert "r1" in order[order.index("r2"):]
    runs = num_runs(order)
    if fits:  # each kept its shard beside the other's steps: promoted once
        assert replayed.num_promotes == len(specs)
    else:  # evicted by the other's step each time: promoted again each time it came back
        assert replayed.num_promotes == sum(runs.values()) > len(specs)


#: A budget between the planned peaks of a step of a job of one shard with and without its
#: optimizer state beside it (with the residency cache's margin), beside another such job's
#: kept weights and state.
BETWEEN = 2_000_000


def test_a_job_of_one_shard_on_another_device_makes_room_without_the_state_it_left() -> None:
    # Round-robin on two devices moves jobs of one shard from device to device. A job's step on
    # the other device finds its weights and state written back first (they were kept where its
    # step before ran): its planned peak there is its step's alone, not with the state beside
    # it, so a shard another job keeps there stays at this budget (asserted on the chains'
    # tasks in a fixed order). The executor's evictions, in whatever order its workers ran the
    # tasks, are the residency cache's on those tasks replayed on the devices and in that order
    # (the simulator's rule), and each moves what the chain says it keeps.
    specs = [tiny_spec("adamw", name=name, seed=i + 1, eval_data=None, max_steps=4)
             for i, name in enumerate("abc")]
    probe = plan_job(specs[0], VirtualDevice("cpu:9", budget_bytes=FITS))
    [shard] = probe.shards
    kept = shard.param_bytes + shard.optimizer_bytes
    alone = shard.backward_peak_bytes * (1 + PEAK_MARGIN)
    with_state = (shard.backward_peak_bytes + shard.optimizer_bytes) * (1 + PEAK_MARGIN)
    assert alone + kept <= BETWEEN < with_state + kept
    chains, results, devices, records, _ = run_together(specs, 2, "round-robin",
                                                        budget=BETWEEN, fit=("a", "b", "c"))
    for spec, result in zip(specs, results, strict=True):
        assert_weights(result.state_dict, train_plain(spec, Device("cpu")).state_dict,
                       exact=False)
    a, b = chains[:2]
    fixed = Residency([BETWEEN, BETWEEN])
    for device, chain in ((0, a), (1, b)):  # each keeps its shard and state after its step 0
        assert fixed.task_starts(device, chain.task(0)) == []
        assert fixed.task_ended(device, chain.task(0), chain.task(1)) == kept
    # a's step 1 on device 1: its state went home from device 0, b's shard stays beside it
    assert fixed.task_peak_bytes(1, a.task(1)) == shard.backward_peak_bytes
    assert fixed.task_starts(1, a.task(1)) == []
    assert fixed.keys(0) == [] and fixed.keys(1) == [(b.job_id, 0), (a.job_id, 0)]
    names = [d.name for d in devices]
    by_job = {chain.job_id: chain for chain in chains}
    residency = Residency([BETWEEN] * len(devices))
    evicted = []
    for r in sorted((r for r in records if r.kind != "demote"), key=lambda r: r.start_s):
        chain, device = by_job[r.job], names.index(r.device)
        task = chain.task(r.step)
        evicted += [(job_id, device) for job_id, _ in residency.task_starts(device, task)]
        following = chain.task(task.index + 1) if task.index + 1 < chain.num_tasks else None
        residency.task_ended(device, task, following)
    demotes = [r for r in records if r.kind == "demote"]
    assert sorted(evicted) == sorted((r.job, names.index(r.device)) for r in demotes)
    for r in demotes:  # the evicted job's weights and state, written back
        assert r.swap_bytes == by_job[r.job].task(r.step).write_back_bytes == kept
