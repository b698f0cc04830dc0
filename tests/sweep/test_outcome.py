"""How a sweep ends: ``completed`` only when every trial it wants finished.

A sweep whose every trial failed ends ``failed``; one with a grid cell that failed, or that was
abandoned after ``max_retry`` heartbeat retries, ends ``incomplete``. ``launch`` exits with
code 1 then, and ``status`` names the cells.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sweepmaster import study as study_manager
from sweepmaster.config import load_sweep_config
from sweepmaster.sweep import run_sweep
from sweepmaster.sweep.results import load_results
from sweepmaster.sweep.resume import TrialHeartbeat, fail_stale
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep


def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sweepmaster", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def test_a_sweep_whose_every_trial_failed_ends_failed_and_launch_exits_1(
        tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={"train.lr": {"values": [1e30]},
                                           "train.batch_size": {"values": [2, 4]}})
    path = write_sweep(tmp_path, raw)
    launched = _cli("launch", path, cwd=tmp_path)
    assert launched.returncode == 1, launched.stderr[-3000:]
    assert "Traceback" not in launched.stderr
    assert "sweep tiny failed: 0 trial(s) finished" in launched.stdout
    results = load_results(raw["storage"], "tiny")
    assert results.status == "failed"
    assert [c.params for c in results.unfinished] == [
        {"train.batch_size": 2, "train.lr": 1e30}, {"train.batch_size": 4, "train.lr": 1e30}]
    assert all(c.num_failed == 1 and "nan" in (c.reason or "") for c in results.unfinished)
    status = _cli("status", "--storage", raw["storage"], "--sweep", "tiny", cwd=tmp_path)
    assert "cell not finished: train.batch_size=2, train.lr=1e+30 (failed 1 time(s): " \
        f"{results.unfinished[0].reason})" in status.stdout


def test_a_failed_cell_leaves_the_sweep_incomplete(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={"train.lr": {"values": [1e-2, 1e30]},
                                           "train.batch_size": {"values": [4]}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    outcome = run_sweep(config)
    assert outcome.status == "incomplete" and outcome.num_failed == 1
    results = load_results(config.storage, "tiny")
    assert results.status == "incomplete"
    assert [c.params for c in results.unfinished] == [{"train.batch_size": 4, "train.lr": 1e30}]


def test_a_cell_abandoned_after_max_retry_leaves_the_sweep_incomplete(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, resources={"devices": "cpu", "trial_heartbeat": {
        "interval_s": 1, "grace_period_s": 1, "max_retry": 0}})
    path = write_sweep(tmp_path, raw)
    config = load_sweep_config(path)
    study, _ = study_manager.open_study(config, config.storage)
    from sweepmaster.store import create_store_engine, get_or_create_sweep, upgrade_to_head

    engine = create_store_engine(config.storage)
    upgrade_to_head(engine)
    get_or_create_sweep(engine, "tiny", "tiny", config.canonical_text())
    engine.dispose()
    dead = study_manager.next_trial(study, config, 4)  # a process that dies mid-trial
    assert dead is not None
    with TrialHeartbeat(study._storage) as heartbeat:
        heartbeat.add(dead._trial_id)
    while fail_stale(study, keep={-1}) == 0:  # its heartbeat goes stale: failed, no retry
        time.sleep(0.2)

    launched = _cli("launch", path, cwd=tmp_path)
    assert launched.returncode == 1, launched.stderr[-3000:]
    assert "sweep tiny incomplete: 3 trial(s) finished" in launched.stdout
    results = load_results(config.storage, "tiny")
    assert results.status == "incomplete"
    assert [c.params for c in results.unfinished] == [dead.params]
    assert results.unfinished[0].num_failed == 1
    assert launched.stdout.count("cell not finished:") == 1
