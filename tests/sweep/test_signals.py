"""SIGTERM stops a launch as Ctrl-C does; a second signal while stopping breaks nothing.

Real ``python -m sweepmaster launch`` subprocesses on a SQLite file, signalled once a trial has
written a training-state checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from sweepmaster.config import load_sweep_config
from sweepmaster.study import INTERRUPTED_ATTR
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep

pytestmark = pytest.mark.slow


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    raw = tiny_sweep(tmp_path, name="signals",
                     train={"max_steps": 2000, "eval_every": 1000, "checkpoint_every": 4},
                     output={"dir": str(tmp_path / "out")},
                     parameters={"train.lr": {"values": [1e-2]},
                                 "train.batch_size": {"values": [4]}})
    path = write_sweep(tmp_path, raw)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launch = subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "out").glob("signals-*/state/trial-0/step-*.ckpt")):
        assert launch.poll() is None, launch.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    return launch, path


def _trial(path: Path) -> optuna.trial.FrozenTrial:
    config = load_sweep_config(path)
    (trial,) = optuna.load_study(study_name="signals", storage=config.storage).trials
    return trial


def test_sigterm_marks_the_trial_interrupted_and_exits_in_one_line(tmp_path: Path) -> None:
    launch, path = _start(tmp_path)
    launch.send_signal(signal.SIGTERM)
    output = launch.communicate(timeout=120)[0].decode()
    assert launch.returncode == 143, output[-3000:]
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("terminated (SIGTERM): the running trials")
    trial = _trial(path)
    assert trial.state == TrialState.FAIL and trial.system_attrs[INTERRUPTED_ATTR]
    assert trial.system_attrs["fail_reason"].startswith("terminated (SIGTERM)")


def test_a_second_ctrl_c_while_stopping_prints_no_traceback(tmp_path: Path) -> None:
    launch, path = _start(tmp_path)
    launch.send_signal(signal.SIGINT)
    for _ in range(20):  # more Ctrl-C while it stops, as an impatient user presses them
        time.sleep(0.02)
        if launch.poll() is not None:
            break
        launch.send_signal(signal.SIGINT)
    output = launch.communicate(timeout=120)[0].decode()
    assert launch.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    assert "KeyboardInterrupt" not in output, output[-3000:]
    trial = _trial(path)
    assert trial.state == TrialState.FAIL and trial.system_attrs[INTERRUPTED_ATTR]
