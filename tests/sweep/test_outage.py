"""A launch through a PostgreSQL outage: survived within the retry window, one line past it.

The launch reaches the real server through a TCP forwarder on 127.0.0.1 that the test cuts
(every connection dropped, new ones refused) and restores. Heartbeat and retry settings are
short, so an outage longer than the trial heartbeat's grace period and shorter than
``SWEEPMASTER_STORAGE_RETRY_S`` takes seconds. Launches under an outage are real
``python -m sweepmaster launch`` processes; the relaunch that finishes a sweep afterwards runs
:func:`~sweepmaster.sweep.run_sweep` in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState

from sweepmaster.config import load_sweep_config
from sweepmaster.sweep import run_sweep
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep
from tests.kit.tcp_proxy import TcpProxy

CELLS = {(lr, b) for lr in (1e-2, 3e-3) for b in (2, 4)}

pytestmark = pytest.mark.postgres


def _sweep_file(tmp_path: Path) -> Path:
    raw = tiny_sweep(tmp_path, "outage",
                     # the first evaluation (step 2) starts the cut: 6 steps of the trial are
                     # left, and 3 more trials
                     train={"max_steps": 8, "eval_every": 2, "checkpoint_every": 2},
                     resources={"devices": "cpu",
                                "trial_heartbeat": {"interval_s": 1, "grace_period_s": 2}})
    return write_sweep(tmp_path, raw)


def _launch(path: Path, url: str, retry_s: float,
            statement_timeout_s: float | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "OMP_NUM_THREADS": "1",
           "SWEEPMASTER_STORAGE_RETRY_S": str(retry_s)}
    if statement_timeout_s is not None:
        env["SWEEPMASTER_STATEMENT_TIMEOUT_S"] = str(statement_timeout_s)
    return subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path),
                             "--storage", url], cwd=path.parent, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _via(url: str, port: int) -> str:
    return sa.make_url(url).set(host="127.0.0.1", port=port).render_as_string(
        hide_password=False)


def _trials(url: str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials, read through a connection closed on return.

    A pooled storage per call would keep its connections open until garbage collection, and
    the polls below would run the server out of connections (``too many clients``).
    """
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"poolclass": sa.pool.NullPool})
    try:
        return optuna.load_study(study_name="outage", storage=storage).get_trials()
    finally:
        storage.engine.dispose()


def _wait_for_an_evaluation(url: str, proc: subprocess.Popen[str]) -> None:
    """Until a trial has reported an intermediate value (it is training, mid-trial)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if any(t.intermediate_values for t in _trials(url)
                   if t.state == TrialState.RUNNING):
                return
        except (KeyError, sa.exc.SQLAlchemyError):
            pass  # the study is being created
        time.sleep(0.1)
    raise AssertionError("no trial reported within 300 s")


def _cells(url: str) -> Counter[tuple[float, int]]:
    return Counter((t.params["train.lr"], t.params["train.batch_size"])
                   for t in _trials(url) if t.state == TrialState.COMPLETE)


def test_an_outage_longer_than_the_grace_period_is_survived(postgres_url: str,
                                                            tmp_path: Path) -> None:
    path = _sweep_file(tmp_path)
    pg = sa.make_url(postgres_url)
    proxy = TcpProxy((pg.host or "127.0.0.1", pg.port or 5432))
    try:
        proc = _launch(path, _via(postgres_url, proxy.port), retry_s=60)
        _wait_for_an_evaluation(postgres_url, proc)
        proxy.cut()
        time.sleep(5.0)  # > the 2 s grace period: the trial's heartbeat goes stale meanwhile
        proxy.restore()
        out, err = proc.communicate(timeout=600)
    finally:
        proxy.close()
    assert proxy.num_refused > 0
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "UpdateFinishedTrialError" not in err
    assert set(_cells(postgres_url)) == CELLS and set(_cells(postgres_url).values()) == {1}
    assert [t.number for t in _trials(postgres_url) if t.state == TrialState.FAIL] == []


def test_an_outage_past_the_retry_window_ends_in_one_line_and_resumes(
        postgres_url: str, tmp_path: Path) -> None:
    path = _sweep_file(tmp_path)
    pg = sa.make_url(postgres_url)
    proxy = TcpProxy((pg.host or "127.0.0.1", pg.port or 5432))
    try:
        proc = _launch(path, _via(postgres_url, proxy.port), retry_s=2)
        _wait_for_an_evaluation(postgres_url, proc)
        proxy.cut()  # until the launch gives up
        out, err = proc.communicate(timeout=300)
    finally:
        proxy.close()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: cannot ") and "database unavailable" in lines[-1]
    assert not [t for t in _trials(postgres_url) if t.state == TrialState.COMPLETE
                and (t.params["train.lr"], t.params["train.batch_size"]) not in CELLS]

    again = run_sweep(load_sweep_config(path), storage=postgres_url)  # what launch runs
    assert again.status == "completed", again  # launch would exit 0
    assert set(_cells(postgres_url)) == CELLS and set(_cells(postgres_url).values()) == {1}


def test_a_silent_network_cut_ends_within_the_retry_window(postgres_url: str,
                                                           tmp_path: Path) -> None:
    """Packets stop, nothing is reset: the client's timeouts end every wait, then one line."""
    path = _sweep_file(tmp_path)
    pg = sa.make_url(postgres_url)
    proxy = TcpProxy((pg.host or "127.0.0.1", pg.port or 5432))
    try:
        proc = _launch(path, _via(postgres_url, proxy.port), retry_s=2, statement_timeout_s=2)
        _wait_for_an_evaluation(postgres_url, proc)
        proxy.blackhole()  # for good: only the client's timeouts can end the launch
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError("the launch still waits on a silent network after 240 s") \
                from None
    finally:
        proxy.close()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: cannot ") and "database unavailable" in lines[-1]

    again = run_sweep(load_sweep_config(path), storage=postgres_url)  # resumes afterwards
    assert again.status == "completed", again
    assert set(_cells(postgres_url)) == CELLS and set(_cells(postgres_url).values()) == {1}
