"""Crashes of the process are not a trial's failures: a relaunch always finishes the sweep.

Real SQLite file, real ``python -m sweepmaster launch`` subprocesses, a fused array of three
trials (``resources.fusion: 3``) killed with SIGKILL four times, each time after its members
wrote a later training-state checkpoint. The fifth launch completes every cell: crashes after
which the trial made progress do not use up its ``max_retry`` retries.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from sweepmaster.config import load_sweep_config
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep

_STEP = re.compile(r"step-(\d{9})-")

pytestmark = pytest.mark.slow


def _launch(path: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path), *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _latest_steps(out: Path) -> dict[str, int]:
    """The newest checkpoint step of each trial series' state directory."""
    steps: dict[str, int] = {}
    for path in out.glob("crashy-*/state/trial-*/step-*.ckpt"):
        match = _STEP.match(path.name)
        assert match is not None
        steps[path.parent.name] = max(steps.get(path.parent.name, 0), int(match[1]))
    return steps


def test_four_kills_of_a_fused_array_then_a_relaunch_finishes_every_cell(tmp_path: Path) -> None:
    raw = tiny_sweep(
        tmp_path, name="crashy",
        train={"max_steps": 120, "eval_every": 40, "checkpoint_every": 4},
        resources={"devices": "cpu", "fusion": 3,
                   "trial_heartbeat": {"interval_s": 1, "grace_period_s": 2}},
        output={"dir": str(tmp_path / "out"), "save": "best"},
        parameters={"train.lr": {"values": [1e-2, 3e-3, 1e-3]},
                    "train.batch_size": {"values": [4]}},
    )
    path = write_sweep(tmp_path, raw)
    config = load_sweep_config(path)
    out = Path(config.output.dir)
    seen: dict[str, int] = {}
    for kill in range(4):
        launch = _launch(path)
        deadline = time.monotonic() + 300
        # killed once every series has a checkpoint later than before this launch
        while True:
            steps = _latest_steps(out)
            if len(steps) == 3 and all(steps[k] > seen.get(k, 0) for k in steps):
                break
            assert launch.poll() is None, launch.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, f"kill {kill}: no new checkpoints"
            time.sleep(0.01)
        launch.send_signal(signal.SIGKILL)
        launch.wait()
        seen = _latest_steps(out)
        assert max(seen.values()) < 120

    last = _launch(path)
    output = last.communicate(timeout=600)[0].decode()
    assert last.returncode == 0, output[-3000:]
    study = optuna.load_study(study_name="crashy", storage=config.storage)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["train.lr"] for t in complete) == [1e-3, 3e-3, 1e-2]
    assert not list(out.glob("crashy-*/state/**/.tmp-step-*"))
    for trial in study.trials:
        if trial.state == TrialState.FAIL:  # a crash: said so, not the trial's own failure
            assert "process" in trial.system_attrs["fail_reason"], trial.system_attrs
