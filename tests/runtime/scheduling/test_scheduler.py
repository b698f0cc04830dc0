"""SHARP policies: Sharded-LRTF choice, affinity tie-break, lookahead, removal, invariants."""

from __future__ import annotations

import random
import threading

import pytest

from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.scheduling.policies import (
    ModelParallel,
    RandomPolicy,
    RoundRobin,
    ShardedLRTF,
    ShortestRemainingFirst,
    TaskParallelFIFO,
)
from sweepmaster.runtime.scheduling.residency import Residency
from sweepmaster.runtime.scheduling.scheduler import Policy
from tests.kit.data import ROOT
from tests.kit.policies import chain, each_policy


def unspilled(job_id: str, step_s: float, num_steps: int) -> JobSpec:
    return JobSpec.from_shards(job_id, num_steps, [step_s / 3], [2 * step_s / 3], [4], [12])


# --- JobSpec -------------------------------------------------------------------------------------

def test_from_shards_builds_the_hydra_chain():
    job = JobSpec.from_shards("a", 2, [1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [4, 5, 6], [12, 15, 18])
    assert job.num_tasks == 10
    step = [(t.shard, t.kind, t.est_seconds, t.promote_bytes, t.demote_bytes)
            for t in job.step_tasks]
    assert step == [(0, "forward", 1.0, 4, 0), (1, "forward", 2.0, 5, 0),
                    (2, "backward", 33.0, 18, 18), (1, "backward", 20.0, 15, 15),
                    (0, "backward", 10.0, 12, 12)]
    assert [t.index for t in job.tasks()] == list(range(10))
    assert job.task(7) == TaskSpec("a", 7, 2, "backward", 33.0, 18, 18)
    assert job.remaining_est_s(0) == pytest.approx(2 * 66.0)
    assert job.remaining_est_s(3) == pytest.approx(30.0 + 66.0)
    assert job.remaining_est_s(10) == 0.0


def test_one_shard_is_one_step_task_per_minibatch():
    job = JobSpec.from_shards("a", 3, [1.0], [2.0], [4], [12])
    assert [(t.kind, t.shard, t.est_seconds) for t in job.tasks()] == [("step", 0, 3.0)] * 3


@pytest.mark.parametrize("bad", [
    lambda: JobSpec("a", (), 1),
    lambda: JobSpec("a", (TaskSpec("a", 0, 0, "forward", 1.0, 0, 0),), 0),
    lambda: JobSpec("a", (TaskSpec("b", 0, 0, "forward", 1.0, 0, 0),), 1),
    lambda: JobSpec("a", (TaskSpec("a", 1, 0, "forward", 1.0, 0, 0),), 1),
    lambda: JobSpec("a", (TaskSpec("a", 0, 0, "forward", -1.0, 0, 0),), 1),
    lambda: JobSpec.from_shards("a", 1, [1.0, 1.0], [1.0], [1, 1], [1, 1]),
])
def test_invalid_jobs_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_residency_evicts_lru_by_bytes_with_one_copy_per_shard():
    res = Residency([1000, 1000])
    for key in (("a", 0), ("b", 0), ("c", 0)):
        res.keep(0, key, 200)
    # 400 B peak (460 B with the margin) + 600 B kept > 1000 B: the LRU shard goes
    assert res.make_room(0, ("d", 0), 400) == [("a", 0)]
    assert res.keys(0) == [("b", 0), ("c", 0)] and res.kept_bytes(0) == 400
    # a task of a held shard keeps it; only the others count against its peak
    assert res.make_room(0, ("b", 0), 700) == [("c", 0)] and res.holds(0, ("b", 0))
    assert res.make_room(0, ("e", 0), None) == [("b", 0)]  # an unknown peak takes the device
    res.keep(0, ("a", 1), 300)
    res.make_room(1, ("a", 1), 100)  # its task runs on device 1: one copy
    assert not res.holds(0, ("a", 1)) and res.kept_bytes(0) == 0
    res.keep(1, ("a", 1), 300)
    res.keep(1, ("f", 0), 300)
    res.drop_job("a")
    assert res.keys(1) == [("f", 0)]
    with pytest.raises(ValueError):
        Residency([0])


def test_residency_keeps_what_a_task_leaves_and_its_state_beside_the_next_task():
    # a's first step promotes its weights (10 B) and keeps them with the optimizer state it made
    # (30 B); its next step finds that state (20 B) beside its whole compute: with it, a peak of
    # 20 B needs 46 B beside c's 60 B kept, more than the 100 B there; without it, 23 B.
    res = Residency([100])
    first = TaskSpec("a", 0, 0, "step", 1.0, 10, 0, 0, 20, kept_bytes=30)
    second = TaskSpec("a", 1, 0, "step", 1.0, 30, 0, 0, 20, kept_bytes=30, state_bytes=20)
    c = [TaskSpec("c", i, 0, "step", 1.0, 60, 0, 0, 10) for i in range(2)]
    assert res.task_starts(0, first) == []
    assert res.task_ended(0, first, second) == 30 and res.kept_bytes(0) == 30
    assert res.task_starts(0, c[0]) == [] and res.task_ended(0, c[0], c[1]) == 60
    assert res.task_starts(0, second) == [("c", 0)]
    assert res.task_ended(0, second, None) is None and res.keys(0) == []
    res.task_starts(0, c[0])
    res.task_ended(0, c[0], c[1])
    assert res.task_starts(0, second) == []  # a's state went home with its shard: 23 B


def test_a_shard_stays_only_before_a_task_of_the_same_shard():
    spilled = JobSpec.from_shards("a", 2, [1.0, 1.0], [1.0, 1.0], [1, 1], [1, 1])
    tasks = list(spilled.tasks())  # forward 0, last 1, backward 0; twice
    stays = [Residency.stays(t, n) for t, n in zip(tasks, [*tasks[1:], None], strict=True)]
    assert stays == [False, False, True, False, False, False]


# --- Sharded-LRTF --------------------------------------------------------------------------------

def test_lrtf_runs_the_job_with_the_longest_remaining_time():
    policy = ShardedLRTF(1)
    for job in (chain("short", 1.0), chain("long", 2.0, 2.0), chain("mid", 3.0)):
        policy.add_job(job)
    order = []
    while (task := policy.next_task(0)) is not None:
        order.append((task.job_id, task.index))
        policy.task_done(task)
    # long (4 s) first, then mid (3 s) beats long's remaining 2 s, then long, then short
    assert order == [("long", 0), ("mid", 0), ("long", 1), ("short", 0)]
    assert policy.job_ids() == []


def test_affinity_breaks_ties_toward_the_resident_shard():
    policy = ShardedLRTF(2)
    policy.add_job(unspilled("a", 3.0, 2))
    policy.add_job(unspilled("b", 3.0, 2))
    ta, tb = policy.next_task(0), policy.next_task(1)
    assert (ta.job_id, tb.job_id) == ("a", "b")
    policy.task_done(ta)
    policy.task_done(tb)
    assert policy.remaining_s("a") == policy.remaining_s("b")
    # Without the tie-break device 1 would take "a" (earlier arrival); its shard is on device 0.
    assert policy.next_task(1).job_id == "b"
    assert policy.next_task(0).job_id == "a"


def test_an_evicted_shard_no_longer_breaks_ties():
    policy = ShardedLRTF(2)
    policy.add_job(unspilled("a", 3.0, 2))
    policy.add_job(unspilled("b", 3.0, 2))
    ta, tb = policy.next_task(0), policy.next_task(1)
    policy.task_done(ta)
    policy.task_done(tb)
    policy.evicted(1, "b", 0)  # device 1 did not keep b's shard: nothing resident there
    policy.evicted(0, "b", 0)  # not held there: nothing happens
    assert policy.is_resident(0, "a", 0) and not policy.is_resident(1, "b", 0)
    assert policy.next_task(1).job_id == "a"  # the earlier arrival, as without residency


def test_longer_remaining_time_beats_residency_unless_within_the_tolerance():
    for tolerance, expected in ((0.0, "long"), (5.0, "res")):
        policy = ShardedLRTF(1, tie_tolerance_s=tolerance)
        policy.add_job(unspilled("res", 10.0, 2))
        task = policy.next_task(0)
        policy.task_done(task)
        policy.add_job(unspilled("long", 12.0, 1))  # 12 s > 10 s remaining of "res"
        assert policy.next_task(0).job_id == expected


def test_measured_times_refine_the_remaining_time():
    policy = ShardedLRTF(1, ewma_alpha=0.5)
    policy.add_job(chain("a", 1.0, 1.0, 1.0, 1.0))
    policy.add_job(chain("b", 3.5))
    task = policy.next_task(0)
    assert task.job_id == "a" and policy.remaining_s("a") == pytest.approx(4.0)
    policy.task_done(task, measured_s=3.0)  # 3x slower than estimated
    assert policy.remaining_s("a") == pytest.approx(3.0 * 3)
    assert policy.remaining_s("b") == pytest.approx(3.5 * 3)  # unmeasured: like the others
    assert policy.next_task(0).job_id == "b"  # 10.5 s > 9 s
    policy.task_done(policy.running(0), measured_s=3.5)  # b as estimated: a is the slow one
    assert policy.remaining_s("a") == pytest.approx(9.0)  # its own measurement, not b's
    assert policy.job_ids() == ["a"]


def test_jobs_that_have_not_run_share_the_measured_slowdown():
    """A cost model 10x too fast must not make the running job look longest forever."""
    policy = ShardedLRTF(1)
    for job_id in ("a", "b"):
        policy.add_job(chain(job_id, 1.0, 1.0, 1.0, 1.0))
    order = []
    while (task := policy.next_task(0)) is not None:
        order.append(task.job_id)
        policy.task_done(task, measured_s=10.0 * task.est_seconds)
    assert order == ["a", "b", "a", "b", "a", "b", "a", "b"]  # they alternate, as estimated


def test_shortest_remaining_first_is_the_mirror_image():
    policy = ShortestRemainingFirst(1)
    policy.add_job(chain("long", 5.0))
    policy.add_job(chain("short", 1.0))
    assert policy.next_task(0).job_id == "short"


# --- lookahead -----------------------------------------------------------------------------------

def test_lookahead_reserves_the_named_job_for_the_device():
    policy = ShardedLRTF(2)
    policy.add_job(chain("a", 1.0, 1.0, 1.0))
    task = policy.next_task(0)
    ahead = policy.lookahead(0)
    assert (ahead.job_id, ahead.index, ahead.shard) == ("a", 1, 1)
    policy.add_job(chain("b", 5.0))  # longer, but device 0 committed to "a" (its prefetch)
    assert policy.lookahead(0) == ahead
    policy.task_done(task)
    policy.add_job(chain("c", 4.0))
    assert policy.next_task(1).job_id == "b"  # device 1 passes over the reserved "a"
    assert policy.next_task(0) == ahead


def test_an_idle_device_steals_a_reservation():
    policy = ShardedLRTF(2)
    policy.add_job(chain("a", 1.0, 1.0))
    policy.add_job(chain("b", 5.0))
    ta, tb = policy.next_task(0), policy.next_task(1)
    assert (ta.job_id, tb.job_id) == ("b", "a")
    assert policy.lookahead(1).job_id == "a"
    policy.task_done(tb)
    policy.task_done(ta)
    assert policy.next_task(0).job_id == "a"  # nothing else is ready: device 0 takes it
    assert policy.next_task(1) is None
    assert policy.lookahead(1) is None


def test_lookahead_without_reservation_only_guesses():
    policy = ShardedLRTF(1, reserve_lookahead=False)
    policy.add_job(chain("a", 1.0, 1.0, 1.0))
    task = policy.next_task(0)
    assert policy.lookahead(0).job_id == "a"
    policy.add_job(chain("b", 5.0))
    assert policy.lookahead(0).job_id == "b"  # the better guess now
    policy.task_done(task)
    assert policy.next_task(0).job_id == "b"


# ModelParallel may name a task that first waits for another device (pipeline prefetch).
@each_policy(but=(ModelParallel,))
def test_lookahead_of_each_policy_matches_its_next_choice_when_nothing_changes(cls):
    rng = random.Random(7)
    policy = cls(2)
    for j in range(5):
        policy.add_job(chain(f"j{j}", *[rng.uniform(0.5, 2.0) for _ in range(4)]))
    running = {d: policy.next_task(d) for d in range(2)}
    for _ in range(12):
        device = rng.randrange(2)
        ahead = policy.lookahead(device)
        if running[device] is not None:
            policy.task_done(running[device])
        running[device] = policy.next_task(device)
        assert running[device] == ahead, cls.name


# --- removal and misuse --------------------------------------------------------------------------

def test_removing_a_running_job_stops_it_after_its_task():
    policy = ShardedLRTF(2)
    policy.add_job(chain("a", 5.0, 5.0))
    policy.add_job(chain("b", 1.0))
    task = policy.next_task(0)
    assert policy.remove_job("a") and not policy.remove_job("a")
    assert policy.job_ids() == ["b"]
    with pytest.raises(ValueError, match="still running"):
        policy.next_task(0)
    assert policy.task_done(task) is False
    assert policy.next_task(0).job_id == "b"
    assert policy.next_task(1) is None
    assert not policy.remove_job("missing")


def test_misuse_raises_value_error():
    policy = ShardedLRTF(1)
    policy.add_job(chain("a", 1.0))
    with pytest.raises(ValueError, match="already scheduled"):
        policy.add_job(chain("a", 1.0))
    with pytest.raises(ValueError, match="not running"):
        policy.task_done(TaskSpec("a", 0, 0, "forward", 1.0, 0, 0))
    task = policy.next_task(0)
    with pytest.raises(ValueError, match="measured_s"):
        policy.task_done(task, measured_s=-1.0)
    assert policy.task_done(task, measured_s=1.0) is True
    with pytest.raises(ValueError):
        ShardedLRTF(0)


# --- baselines -----------------------------------------------------------------------------------

def drain(policy: Policy) -> list[tuple[int, str, int]]:
    """Run every task, devices taking turns; return (device, job, index) in hand-out order."""
    log = []
    while policy.job_ids():
        running = [policy.next_task(d) for d in range(policy.num_devices)]
        for device, task in enumerate(running):
            if task is not None:
                log.append((device, task.job_id, task.index))
                policy.task_done(task)
    return log


def test_task_parallel_fifo_pins_whole_jobs():
    policy = TaskParallelFIFO(2)
    for j in "abc":
        policy.add_job(chain(j, 1.0, 1.0))
    log = drain(policy)
    assert {d for d, j, _ in log if j == "a"} == {0}
    assert {d for d, j, _ in log if j == "b"} == {1}
    assert log.index((0, "c", 0)) > log.index((0, "a", 1))


def test_round_robin_cycles_over_jobs():
    policy = RoundRobin(1)
    for j in "abc":
        policy.add_job(chain(j, 1.0, 1.0))
    assert [j for _, j, _ in drain(policy)] == list("abcabc")


def test_random_policy_is_reproducible_per_seed():
    def run(seed):
        policy = RandomPolicy(2, seed=seed)
        for j in "abcdef":
            policy.add_job(chain(j, 1.0, 1.0, 1.0))
        return drain(policy)

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_model_parallel_runs_one_job_with_shards_pinned_to_devices():
    policy = ModelParallel(2)
    policy.add_job(JobSpec.from_shards("a", 1, [1.0] * 3, [1.0] * 3, [1] * 3, [3] * 3))
    policy.add_job(JobSpec.from_shards("b", 1, [1.0] * 3, [1.0] * 3, [1] * 3, [3] * 3))
    log = []
    while policy.job_ids():
        for device in range(2):
            task = policy.next_task(device)
            if task is not None:
                assert task.shard % 2 == device
                assert policy.next_task(1 - device) is None  # one task at a time
                log.append(task.job_id)
                policy.task_done(task)
    assert log == ["a"] * 5 + ["b"] * 5


# --- invariants under random arrival and completion ---------------------------------------

@each_policy()
@pytest.mark.parametrize("seed", range(8))
def test_invariants_under_random_arrival_and_completion(cls, seed):
    rng = random.Random(seed)
    num_devices = rng.randint(1, 4)
    policy = cls(num_devices)
    running: dict[int, TaskSpec] = {}
    done: dict[str, int] = {}  # job -> tasks completed
    jobs: dict[str, JobSpec] = {}
    removed: set[str] = set()
    for _ in range(400):
        op = rng.random()
        if op < 0.08 or not jobs:
            job_id = f"j{len(jobs)}"
            num_shards = rng.randint(1, 3)
            jobs[job_id] = JobSpec.from_shards(
                job_id, rng.randint(1, 3), [rng.uniform(0.1, 1)] * num_shards,
                [rng.uniform(0.1, 2)] * num_shards, [1] * num_shards, [3] * num_shards)
            done[job_id] = 0
            policy.add_job(jobs[job_id])
        elif op < 0.2:
            device = rng.randrange(num_devices)
            ahead = policy.lookahead(device)
            if ahead is not None:
                assert ahead.job_id not in removed
                busy = any(t.job_id == ahead.job_id for t in running.values())
                expected = done[ahead.job_id] + busy  # after its running task, if any
                assert ahead.index == expected
                assert ahead == jobs[ahead.job_id].task(ahead.index)
        elif op < 0.24:
            victim = rng.choice(sorted(jobs))
            assert policy.remove_job(victim) == (victim not in removed
                                                 and done[victim] < jobs[victim].num_tasks)
            removed.add(victim)
        elif op < 0.55:
            device = rng.randrange(num_devices)
            if device in running:
                with pytest.raises(ValueError):
                    policy.next_task(device)
                continue
            task = policy.next_task(device)
            if task is None:
                continue
            assert task.job_id not in removed
            assert all(t.job_id != task.job_id for t in running.values())  # one device per job
            assert task.index == done[task.job_id]  # dependency order
            assert task == jobs[task.job_id].task(task.index)
            running[device] = task
        elif running:
            device = rng.choice(sorted(running))
            task = running.pop(device)
            finished = policy.task_done(task, measured_s=task.est_seconds * rng.uniform(0.5, 2))
            done[task.job_id] += 1
            assert finished == (task.job_id not in removed
                                and done[task.job_id] == jobs[task.job_id].num_tasks)
        assert {d: policy.running(d) for d in running} == running  # one task per device
    for task in running.values():
        policy.task_done(task)
        done[task.job_id] += 1
    for _, job_id, index in drain(policy):
        assert index == done[job_id]
        done[job_id] += 1
    for job_id, job in jobs.items():
        assert job_id in removed or done[job_id] == job.num_tasks


def test_worker_threads_never_run_one_job_twice_at_once():
    policy = ShardedLRTF(4)
    for j in range(40):
        policy.add_job(JobSpec.from_shards(f"j{j}", 5, [1.0, 1.0], [1.0 + j % 3, 2.0], [1, 1],
                                           [3, 3]))
    guard = threading.Lock()
    active: set[str] = set()
    seen: dict[str, list[int]] = {}
    errors: list[str] = []

    def worker(device: int) -> None:
        while policy.job_ids():
            policy.lookahead(device)
            task = policy.next_task(device)
            if task is None:
                continue
            with guard:
                if task.job_id in active:
                    errors.append(f"{task.job_id} twice")
                active.add(task.job_id)
                seen.setdefault(task.job_id, []).append(task.index)
            with guard:
                active.discard(task.job_id)
            policy.task_done(task, measured_s=1.0)

    threads = [threading.Thread(target=worker, args=(d,)) for d in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(indices == list(range(15)) for indices in seen.values()) and len(seen) == 40


def test_scheduling_modules_do_not_import_torch():
    import ast

    scheduling = ROOT / "sweepmaster" / "runtime" / "scheduling"
    names = sorted(path.name for path in scheduling.glob("*.py"))
    assert {"scheduler.py", "simulate.py", "optimal.py"} <= set(names)
    for name in names:
        tree = ast.parse((scheduling / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("torch") for a in node.names), name
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("torch"), name
                assert not (node.module or "").startswith("sweepmaster.workload"), name
