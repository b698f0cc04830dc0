"""Kill -9 a launch mid-sweep, launch again: every grid cell completes once, resumed exactly.

Real SQLite file, real ``python -m sweepmaster launch`` subprocesses. The first launch is killed
with SIGKILL once a trial has written a training-state checkpoint; its RUNNING trial's
heartbeat stops, the second launch fails it as stale (short grace period), Optuna's retry
callback re-queues it with its grid cell, and the retry resumes from the dead trial's
checkpoint and ends with the weights of an uninterrupted sweep's same trial (trained in this
process, on one intra-op thread as the launches are).
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
import sqlalchemy as sa
import torch
from optuna.trial import TrialState
from safetensors.torch import load_file

from sweepmaster.config import load_sweep_config
from sweepmaster.sweep import run_sweep
from sweepmaster.sweep.resume import original_trial_number, resume_state_dir
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep

pytestmark = pytest.mark.slow


def _sweep(tmp_path: Path, lrs: tuple[float, ...] = (1e-2, 3e-3, 1e-3)) -> dict:
    """The sweep's grid: one trial per learning rate in ``lrs``."""
    return tiny_sweep(
        tmp_path, name="crash",
        # 16 steps: the killed trial is 12 steps short of its end when its first checkpoint
        # (step 4) appears, and the retry resumes past it
        train={"max_steps": 16, "eval_every": 8, "checkpoint_every": 4},
        resources={"devices": "cpu", "trial_heartbeat": {"interval_s": 1, "grace_period_s": 2}},
        output={"dir": str(tmp_path / "out"), "save": "all"},
        parameters={"train.lr": {"values": list(lrs)},
                    "train.batch_size": {"values": [4]}},
    )


def _launch(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _sweep_dir(config) -> Path:
    (directory,) = Path(config.output.dir).glob(f"{config.name}-*")
    return directory


def _weights(config, number: int) -> dict[str, torch.Tensor]:
    return load_file(_sweep_dir(config) / f"trial-{number}" / "model.safetensors")


def test_sigkill_mid_sweep_then_relaunch_completes_every_cell_once(tmp_path: Path) -> None:
    path = write_sweep(tmp_path, _sweep(tmp_path))
    config = load_sweep_config(path)
    first = _launch(path)
    deadline = time.monotonic() + 120
    # Killed once the second trial has checkpointed (the first one has completed by then).
    while not list(Path(config.output.dir).glob("crash-*/state/trial-1/step-*.ckpt")):
        assert first.poll() is None, first.communicate()[0].decode()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()

    study = optuna.load_study(study_name="crash", storage=config.storage)
    before = {t.number: t.value for t in study.trials if t.state == TrialState.COMPLETE}
    killed = [t for t in study.trials if t.state == TrialState.RUNNING]
    assert len(killed) == 1
    killed_dir = resume_state_dir(_sweep_dir(config), killed[0].number)
    assert list(killed_dir.glob("step-*.ckpt"))

    second = _launch(path)
    output = second.communicate(timeout=300)[0].decode()
    assert second.returncode == 0, output[-3000:]

    study = optuna.load_study(study_name="crash", storage=config.storage)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(before) == 1
    assert sorted(t.params["train.lr"] for t in complete) == [1e-3, 3e-3, 1e-2]  # each cell once
    assert {n: v for n, v in ((t.number, t.value) for t in complete) if n in before} == before
    retry = next(t for t in complete if t.number not in before)
    assert original_trial_number(retry, study) == killed[0].number
    assert retry.system_attrs["failed_trial"] == killed[0].number
    assert retry.params == killed[0].params
    assert study.trials[killed[0].number].state == TrialState.FAIL
    assert not killed_dir.exists()  # the training state of a completed trial is deleted

    engine = sa.create_engine(config.storage)
    with engine.connect() as connection:
        first_step = connection.execute(sa.text(
            "SELECT MIN(m.step) FROM sm_metrics m JOIN sm_trial_progress p "
            "ON m.trial_progress_id = p.id WHERE p.trial_number = :n AND m.name = 'train_loss'"
        ), {"n": retry.number}).scalar_one()
        row = connection.execute(sa.text(
            "SELECT state, step FROM sm_trial_progress WHERE trial_number = :n"
        ), {"n": retry.number}).one()
    engine.dispose()
    assert first_step > 4 and first_step % 4 == 1  # resumed after a checkpoint, not step 0
    assert tuple(row) == ("COMPLETE", 16)
    assert "resumes from the checkpoint of step" in output

    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    # the retried cell alone, uninterrupted (every trial has the sweep's seed: same numbers)
    reference_path = write_sweep(reference_dir, _sweep(reference_dir, (retry.params["train.lr"],)))
    reference = load_sweep_config(reference_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the launches' OMP_NUM_THREADS=1: the same numbers
    try:
        assert run_sweep(reference).num_finished == 1
    finally:
        torch.set_num_threads(threads)
    ref_study = optuna.load_study(study_name="crash", storage=reference.storage)
    (ref_trial,) = ref_study.trials
    assert ref_trial.params == retry.params
    assert ref_trial.value == retry.value
    expected = _weights(reference, ref_trial.number)
    actual = _weights(config, retry.number)
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
