"""What a sweep records of its retries: history, links, lost workers, missing weights."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import optuna
import sqlalchemy as sa
from fastapi.testclient import TestClient
from optuna.trial import TrialState
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.dashboard import create_app
from sweepmaster.store import (
    ProgressRecorder,
    create_store_engine,
    get_or_create_sweep,
    upgrade_to_head,
)
from sweepmaster.store.models import Worker, utcnow
from sweepmaster.store.trial_links import trial_links
from sweepmaster.store.workers import list_workers, register_worker
from sweepmaster.sweep import run_sweep
from sweepmaster.sweep.results import load_results
from sweepmaster.sweep.resume import RetryCrashedTrial, continue_series, enqueue_retry
from tests.kit.sweeps import tiny_sweep, write_sweep


def _study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s")


def _ask_waiting(study: optuna.Study) -> optuna.Trial:
    trial = study.ask()
    assert study._storage.get_trial(trial._trial_id).system_attrs.get("retry_history") \
        or trial.user_attrs.get("retry_of") is not None
    return trial


def _crash(study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
    return study._storage.get_trial(trial._trial_id)


def test_a_resumed_retry_has_the_whole_curve_of_its_series(tmp_path: Path) -> None:
    study = _study(tmp_path)
    first = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)})
    continue_series(first, 0)
    for step in (5, 10, 15):  # killed after step 17: its checkpoint of step 16 survives
        first.report(1.0 / step, step)
    enqueue_retry(study, _crash(study, first))
    second = _ask_waiting(study)
    continue_series(second, 16)
    assert second.params == first.params
    second.report(1.0 / 20, 20)  # killed again at step 22, its checkpoint of step 20 survives
    enqueue_retry(study, _crash(study, second))
    third = _ask_waiting(study)
    continue_series(third, 20)
    for step in (25, 30):
        third.report(1.0 / step, step)
    assert study._storage.get_trial(third._trial_id).intermediate_values == {
        step: 1.0 / step for step in (5, 10, 15, 20, 25, 30)}


def test_crashes_count_only_without_progress(tmp_path: Path) -> None:
    study = _study(tmp_path)
    callback = RetryCrashedTrial(max_retry=1)
    trial = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    for start in (0, 4, 8, 12, 16):  # each attempt resumed from a later checkpoint: retried
        continue_series(trial, start)
        callback(study, _crash(study, trial))
        trial = _ask_waiting(study)
    continue_series(trial, 16)  # no progress: 2 crashes in a row from step 16 > max_retry 1
    callback(study, _crash(study, trial))
    assert not study.get_trials(states=(TrialState.WAITING,))


def test_a_retry_that_was_retried_links_to_its_own_retry(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=url, study_name="s")
    trial = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    numbers = [trial.number]
    for _ in range(3):
        enqueue_retry(study, _crash(study, trial))
        trial = _ask_waiting(study)
        numbers.append(trial.number)
    engine = create_store_engine(url)
    try:
        links = trial_links(engine, 1, study._study_id, numbers)
    finally:
        engine.dispose()
    assert links.retried_by == dict(zip(numbers[:-1], numbers[1:], strict=True))


def test_a_killed_worker_runs_no_trials(tmp_path: Path) -> None:
    engine = create_store_engine(f"sqlite:///{tmp_path / 'sweep.db'}")
    try:
        upgrade_to_head(engine)
        sweep_id = get_or_create_sweep(engine, "s", "s", "{}").id
        killed = register_worker(engine, sweep_id, "cpu", host="elsewhere", pid=11)
        recorder = ProgressRecorder(engine, sweep_id, worker_id=killed)
        recorder.trial_started(0, 1, 10, "cpu")  # its row stays RUNNING: kill -9
        recorder.flush()
        assert [w.num_running for w in list_workers(engine, sweep_id)] == [1]
        with engine.begin() as connection:
            connection.execute(sa.update(Worker).values(
                heartbeat_at=utcnow() - timedelta(seconds=600)))
        (worker,) = list_workers(engine, sweep_id, lost_after_s=30)
        assert (worker.status, worker.num_running) == ("lost", 0)
    finally:
        engine.dispose()


def test_deleted_best_weights_are_reported_missing(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, name="gone", train={"max_steps": 2, "eval_every": 2},
                     parameters={"train.lr": {"values": [1e-2]},
                                 "train.batch_size": {"values": [4]}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    assert run_sweep(config).num_finished == 1
    (best,) = load_results(config.storage, "gone").trials
    assert best.checkpoint_path is not None and best.missing_checkpoint is None
    shutil.rmtree(best.checkpoint_path)
    (best,) = load_results(config.storage, "gone").trials
    assert best.checkpoint_path is None and best.missing_checkpoint is not None
    result = CliRunner().invoke(app, ["status", "--storage", config.storage, "--sweep", "gone"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    assert f"best trial {best.number}: weights missing: {best.missing_checkpoint}" \
        in result.output.replace("\n", "")
    with TestClient(create_app(config.storage), base_url="http://127.0.0.1") as client:
        detail = client.get(f"/api/sweeps/gone/trials/{best.number}").json()
    assert detail["checkpoint_path"] == best.missing_checkpoint
    assert detail["checkpoint_missing"] is True
