"""Trial heartbeat and stale-trial retry on a real SQLite study; train.checkpoint_every."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from sweepmaster import study as study_manager
from sweepmaster.config import load_sweep_config
from sweepmaster.errors import ConfigError
from sweepmaster.sweep.resume import (
    TrialHeartbeat,
    fail_stale,
    original_trial_number,
    resume_state_dir,
)
from tests.kit.sweeps import tiny_sweep, write_sweep


def _config(tmp_path: Path, **train):
    raw = tiny_sweep(tmp_path, train=train,
                     resources={"trial_heartbeat": {"interval_s": 1, "grace_period_s": 1}})
    return load_sweep_config(write_sweep(tmp_path, raw))


def test_a_stale_trial_is_failed_and_its_grid_cell_retried_once(tmp_path: Path) -> None:
    config = _config(tmp_path)
    study, _ = study_manager.open_study(config, config.storage)
    trial = study_manager.next_trial(study, config, 4)
    assert trial is not None
    with TrialHeartbeat(study._storage) as heartbeat:
        heartbeat.add(trial._trial_id)
        time.sleep(2.5)
        assert fail_stale(study) == 0  # alive: its heartbeat is recorded every second
    time.sleep(2.5)  # the "process" died: no heartbeat since
    assert fail_stale(study) == 1 and fail_stale(study) == 0
    assert study.trials[0].state == TrialState.FAIL
    retry = study_manager.next_trial(study, config, 4)
    assert retry is not None and retry.params == trial.params
    assert original_trial_number(retry) == 0
    sweep_dir = Path(config.output.dir) / "tiny-0123abcd"
    assert resume_state_dir(sweep_dir, 0) == sweep_dir / "state" / "trial-0"
    others = [study_manager.next_trial(study, config, 4) for _ in range(3)]
    assert all(t is not None for t in others)
    cells = [(t.params["train.lr"], t.params["train.batch_size"]) for t in [retry, *others]]
    assert len(set(cells)) == 4  # the retried cell is not handed out again
    assert study_manager.next_trial(study, config, 4) is None


def test_checkpoint_every_defaults_to_the_eval_cadence(tmp_path: Path) -> None:
    assert _config(tmp_path).train.checkpoint_steps() == 3  # eval_every of the tiny sweep
    assert _config(tmp_path, checkpoint_every=2).train.checkpoint_steps() == 2
    assert _config(tmp_path, checkpoint_every=False).train.checkpoint_steps() is None
    with pytest.raises(ConfigError, match=r"train\.checkpoint_every: expected a positive integer"):
        _config(tmp_path, checkpoint_every=0)


def test_a_joining_process_adopts_the_trial_heartbeat_the_sweep_was_created_with(
        tmp_path: Path) -> None:
    first = _config(tmp_path)  # interval 1 s, grace 1 s
    study, used = study_manager.open_study(first, first.storage)
    assert used is first
    raw = tiny_sweep(tmp_path, resources={"trial_heartbeat": {"interval_s": 30}})
    joining = load_sweep_config(write_sweep(tmp_path, raw))
    joined, adopted = study_manager.open_study(joining, joining.storage)
    assert joined.study_name == study.study_name
    assert adopted.resources.trial_heartbeat == first.resources.trial_heartbeat
    assert joined._storage.get_heartbeat_interval() == 1  # what the heartbeat thread records at
    assert joining.resources.trial_heartbeat.interval_s == 30  # the caller's config is untouched


def test_a_process_never_fails_the_trials_it_keeps_alive(tmp_path: Path) -> None:
    """Its heartbeat may be stale only because the database was away: it is still training."""
    config = _config(tmp_path)
    study, _ = study_manager.open_study(config, config.storage)
    trial = study_manager.next_trial(study, config, 4)
    assert trial is not None
    with TrialHeartbeat(study._storage) as heartbeat:
        heartbeat.add(trial._trial_id)
    while not study._storage._get_stale_trial_ids(study._study_id):
        time.sleep(0.2)  # its heartbeat goes stale, as during an outage
    assert fail_stale(study, keep={trial._trial_id}) == 0
    assert study.trials[0].state == TrialState.RUNNING
    assert fail_stale(study) == 1  # another process (or a later launch) fails it


def test_a_trial_failed_by_another_worker_is_dropped_and_its_retry_runs(tmp_path: Path) -> None:
    """Another worker failed a live trial as stale (this one could not reach the database)."""
    import copy

    import optuna

    from sweepmaster.store import create_store_engine, get_sweep, trial_progress
    from sweepmaster.sweep import SweepObserver, run_sweep

    config = _config(tmp_path, max_steps=6)
    taken: list[int] = []

    class TakeOverOnce(SweepObserver):
        def trial_step(self, number, event):  # type: ignore[no-untyped-def]
            if taken:
                return
            taken.append(number)
            study = optuna.load_study(study_name="tiny", storage=config.storage)
            frozen = next(t for t in study.trials if t.number == number)
            study._storage.set_trial_state_values(frozen._trial_id, TrialState.FAIL)
            callback = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3)
            callback(study, copy.deepcopy(study._storage.get_trial(frozen._trial_id)))

    outcome = run_sweep(config, observer=TakeOverOnce())
    assert outcome.status == "completed"
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    cells = {(t.params["train.lr"], t.params["train.batch_size"]) for t in complete}
    assert len(cells) == len(complete) == 4
    assert [t.number for t in study.trials if t.state == TrialState.FAIL] == taken
    engine = create_store_engine(config.storage)
    sweep = get_sweep(engine, "tiny")
    assert sweep is not None
    row = next(r for r in trial_progress(engine, sweep.id) if r.trial_number == taken[0])
    engine.dispose()
    assert row.state == "FAIL" and "failed by another worker" in (row.failure_reason or "")


def test_each_launch_honours_its_own_max_retry(tmp_path: Path) -> None:
    first = _config(tmp_path)  # max_retry 3 (the default)
    study_manager.open_study(first, first.storage)
    raw = tiny_sweep(tmp_path, resources={"trial_heartbeat": {
        "interval_s": 1, "grace_period_s": 1, "max_retry": 10}})  # --set ...max_retry=10
    relaunch = load_sweep_config(write_sweep(tmp_path, raw))
    study, used = study_manager.open_study(relaunch, relaunch.storage)
    assert used.resources.trial_heartbeat.max_retry == 10
    assert study._storage.get_heartbeat_stale_trial_callback().max_retry == 10
