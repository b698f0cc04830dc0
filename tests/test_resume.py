"""Trial heartbeat and stale-trial retry on a real SQLite study; train.checkpoint_every."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from optuna.trial import TrialState
from sweep_fixtures import tiny_sweep, write_sweep

from sweepmaster import study as study_manager
from sweepmaster.config import load_sweep_config
from sweepmaster.errors import ConfigError
from sweepmaster.resume import TrialHeartbeat, fail_stale, original_trial_number, resume_state_dir


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
