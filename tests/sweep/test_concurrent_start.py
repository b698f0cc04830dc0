"""Launches and a worker started at the same instant on a fresh database all start cleanly.

Each round (two per backend) creates a fresh database (a SQLite file, a PostgreSQL schema) and
starts two ``sweepmaster launch`` processes and one ``sweepmaster worker`` of the same sweep at
once. Table creation (Optuna's and sweepmaster's) and the sweep's first records are serialized
by the database's schema lock, so no process fails on a half-created schema; the worker either
joins or, when it looked before any launch had created the database or the sweep, says so in
one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


def _start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sweepmaster", *args], cwd=cwd, env=_env(),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(2))
def test_two_launches_and_a_worker_start_together_on_a_fresh_database(
        storage_url: str, round_: int, tmp_path: Path) -> None:
    url = storage_url
    raw = tiny_sweep(tmp_path, "together", storage=url,
                     train={"max_steps": 1, "eval_every": 1},
                     resources={"devices": "cpu"})
    path = write_sweep(tmp_path, raw)
    procs = [_start("launch", str(path), cwd=tmp_path), _start("launch", str(path), cwd=tmp_path),
             _start("worker", "--storage", url, "--sweep", "together", "--devices", "cpu",
                    cwd=tmp_path)]
    outputs = [p.communicate(timeout=600) for p in procs]
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]
    for _, _, err in results:
        assert "Traceback" not in err and "already exists" not in err, err[-3000:]
    assert [rc for rc, _, _ in results[:2]] == [0, 0], [err[-2000:] for _, _, err in results]
    worker_rc, _, worker_err = results[2]
    too_early = ("no sweep 'together'", "to join: launch the sweep there first")
    assert worker_rc == 0 or (worker_rc == 2 and len(worker_err.strip().splitlines()) == 1
                              and any(m in worker_err for m in too_early)), worker_err
    study = optuna.load_study(study_name="together", storage=url)
    cells = Counter((t.params["train.lr"], t.params["train.batch_size"])
                    for t in study.get_trials(states=(TrialState.COMPLETE,)))
    assert set(cells.values()) == {1} and len(cells) == 4
