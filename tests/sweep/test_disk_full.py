"""A full disk ends a launch in one line naming the path; nothing finished or kept is lost.

``output.dir`` is a small tmpfs mounted for the test (skipped where mounting is refused):
big enough for one trial's weights (a 1-layer GPT-2 of width 32: about 6.5 MB, mostly its
embedding) but not two, or too small for a training-state checkpoint. Real
``python -m sweepmaster launch`` subprocesses on a SQLite file outside the full filesystem.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from safetensors.torch import load_file

from sweepmaster.config import load_sweep_config
from sweepmaster.study import INTERRUPTED_ATTR
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A tmpfs of ``request.param`` (``"10m"``) at ``tmp_path / "out"``, unmounted after."""
    mount = tmp_path / "out"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _launch(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "sweepmaster", "launch", str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1]


def _intact(db: Path) -> None:
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("small_disk", ["10m"], indirect=True)
def test_weights_on_a_full_disk_keep_the_objective_and_the_kept_weights(
        tmp_path: Path, small_disk: Path) -> None:
    raw = tiny_sweep(tmp_path, name="full", train={"checkpoint_every": False},
                     output={"dir": str(small_disk), "save": "all"},
                     parameters={"train.lr": {"values": [1e-2, 3e-3]},
                                 "train.batch_size": {"values": [4]}})
    path = write_sweep(tmp_path, raw)
    done = _launch(path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _last_line(done)
    (sweep_dir,) = small_disk.glob("full-*")
    assert line.startswith(f"error: no space left on the device of {sweep_dir}/trial-"), line

    config = load_sweep_config(path)
    trials = optuna.load_study(study_name="full", storage=config.storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2  # both objectives recorded
    assert all(t.value is not None for t in trials)
    kept = sorted(p.name for p in sweep_dir.iterdir())
    assert kept == [f"trial-{trials[0].number}"]  # the first one's weights, nothing half-made
    assert load_file(sweep_dir / kept[0] / "model.safetensors")
    _intact(tmp_path / "sweep.db")

    again = _launch(path)  # nothing is trained again: the finished trials are recorded
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to run" in again.stdout


@pytest.mark.parametrize("small_disk", ["2m"], indirect=True)
def test_training_state_on_a_full_disk_stops_and_the_trial_resumes(
        tmp_path: Path, small_disk: Path) -> None:
    raw = tiny_sweep(tmp_path, name="full", train={"checkpoint_every": 2},
                     output={"dir": str(small_disk), "save": "none"},
                     parameters={"train.lr": {"values": [1e-2]},
                                 "train.batch_size": {"values": [4]}})
    path = write_sweep(tmp_path, raw)
    done = _launch(path)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _last_line(done)
    (sweep_dir,) = small_disk.glob("full-*")
    assert line.startswith(f"error: no space left on the device of {sweep_dir}/state/trial-0"), \
        line
    assert "training state of trial 0" in line
    assert not list(small_disk.rglob(".tmp-*"))  # no half-written checkpoint left
    config = load_sweep_config(path)
    (trial,) = optuna.load_study(study_name="full", storage=config.storage).trials
    assert trial.state == TrialState.FAIL and trial.system_attrs[INTERRUPTED_ATTR]
    _intact(tmp_path / "sweep.db")

    subprocess.run(["umount", "-l", str(small_disk)], check=True)  # space again
    again = _launch(path)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = optuna.load_study(study_name="full", storage=config.storage).trials
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]


@pytest.mark.parametrize("small_disk", ["8m"], indirect=True)
def test_a_full_database_disk_stops_in_one_line_and_the_sweep_resumes(
        tmp_path: Path, small_disk: Path) -> None:
    db = small_disk / "sweep.db"
    raw = tiny_sweep(tmp_path, name="full", storage=f"sqlite:///{db}",
                     train={"max_steps": 150, "eval_every": 50, "checkpoint_every": 50},
                     resources={"trial_heartbeat": {"interval_s": 1, "grace_period_s": 2}},
                     output={"dir": str(tmp_path / "weights"), "save": "none"},
                     parameters={"train.lr": {"values": [1e-2]},
                                 "train.batch_size": {"values": [4]}})
    path = write_sweep(tmp_path, raw)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    launch = subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    state = tmp_path / "weights"
    while not list(state.glob("full-*/state/trial-0/step-*.ckpt")):  # training, mid-trial
        assert launch.poll() is None, launch.communicate()[1][-3000:]
    filler = small_disk / "filler"
    with filler.open("wb") as file:  # the disk fills up under the running sweep
        try:
            while True:
                file.write(b"\0" * 65536)
                file.flush()
        except OSError:
            pass
    stdout, stderr = launch.communicate(timeout=600)
    assert launch.returncode == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: no space left on the device of {db}: cannot write the "
                           "sweep's database"), line
    filler.unlink()
    _intact(db)
    again = _launch(path)  # the trial resumes (failed as stale or as interrupted) and ends
    assert again.returncode == 0, again.stderr[-3000:]
    config = load_sweep_config(path)
    trials = optuna.load_study(study_name="full", storage=config.storage).trials
    assert [t.state for t in trials][-1] == TrialState.COMPLETE
