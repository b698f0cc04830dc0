"""Sweeps with resources.fusion: fused arrays of trials, recorded and told to Optuna per trial."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState
from sqlalchemy import select
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from sweepmaster import study as study_manager
from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.runtime.planning import fusion_degree
from sweepmaster.store import create_store_engine, get_sweep, metric_history, trial_progress
from sweepmaster.store.fusion import count_fusion_measurements, fusion_groups
from sweepmaster.store.models import TaskEvent
from sweepmaster.sweep import run_sweep
from tests.kit.sweeps import tiny_sweep, write_sweep

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _config(tmp_path: Path, name: str = "tiny", **sections):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path, name, **sections),
                                         f"{name}.yaml"))


def _by_params(config) -> dict[tuple, optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=config.name, storage=config.storage)
    return {tuple(sorted(t.params.items())): t for t in study.get_trials()}


def _timeline(engine, sweep_id):
    with engine.connect() as connection:
        return connection.execute(select(TaskEvent).where(TaskEvent.sweep_id == sweep_id)).all()


def test_fused_sweep_equals_the_same_trials_unfused(tmp_path: Path) -> None:
    save = {"output": {"dir": str(tmp_path / "checkpoints"), "save": "all"}}
    plain = _config(tmp_path / "plain", **save)
    fused = _config(tmp_path / "fused", resources={"fusion": 2}, **save)
    assert run_sweep(plain).num_finished == 4
    outcome = run_sweep(fused)
    assert (outcome.num_run, outcome.num_finished, outcome.num_failed) == (4, 4, 0)

    engine = create_store_engine(fused.storage)
    sweep = get_sweep(engine, "tiny")
    groups = fusion_groups(engine, sweep.id)
    assert len(groups) == 2 and all(len(members) == 2 for members in groups.values())
    assert sorted(n for members in groups.values() for n in members) == [0, 1, 2, 3]
    events = _timeline(engine, sweep.id)
    assert {e.job for e in events} == set(groups)  # one task per fused array, no trial alone
    assert {e.trial_number for e in events} == {None}

    expected, actual = _by_params(plain), _by_params(fused)
    assert expected.keys() == actual.keys()
    plain_engine = create_store_engine(plain.storage)
    plain_id = get_sweep(plain_engine, "tiny").id
    rows = {r.trial_number: r for r in trial_progress(engine, sweep.id)}
    for params, want in expected.items():
        got = actual[params]
        assert got.state == TrialState.COMPLETE
        assert got.value == pytest.approx(want.value, rel=1e-6)
        assert got.intermediate_values.keys() == want.intermediate_values.keys() == {3, 6}
        for step, value in want.intermediate_values.items():
            assert got.intermediate_values[step] == pytest.approx(value, rel=1e-6)
        history = metric_history(engine, sweep.id, got.number)
        want_history = metric_history(plain_engine, plain_id, want.number)
        assert [(s, n) for s, n, _ in history] == [(s, n) for s, n, _ in want_history]
        for (_, name, value), (_, _, want_value) in zip(history, want_history, strict=True):
            if name != "tokens_per_s":  # wall clock
                assert value == pytest.approx(want_value, rel=1e-5), name
        row = rows[got.number]
        assert row.state == "COMPLETE" and row.step == 6 and row.peak_device_bytes is None
        saved = AutoModelForCausalLM.from_pretrained(row.checkpoint_path).state_dict()
        reference = AutoModelForCausalLM.from_pretrained(
            want.user_attrs["checkpoint_path"]).state_dict()
        assert Path(row.checkpoint_path).parent != Path(want.user_attrs["checkpoint_path"]).parent
        for name, tensor in reference.items():  # fp32 sums in another order: Adam's normalized
            # step magnifies the differences of near-zero gradients up to a few 1e-5 in 6 steps
            torch.testing.assert_close(saved[name], tensor, rtol=0, atol=1e-4, msg=name)

    # the dashboard's devices page lists the arrays
    from fastapi.testclient import TestClient

    from sweepmaster.dashboard import create_app

    with TestClient(create_app(fused.storage), base_url="http://127.0.0.1") as client:
        body = client.get("/api/sweeps/tiny/fusion").json()
    assert body["available"] is True
    assert {g["job"]: g["trial_numbers"] for g in body["groups"]} == groups


def test_a_pruned_member_leaves_its_array_and_the_other_completes(tmp_path: Path) -> None:
    config = _config(
        tmp_path, resources={"fusion": 2},
        study={"sampler": "random", "n_trials": 1,
               "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0}},
        parameters={"train.lr": {"values": [1e-2, 3e-3, 1e-9]}, "train.batch_size": {"value": 4}},
    )
    study, _ = study_manager.open_study(config, config.storage)
    study.enqueue_trial({"train.lr": 3e-3})
    run_sweep(config)  # trial 0 trains alone: no other trial to fuse with
    study.enqueue_trial({"train.lr": 1e-2})  # better than trial 0 at step 3
    study.enqueue_trial({"train.lr": 1e-9})  # learns nothing: worse than the median at step 3
    outcome = run_sweep(config, n_trials=3)
    assert (outcome.num_run, outcome.num_finished) == (2, 3)

    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE,
                                         TrialState.PRUNED]
    assert trials[1].value < trials[0].value
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    assert fusion_groups(engine, sweep.id) == {"trials-1+2": [1, 2]}
    rows = {r.trial_number: r for r in trial_progress(engine, sweep.id)}
    assert rows[2].state == "PRUNED" and rows[2].step == 3
    assert rows[1].state == "COMPLETE" and rows[1].step == 6


def test_a_failing_member_fails_alone_in_a_sweep_with_fusion_4(tmp_path: Path) -> None:
    config = _config(tmp_path, resources={"fusion": 4},
                     parameters={"train.lr": {"values": [1e-2, 1e30, 3e-3]},
                                 "train.batch_size": {"value": 4}})
    outcome = run_sweep(config)
    assert (outcome.num_finished, outcome.num_failed) == (2, 1)
    states = {t.params["train.lr"]: t for t in _by_params(config).values()}
    assert states[1e30].state == TrialState.FAIL
    reason = states[1e30].system_attrs[study_manager.FAIL_REASON_ATTR]
    assert "FloatingPointError" in reason and "non-finite" in reason
    assert states[1e-2].state == states[3e-3].state == TrialState.COMPLETE
    assert all(math.isfinite(states[lr].value) for lr in (1e-2, 3e-3))
    engine = create_store_engine(config.storage)
    [members] = fusion_groups(engine, get_sweep(engine, "tiny").id).values()
    assert members == [0, 1, 2]  # K = 4 asked; the grid has 3 cells: one array of 3


def test_auto_measures_once_and_a_relaunch_reuses_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fusion_degree, "FUSION_MEASURE_SHARE", None)  # however short the job
    # batch 2: 55 MiB a trial; a 200 MiB device holds a fused array of 4 (173 MiB), not of 8
    config = _config(
        tmp_path, resources={"fusion": "auto", "devices": "cpu:1x200MiB"},
        study={"sampler": "random", "n_trials": 2},
        train={"batch_size": 2, "max_steps": 4, "eval_every": 2},
        parameters={"train.lr": {"min": 1e-3, "max": 1e-2, "distribution": "log_uniform_values"},
                    "train.batch_size": {"value": 2}},
    )
    assert run_sweep(config).num_finished == 2
    engine = create_store_engine(config.storage)
    assert count_fusion_measurements(engine) == 4  # K = 1, 2, 4 fit; K = 8 does not
    sweep = get_sweep(engine, "tiny")
    measures = [e for e in _timeline(engine, sweep.id) if e.kind == "measure"]
    assert len(measures) == 1 and measures[0].memory_bytes <= 200 * 2**20

    runner = CliRunner()
    shown = runner.invoke(app, ["plan", str(tmp_path / "tiny.yaml")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "cached measurement" in shown.output and "K=8: does not fit" in shown.output

    outcome = run_sweep(config, n_trials=4)
    assert (outcome.num_run, outcome.num_finished, outcome.num_failed) == (2, 4, 0)
    assert count_fusion_measurements(engine) == 4
    assert len([e for e in _timeline(engine, sweep.id) if e.kind == "measure"]) == 1
    trials = optuna.load_study(study_name="tiny", storage=config.storage).get_trials()
    assert all(t.state == TrialState.COMPLETE and sorted(t.intermediate_values) == [2, 4]
               for t in trials)


def test_plan_shows_the_fusion_degree_and_the_arrays(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fusion_degree, "FUSION_MEASURE_SHARE", None)  # however short the job
    runner = CliRunner()
    fixed = write_sweep(tmp_path, tiny_sweep(tmp_path, resources={"fusion": 2}), "fixed.yaml")
    shown = runner.invoke(app, ["plan", str(fixed)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "job 1 (batch_size=2) fusion on cpu: K = 2 as asked; its 2 trials form 1 fused " \
        "array of 2" in shown.output
    auto = write_sweep(tmp_path, tiny_sweep(tmp_path, resources={
        "fusion": "auto", "devices": "cpu:1x200MiB"}), "auto.yaml")
    shown = runner.invoke(app, ["plan", str(auto)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "K=? (auto)" in shown.output
    assert "not measured: launch measures K = 1, 2, 4, 8 on cpu:0 (or plan --measure-fusion)" \
        in shown.output
    off = runner.invoke(app, ["plan", str(write_sweep(tmp_path, tiny_sweep(tmp_path)))],
                        env={"COLUMNS": "200"})
    assert off.exit_code == 0 and "fusion on" not in off.output and "K=" not in off.output
    assert not (tmp_path / "sweep.db").exists()  # plan creates no database


def test_ctrl_c_in_a_fused_array_fails_its_members_and_relaunch_resumes(tmp_path: Path) -> None:
    from sweepmaster.sweep import SweepObserver

    class InterruptAt(SweepObserver):  # after step 4: both members checkpointed step 3
        def trial_step(self, number, event):
            if number == 1 and event.step == 4:
                raise KeyboardInterrupt

    class Steps(SweepObserver):
        def __init__(self) -> None:
            self.steps: dict[int, list[int]] = {}

        def trial_step(self, number, event):
            self.steps.setdefault(number, []).append(event.step)

    config = _config(tmp_path, resources={"fusion": 2},
                     parameters={"train.batch_size": {"value": 4}})
    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, observer=InterruptAt())
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.FAIL]
    for trial in study.get_trials():
        assert "interrupted" in trial.system_attrs[study_manager.FAIL_REASON_ATTR]
    engine = create_store_engine(config.storage)
    assert get_sweep(engine, "tiny").status == "interrupted"

    relaunch = Steps()
    outcome = run_sweep(config, observer=relaunch)
    assert (outcome.num_run, outcome.num_finished, outcome.num_failed) == (2, 2, 0)
    complete = [t for t in optuna.load_study(study_name="tiny", storage=config.storage)
                .get_trials() if t.state == TrialState.COMPLETE]
    assert sorted(t.params["train.lr"] for t in complete) == [3e-3, 1e-2]
    # Each retry resumed its member's checkpoint of step 3 instead of restarting at step 1.
    assert sorted(relaunch.steps) == sorted(t.number for t in complete)
    assert all(steps == [4, 5, 6] for steps in relaunch.steps.values()), relaunch.steps
