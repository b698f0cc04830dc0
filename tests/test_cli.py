import os
import subprocess
import sys

import optuna
from sweep_fixtures import tiny_sweep, write_sweep


def sweepmaster(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sweepmaster", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})


def test_invalid_file_exits_2_with_one_line_and_writes_nothing(tmp_path):
    raw = tiny_sweep(tmp_path)
    raw["train"]["batch_size"] = "eight"
    path = write_sweep(tmp_path, raw, "bad.yaml")
    result = sweepmaster("launch", path, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "bad.yaml" in lines[0] and "train.batch_size" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "sweep.db").exists()
    assert not (tmp_path / "checkpoints").exists()


def test_missing_file_exits_2(tmp_path):
    result = sweepmaster("launch", tmp_path / "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "nope.yaml" in result.stderr


def test_launch_then_status_prints_the_table(tmp_path):
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    result = sweepmaster("launch", path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "COMPLETE" in result.stdout
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    best = study.best_trial

    status = sweepmaster("status", "--storage", storage, cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    table_lines = [line for line in status.stdout.splitlines() if "COMPLETE" in line]
    assert len(table_lines) == 4
    assert f"{best.value:.4f}" in table_lines[0]  # best first

    again = sweepmaster("launch", path, cwd=tmp_path)
    assert again.returncode == 0
    assert "nothing left to run" in again.stdout
    assert len(optuna.load_study(study_name="tiny", storage=storage).trials) == 4


def test_status_of_an_unknown_sweep_exits_2(tmp_path):
    storage = f"sqlite:///{tmp_path / 'x.db'}"
    assert sweepmaster("db", "upgrade", "--storage", storage, cwd=tmp_path).returncode == 0
    result = sweepmaster("status", "--storage", storage, "--sweep", "nope", cwd=tmp_path)
    assert result.returncode == 2
    assert "nope" in result.stderr


def test_validate_prints_the_search_space(tmp_path):
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    result = sweepmaster("validate", path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "train.lr" in result.stdout and "grid of 4" in result.stdout
    assert not (tmp_path / "sweep.db").exists()


def test_sigint_marks_the_running_trial_failed_and_exits_130(tmp_path):
    import signal
    import time

    from sweepmaster.store import create_store_engine, get_sweep, trial_progress

    raw = tiny_sweep(tmp_path, train={"max_steps": 100_000, "eval_every": 100_000})
    path = write_sweep(tmp_path, raw)
    proc = subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    deadline = time.monotonic() + 120
    rows = []
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if not (tmp_path / "sweep.db").exists():
            continue
        try:
            engine = create_store_engine(storage)
            sweep = get_sweep(engine, "tiny")
            rows = trial_progress(engine, sweep.id) if sweep else []
        except Exception:
            continue  # tables not created yet
        if rows and rows[0].step >= 2:
            break
    assert rows and rows[0].step >= 2, "the trial never started"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr

    engine = create_store_engine(storage)
    sweep = get_sweep(engine, "tiny")
    assert sweep.status == "interrupted"
    (row,) = trial_progress(engine, sweep.id)
    assert row.state == "FAIL" and "interrupted" in row.failure_reason
    (trial,) = optuna.load_study(study_name="tiny", storage=storage).trials
    assert trial.state == optuna.trial.TrialState.FAIL
