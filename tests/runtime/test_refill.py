"""Fused arrays that refill: a member joins between steps and ends as if trained alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optuna
import pytest
import torch
from fastapi.testclient import TestClient
from optuna.trial import TrialState
from sqlalchemy import select
from typer.testing import CliRunner

from sweepmaster import study as study_manager
from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.dashboard import create_app
from sweepmaster.runtime import JobCancelledError, ShardExecutor
from sweepmaster.runtime.devices.device import VirtualDevice
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.scheduling.chains import TaskSpec
from sweepmaster.runtime.scheduling.policies import ShardedLRTF
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob, train_fused_spilled
from sweepmaster.runtime.training.plain import train_plain
from sweepmaster.store import create_store_engine, get_sweep, trial_progress
from sweepmaster.store.models import FusionGroupMember
from sweepmaster.sweep import run_sweep
from sweepmaster.workload import LoraSpec, OptimizerSpec, TrainSpec
from tests.kit import lora
from tests.kit.fused import (
    CPU,
    MARKS,
    TIGHT,
    Recorder,
    assert_close_states,
    assert_same_events,
    spec,
    train_array,
)
from tests.kit.fused import tiny_config as fusion_config
from tests.kit.spill import MiB
from tests.kit.sweeps import tiny_sweep, write_sweep

pytestmark = MARKS

#: A fused array that fits its device (one stacked shard holding the whole array, as the
#: executor plans it), or one that spills (stacked shards).
PATHS = ["resident", "spilled"]


def spilled_device(founders: list[TrainSpec], budget_bytes: int) -> VirtualDevice:
    """A virtual device on which the founders' fused array must spill (2+ stacked shards)."""
    device = VirtualDevice("cpu:0", budget_bytes=budget_bytes)
    assert len(plan_stacked(stacked_spec(founders), len(founders), device).shards) >= 2
    return device


def train_refilled(path: str, founders: list[TrainSpec], callbacks, refill,
                   budget_bytes: int = 3 * MiB // 2):
    """Train the founders as a fused array of ``path`` that ``refill`` refills: every result."""
    device = CPU if path == "resident" else spilled_device(founders, budget_bytes)
    plan = plan_stacked(stacked_spec(founders), len(founders), device, whole=path == "resident")
    assert (len(plan.shards) == 1) == (path == "resident")
    return train_fused_spilled(founders, device, plan, callbacks, refill=refill)


class PruneAt(Recorder):
    """Records every event and prunes at the first evaluation at or after ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_eval(self, event):
        super().on_eval(event)
        return event.step >= self.step


class Refill:
    """Hands out ``queue`` one member per free slot; records each call."""

    def __init__(self, queue: list[tuple[TrainSpec, TrainCallbacks | None]]) -> None:
        self.queue = list(queue)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, free: int, array_step: int):
        self.calls.append((free, array_step))
        taken, self.queue = self.queue[:free], self.queue[free:]
        return taken


def plain(member: TrainSpec, callbacks: TrainCallbacks | None = None):
    recorder = callbacks if callbacks is not None else Recorder()
    return train_plain(member, CPU, recorder), recorder


def fresh(callbacks: TrainCallbacks) -> TrainCallbacks:
    """A new receiver of the same kind (for the reference run)."""
    return PruneAt(callbacks.step) if isinstance(callbacks, PruneAt) else Recorder()


def assert_each_equals_plain(members, results, receivers, **tolerance) -> None:
    assert len(results) == len(members)
    for member, result, receiver in zip(members, results, receivers, strict=True):
        expected, reference = plain(member, fresh(receiver))
        assert result.steps == expected.steps and result.pruned == expected.pruned
        assert_close_states(result.state_dict, expected.state_dict, **tolerance)
        assert_same_events(receiver.events, reference.events)


SGD = [OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                     warmup_steps=2, schedule="linear"),
       OptimizerSpec(name="sgd", lr=0.1, grad_clip=0.3),
       OptimizerSpec(name="sgd", lr=0.02, momentum=0.5, schedule="cosine")]
ADAMW = [OptimizerSpec(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95), grad_clip=0.5,
                       schedule="cosine"),
         OptimizerSpec(lr=1e-2),
         OptimizerSpec(lr=5e-3, betas=(0.9, 0.99), schedule="linear", warmup_steps=1)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("opts", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_a_pruned_members_slot_is_refilled_and_every_member_equals_plain_training(
        opts, path) -> None:
    config = fusion_config(dropout=0.1)  # the joiner's dropout stream is its own too
    founders = [spec(1, opts[0], model=config, max_steps=6),
                spec(2, opts[1], model=config, max_steps=6)]
    joiners = [spec(3, opts[2], model=config, max_steps=5),
               spec(4, opts[1], model=config, max_steps=3, batch_size=3, eval_every=1)]
    receivers = [PruneAt(2), Recorder(), Recorder(), Recorder()]
    refill = Refill([(joiners[0], receivers[2]), (joiners[1], receivers[3])])
    results = train_refilled(path, founders, receivers[:2], refill)
    # trial-1 is pruned at step 2: trial-3 takes its slot; trial-2 ends at 6: trial-4 joins.
    assert refill.calls[:2] == [(1, 2), (1, 6)]
    assert [r.steps for r in results] == [2, 6, 5, 3] and results[0].pruned
    atol = 1e-6 if opts is SGD else 1e-2 * max(o.lr for o in opts)  # see test_fusion
    assert_each_equals_plain([*founders, *joiners], results, receivers, rtol=0, atol=atol)


@pytest.mark.parametrize("path", PATHS)
def test_members_join_an_emptied_array_and_end_hooks_see_joining_order(path) -> None:
    founders = [spec(1, max_steps=2)]
    joiners = [spec(5, max_steps=3), spec(6, max_steps=1)]
    ended: list[tuple[int, int]] = []
    refill = Refill([(j, None) for j in joiners])
    device = CPU if path == "resident" else spilled_device(founders, MiB // 2)
    job = SpilledFusedJob(founders, plan_stacked(founders[0], 1, device, whole=path == "resident"),
                          refill=refill, on_member_end=lambda i, r, e: ended.append((i, r.steps)))
    while (task := job.next_task()) is not None:
        job.run(task, device)
    results = [run.result for run in job.members.runs]
    assert ended == [(0, 2), (1, 3), (2, 1)]  # K = 1: one at a time, each in the free slot
    for member, result in zip([*founders, *joiners], results, strict=True):
        assert_close_states(result.state_dict, train_plain(member, CPU).state_dict, **TIGHT)


def test_a_member_that_cannot_join_fails_alone() -> None:
    other = spec(9, model=fusion_config(n_layer=1), max_steps=2)
    good = spec(8, max_steps=2)
    errors: dict[int, Exception] = {}

    def on_member_end(index, result, error):
        if error is not None:
            errors[index] = error

    results = train_array([spec(1, max_steps=2)], refill=Refill([(other, None), (good, None)]),
                          on_member_end=on_member_end)
    assert list(errors) == [1] and "cannot join" in str(errors[1])
    assert results[1] is None and results[2] is not None and results[2].steps == 2
    assert_close_states(results[2].state_dict, train_plain(good, CPU).state_dict, **TIGHT)


@pytest.mark.parametrize("path", PATHS)
def test_a_joined_member_resumes_from_its_checkpoint(tmp_path, path) -> None:
    member = spec(3, max_steps=6, state_dir=tmp_path / "state", checkpoint_every=2)
    class Die(TrainCallbacks):
        def on_step(self, event):
            if event.step == 5:
                raise RuntimeError("killed")

    assert train_array([member], [Die()]) == [None]  # it dies after its checkpoint at step 4
    recorder = Recorder()
    refill = Refill([(member, recorder)])
    results = train_refilled(path, [spec(1, max_steps=1)], None, refill, MiB // 2)
    assert results[1].steps == 6 and recorder.events[0][0] == "start"
    assert [e[1] for e in recorder.events if e[0] == "step"] == [5, 6]
    expected = train_plain(dataclasses.replace(member, state_dir=None, checkpoint_every=None), CPU)
    assert_close_states(results[1].state_dict, expected.state_dict, **TIGHT)


@pytest.mark.parametrize("path", PATHS)
def test_a_joiner_s_job_key_is_hashed_once(tmp_path, path, monkeypatch) -> None:
    # the key finds its checkpoint and names the ones it writes: one hash of the spec
    from sweepmaster.runtime.training import fused_members

    hashed: list[str] = []
    real = fused_members.job_key

    def counted(spec: TrainSpec) -> str:
        hashed.append(spec.name)
        return real(spec)

    monkeypatch.setattr(fused_members, "job_key", counted)
    member = spec(3, max_steps=2, state_dir=tmp_path / "state", checkpoint_every=2)
    results = train_refilled(path, [spec(1, max_steps=1)], None, Refill([(member, None)]),
                             MiB // 2)
    assert results[1].steps == 2
    assert hashed.count(member.name) == 1


# ---------------------------------------------------------------- the executor


class HandsOut(ShardedLRTF):
    """Sharded-LRTF that records each task it hands out."""

    def __init__(self, num_devices: int) -> None:
        super().__init__(num_devices)
        self.handed_out: list[TaskSpec] = []

    def next_task(self, device: int) -> TaskSpec | None:
        task = super().next_task(device)
        if task is not None:
            self.handed_out.append(task)
        return task


@pytest.mark.parametrize("path", PATHS)
def test_the_executor_refills_an_array_from_its_vacancy_hook(path) -> None:
    founders = [spec(1, max_steps=4), spec(2, max_steps=4)]
    queue = [spec(3, max_steps=3), spec(4, max_steps=2)]
    receivers = [PruneAt(2), Recorder()]
    joined: dict[str, object] = {}
    vacancies: list[tuple[str, int, int]] = []

    refused: list[ValueError] = []
    devices = "cpu:1x32MiB" if path == "resident" else f"cpu:1x{MiB}"
    policy = HandsOut(1)

    with ShardExecutor(devices, spill="auto" if path == "resident" else "always",
                  policy=policy) as executor:
        assert executor.will_spill(founders[0]) == (path == "spilled")
        def on_vacancy(job: str, free: int, array_step: int) -> None:
            vacancies.append((job, free, array_step))
            if len(vacancies) == 1:  # the array runs now: another optimizer kind cannot join
                with pytest.raises(ValueError, match="cannot join") as refusal:
                    executor.join_fused(job, spec(5, opt=OptimizerSpec(lr=1e-3)))
                refused.append(refusal.value)
            for _ in range(free):
                if queue:
                    member = queue.pop(0)
                    joined[member.name] = executor.join_fused(job, member, Recorder())

        futures = executor.submit_fused(founders, receivers, name="array",
                                        on_vacancy=on_vacancy)
        results = [f.result() for f in futures]
        # an array that fits its device is one stacked shard (S = 1): one task per step
        num_shards = len(executor.stacked_plan(founders[0], 2, whole=path == "resident").shards)
        assert (num_shards == 1) == (path == "resident")
    # read once the executor is closed: its vacancy hook may still run after the founders end
    late = {name: future.result() for name, future in joined.items()}
    assert len(refused) == 1
    # every step the joiners add past the founders' 4 is policy tasks
    assert len(policy.handed_out) == 6 * (2 * num_shards - 1)
    assert [t.index for t in policy.handed_out] == list(range(len(policy.handed_out)))
    assert executor.join_fused("array", spec(6)) is None  # it has ended
    # pruned at 2: trial-3 joins; trial-2 ends at 4: trial-4 joins; then none is left
    assert [v[1:] for v in vacancies][:2] == [(1, 2), (1, 4)] and vacancies[-1][1] == 2
    assert [r.steps for r in results] == [2, 4] and results[0].pruned
    assert {name: r.steps for name, r in late.items()} == {"trial-3": 3, "trial-4": 2}
    for member in [*founders[1:], spec(3, max_steps=3), spec(4, max_steps=2)]:
        result = results[1] if member.name == "trial-2" else late[member.name]
        assert_close_states(result.state_dict, train_plain(member, CPU).state_dict, **TIGHT)


# ---------------------------------------------------------------- LoRA


def lora_member(r: int, alpha: float, dropout: float, lr: float, **overrides) -> TrainSpec:
    return lora.member(r, alpha, dropout, lr, **overrides)


def test_a_lora_join_wider_than_the_array_s_plan_is_refused_and_the_array_trains_on() -> None:
    # The array fits its device: one stacked shard planned for rank 2 (the founders' widest).
    founders = [lora_member(2, 8.0, 0.0, 1e-2, max_steps=4),
                lora_member(2, 4.0, 0.0, 3e-3, max_steps=4)]
    wide = lora_member(4, 16.0, 0.0, 1e-2, max_steps=2)  # would pad the array to rank 4
    narrow = lora_member(2, 16.0, 0.0, 1e-2, max_steps=2)
    receivers = [PruneAt(2), Recorder(), Recorder()]
    answers: dict[str, object] = {}
    with ShardExecutor("cpu:1x2MiB") as executor:
        def on_vacancy(job: str, free: int, array_step: int) -> None:
            if not answers:  # trial 0 was pruned at step 2: one slot is free
                answers["wide"] = executor.join_fused(job, wide, Recorder())
                answers["narrow"] = executor.join_fused(job, narrow, receivers[2])

        futures = executor.submit_fused(founders, receivers[:2], name="array",
                                        on_vacancy=on_vacancy)
        results = [f.result() for f in futures]
        joined = answers["narrow"].result()
        assert len(executor.stacked_plan(executor.fused_spec(founders), 2,
                                         whole=True).shards) == 1
    assert answers["wide"] is None
    assert [r.steps for r in (*results, joined)] == [2, 4, 2] and results[0].pruned
    # the refusal changed nothing: every member, the narrow joiner too, equals training alone
    assert_each_equals_plain([*founders, narrow], [*results, joined], receivers,
                             rtol=1e-5, atol=1e-5)


def test_a_join_that_fails_midway_leaves_the_array_exactly_as_it_was() -> None:
    founders = [lora_member(2, 8.0, 0.0, 1e-2, max_steps=4),
                lora_member(2, 4.0, 0.0, 3e-3, max_steps=4),
                lora_member(2, 16.0, 0.0, 1e-2, max_steps=1)]  # leaves after step 1: a slot
    joiner = lora_member(8, 4.0, 0.1, 1e-2)  # the array is planned as wide as the joiner
    planned = stacked_spec([*founders, joiner])
    job = SpilledFusedJob(founders, plan_stacked(planned, 3, CPU, whole=True), planned=planned)
    job.run_step(CPU)
    while (task := job.next_task()) is not None and task.phase != "train":
        job.run(task, CPU)  # the step's evaluation: the boundary a join waits for
    assert job.members.stacked.num_members == 2
    other = SpilledFusedJob([joiner], plan_stacked(joiner, 1, CPU, whole=True))
    other.run_step(CPU)
    state = other.members.member_training_state(0)
    name = next(iter(state.optimizer))  # an optimizer state too large for its slot: the join
    moment = state.optimizer[name]["exp_avg"]  # fails after the array's tensors were grown
    state.optimizer[name]["exp_avg"] = torch.zeros(*(2 * n for n in moment.shape))
    shapes = {n: p.shape for n, p in job.members.stacked.params.items()}
    optimizer = {n: {k: v.clone() for k, v in entry.items()}
                 for n, entry in job.members.member_training_state(1).optimizer.items()}
    with pytest.raises(RuntimeError):
        job.members.stacked.join(joiner, state)
    assert job.members.stacked.num_members == 2 and \
        {n: p.shape for n, p in job.members.stacked.params.items()} == shapes
    after = job.members.member_training_state(1).optimizer
    for n, entry in optimizer.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(after[n][key]), torch.as_tensor(value)), n
    while (task := job.next_task()) is not None:
        job.run(task, CPU)
    for run, member in zip(job.members.runs, founders, strict=True):
        expected = train_plain(member, CPU).state_dict
        assert run.result is not None
        assert_close_states(run.result.state_dict, expected, rtol=1e-5, atol=1e-5)


def test_a_joiner_of_another_base_is_refused() -> None:
    founder = lora_member(2, 8.0, 0.0, 1e-2)
    job = SpilledFusedJob([founder], plan_stacked(founder, 1, CPU, whole=True))
    other = lora_member(2, 8.0, 0.0, 1e-2, peft=LoraSpec(r=2, target_modules=("c_attn",)))
    with pytest.raises(ValueError, match="cannot join"):
        job.members.stacked.join(other)
    assert job.members.stacked.num_members == 1


# ---------------------------------------------------------------- a sweep


def test_a_pruned_sweep_refills_its_fused_array_and_records_joins_and_leaves(
        tmp_path: Path) -> None:
    config = load_sweep_config(write_sweep(tmp_path, tiny_sweep(
        tmp_path, resources={"fusion": 2},
        study={"sampler": "random", "n_trials": 6,
               "pruner": {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 0}},
        parameters={"train.lr": {"values": [2e-2, 3e-3, 1e-9]},
                    "train.batch_size": {"value": 4}})))
    study, _ = study_manager.open_study(config, config.storage)
    for lr in (2e-2, 3e-3, 1e-9, 2e-2, 1e-9, 2e-2):  # 1e-9 learns nothing: pruned at step 3
        study.enqueue_trial({"train.lr": lr})
    outcome = run_sweep(config)
    assert (outcome.num_run, outcome.num_finished, outcome.num_failed) == (6, 6, 0)

    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    states = [t.state for t in trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED,
                      TrialState.COMPLETE, TrialState.PRUNED, TrialState.COMPLETE]
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    # Trials 0 and 1 found the array and end at its step 6; 2 and 3 take their slots; 2 is
    # pruned at its step 3 (the array's 9) and 4 takes its slot; 3 and 4 leave at 12, and 5
    # joins; once it ends at 18 Optuna has no more trials and the array ends.
    with engine.connect() as connection:
        rows = connection.execute(
            select(FusionGroupMember.job, FusionGroupMember.trial_number,
                   FusionGroupMember.joined_step, FusionGroupMember.left_step)
            .where(FusionGroupMember.sweep_id == sweep.id)
            .order_by(FusionGroupMember.trial_number)).all()
    assert [tuple(r) for r in rows] == [
        ("trials-0+1", 0, 0, 6), ("trials-0+1", 1, 0, 6), ("trials-0+1", 2, 6, 9),
        ("trials-0+1", 3, 6, 12), ("trials-0+1", 4, 9, 12), ("trials-0+1", 5, 12, 18)]
    progress = {r.trial_number: (r.state, r.step) for r in trial_progress(engine, sweep.id)}
    assert progress == {0: ("COMPLETE", 6), 1: ("COMPLETE", 6), 2: ("PRUNED", 3),
                        3: ("COMPLETE", 6), 4: ("PRUNED", 3), 5: ("COMPLETE", 6)}
    with TestClient(create_app(config.storage), base_url="http://127.0.0.1") as client:
        [group] = client.get("/api/sweeps/tiny/fusion").json()["groups"]
    assert group["trial_numbers"] == list(range(6))
    assert [(m["trial_number"], m["joined_step"], m["left_step"]) for m in group["members"]] \
        == [tuple(r)[1:] for r in rows]
    # the refilled trials equal the founders of the same learning rate (same seed and data)
    assert trials[3].value == pytest.approx(trials[0].value, rel=1e-5)
    assert trials[5].value == pytest.approx(trials[0].value, rel=1e-5)


# ---------------------------------------------------------------- spilled: the plan's bounds


def test_a_spilled_join_past_the_planned_k_or_rank_is_refused_and_changes_nothing() -> None:
    founders = [lora_member(2, 8.0, 0.0, 1e-2, max_steps=4),
                lora_member(4, 4.0, 0.0, 3e-3, max_steps=4)]
    wide = lora_member(8, 4.0, 0.0, 1e-2, max_steps=2)  # rank 8 > the planned R = 4
    narrow = lora_member(2, 16.0, 0.0, 1e-2, max_steps=2)
    extra = lora_member(4, 16.0, 0.0, 3e-3, max_steps=2)  # a third member: past K = 2
    device = spilled_device(founders, MiB // 2)
    receivers = [PruneAt(2), Recorder(), Recorder()]
    ended: dict[int, object] = {}
    shapes: list[dict[str, torch.Size]] = []

    def refill(free: int, array_step: int):
        if shapes:
            return []
        shapes.append({name: p.shape for name, p in job.members.stacked.params.items()})
        with pytest.raises(ValueError, match=r"rank 8.*wider than.*\(rank 4"):
            job.members.stacked.join(wide)
        assert {name: p.shape for name, p in job.members.stacked.params.items()} == shapes[0]
        assert job.members.stacked.num_members == 1 and len(job.members.runs) == 2
        return [(narrow, receivers[2]), (extra, None)]  # more than the free slot: one fails

    job = SpilledFusedJob(founders, plan_stacked(stacked_spec(founders), 2, device),
                          receivers[:2], refill=refill,
                          on_member_end=lambda i, r, e: ended.__setitem__(i, r or e))
    while (task := job.next_task()) is not None:
        job.run(task, device)
    assert isinstance(ended[3], ValueError) and "holds 2 members" in str(ended[3])
    results = [ended[i] for i in range(3)]
    assert [r.steps for r in results] == [2, 4, 2] and results[0].pruned
    assert_each_equals_plain([*founders, narrow], results, receivers, rtol=1e-5, atol=1e-5)


def test_a_sweep_refills_a_spilled_fused_array_and_records_the_join(tmp_path: Path) -> None:
    sweep_file = write_sweep(tmp_path, tiny_sweep(
        tmp_path, resources={"fusion": 2, "devices": "cpu:1x64MiB"}, train={"optimizer": "sgd"},
        study={"sampler": "random", "n_trials": 5},
        parameters={"train.lr": {"values": [2e-2, 3e-3]}, "train.batch_size": {"value": 4}}))
    shown = CliRunner().invoke(app, ["plan", str(sweep_file)], env={"COLUMNS": "200"})
    assert "fused array of 2 (stacked shards)" in shown.output, shown.output
    config = load_sweep_config(sweep_file)
    study, _ = study_manager.open_study(config, config.storage)
    for lr in (2e-2, 3e-3, 2e-2, 3e-3, 2e-2):
        study.enqueue_trial({"train.lr": lr})
    outcome = run_sweep(config)
    assert (outcome.num_run, outcome.num_finished, outcome.num_failed) == (5, 5, 0)
    engine = create_store_engine(config.storage)
    with engine.connect() as connection:
        rows = connection.execute(
            select(FusionGroupMember.job, FusionGroupMember.trial_number,
                   FusionGroupMember.joined_step, FusionGroupMember.left_step)
            .where(FusionGroupMember.sweep_id == get_sweep(engine, "tiny").id)
            .order_by(FusionGroupMember.trial_number)).all()
    # Spilled jobs share the device task by task: two arrays (0+1, 2+3) train at once. Trial 4
    # waits in the pool until one of them ends its members at step 6, then joins it there.
    *founders, joiner = [tuple(r) for r in rows]
    assert founders == [("trials-0+1", 0, 0, 6), ("trials-0+1", 1, 0, 6),
                        ("trials-2+3", 2, 0, 6), ("trials-2+3", 3, 0, 6)]
    assert joiner[0] in ("trials-0+1", "trials-2+3") and joiner[1:] == (4, 6, 12)
    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5
    # the joiner equals the founders of its learning rate (same seed and data)
    assert trials[4].value == pytest.approx(trials[0].value, rel=1e-5)
    assert trials[2].value == pytest.approx(trials[0].value, rel=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_an_array_planned_wider_than_its_founders_takes_a_joiner_of_that_rank(path) -> None:
    founders = [lora_member(2, 8.0, 0.0, 1e-2, max_steps=4),
                lora_member(2, 4.0, 0.0, 3e-3, max_steps=4)]
    planned = lora_member(8, 4.0, 0.1, 1e-2)  # the widest trial the sweep may ask
    # rank 8 > the founders' 2, and the first adapter with dropout: padded from the start
    joiner = lora_member(8, 4.0, 0.1, 1e-2, max_steps=3)
    device = CPU if path == "resident" else spilled_device([planned, planned], MiB // 2)
    receivers = [PruneAt(2), Recorder(), Recorder()]
    plan = plan_stacked(planned, 2, device, whole=path == "resident")
    job = SpilledFusedJob(founders, plan, receivers[:2],
                          refill=Refill([(joiner, receivers[2])]), planned=planned,
                          on_member_end=lambda i, r, e: ended.__setitem__(i, r or e))
    ended: dict[int, object] = {}
    adapters = job.members.stacked.params
    assert {p.shape[1] for n, p in adapters.items() if ".lora_A." in n} == {8}  # R = 8
    while (task := job.next_task()) is not None:
        job.run(task, device)
    results = [ended[i] for i in range(3)]
    assert [r.steps for r in results] == [2, 4, 3] and results[0].pruned
    assert_each_equals_plain([*founders, joiner], results, receivers, rtol=1e-5, atol=1e-5)


def test_a_cancelled_spilled_array_tells_its_vacancy_hook_it_has_ended() -> None:
    vacancies: list[tuple[str, int, int]] = []

    with ShardExecutor(f"cpu:1x{MiB}", spill="always") as executor:
        class CancelAt2(Recorder):
            def on_step(self, event):
                super().on_step(event)
                if event.step == 2:
                    executor.cancel("array")

        futures = executor.submit_fused(
            [spec(1, max_steps=6), spec(2, max_steps=6)], [CancelAt2(), None], name="array",
            on_vacancy=lambda job, free, step: vacancies.append((job, free, step)))
        for future in futures:
            with pytest.raises(JobCancelledError):
                future.result()
    # no member left before: the hook's one call is the last one, every slot free
    assert [v[:2] for v in vacancies] == [("array", 2)]
    assert executor.join_fused("array", spec(3)) is None
