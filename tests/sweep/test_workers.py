"""Several workers on one sweep: registration, heartbeats, lost workers, joining, outages.

Real databases only: SQLite files and the PostgreSQL server at 127.0.0.1:5432 (skipped without
one). Workers run as real ``python -m sweepmaster worker`` processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from sweepmaster import study as study_manager
from sweepmaster.config import load_sweep_config
from sweepmaster.store import create_store_engine, get_or_create_sweep, upgrade_to_head
from sweepmaster.store.models import Worker, utcnow
from sweepmaster.store.workers import (
    heartbeat,
    list_workers,
    mark_lost_workers,
    register_worker,
    this_host,
)
from sweepmaster.sweep.workers import WorkerSession, load_joined_config
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep
from tests.kit.tcp_proxy import TcpProxy


def _env() -> dict[str, str]:
    """Subprocesses import this checkout's sweepmaster, one intra-op thread each."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "OMP_NUM_THREADS": "1",
            "SWEEPMASTER_STORAGE_RETRY_S": "60"}


def sweepmaster(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweepmaster", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=_env(), timeout=600)


def start_worker(url: str, name: str, cwd: Path, *prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "sweepmaster", "worker", "--storage", url, "--sweep",
         name, "--devices", "cpu"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def new_sweep(url: str, tmp_path: Path, name: str = "grid", max_steps: int = 6,
              grace_period_s: int = 30) -> int:
    """Create the sweep (record and study) as ``launch`` does, without training; its id.

    The study records a 1 s trial heartbeat, which every process of the sweep adopts: a
    worker with nothing left to ask checks the trials of the others every second (not every
    10 s). The grace period is the default 30 s unless a test needs a dead worker's trial to
    go stale sooner.
    """
    raw = tiny_sweep(tmp_path, name, storage=url,
                     train={"max_steps": max_steps, "eval_every": max_steps},
                     resources={"trial_heartbeat": {"interval_s": 1,
                                                    "grace_period_s": grace_period_s}})
    raw["parameters"] = {"train.lr": {"values": [1e-2, 3e-3, 1e-3]},
                         "train.batch_size": {"values": [2, 4]}}
    config = load_sweep_config(write_sweep(tmp_path, raw))
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    study, _ = study_manager.open_study(config, url)
    info = get_or_create_sweep(engine, name, study.study_name, config.canonical_text())
    engine.dispose()
    return info.id


def grid_outcome(url: str, name: str = "grid") -> Counter[tuple[float, int]]:
    """How many COMPLETE trials each grid cell (lr, batch size) has."""
    import optuna

    study = optuna.load_study(study_name=name, storage=url)
    return Counter((t.params["train.lr"], t.params["train.batch_size"])
                   for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))


def trials_per_worker(url: str, name: str = "grid") -> dict[int, int]:
    engine = create_store_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text(
                "SELECT p.worker_id, count(*) FROM sm_trial_progress p JOIN sm_sweeps s "
                "ON s.id = p.sweep_id WHERE s.name = :name AND p.state = 'COMPLETE' "
                "GROUP BY p.worker_id"), {"name": name}).all()
    finally:
        engine.dispose()
    return {int(worker_id): int(count) for worker_id, count in rows if worker_id is not None}


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def count_running(url: str) -> int:
    engine = create_store_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(sa.text(
                "SELECT count(*) FROM sm_trial_progress WHERE state IN "
                "('RUNNING', 'COMPLETE')")).scalar_one())
    finally:
        engine.dispose()


EXPECTED_CELLS = {(lr, b) for lr in (1e-2, 3e-3, 1e-3) for b in (2, 4)}


# -- the registry ------------------------------------------------------------------------------
@pytest.fixture
def sweep_engine(storage_url: str):  # type: ignore[no-untyped-def]
    engine = create_store_engine(storage_url)
    upgrade_to_head(engine)
    info = get_or_create_sweep(engine, "s", "s", "{}")
    yield engine, info.id
    engine.dispose()


def test_session_registers_beats_and_stops(sweep_engine) -> None:  # type: ignore[no-untyped-def]
    engine, sweep_id = sweep_engine
    with WorkerSession(engine, sweep_id, "cpu:2x64MiB", interval_s=0.1,
                       lost_after_s=5) as session:
        wait_for(lambda: session.num_beats >= 3, 20, "three heartbeats")
        (worker,) = list_workers(engine, sweep_id)
        assert (worker.id, worker.host, worker.pid) == (session.worker_id, this_host(),
                                                        os.getpid())
        assert worker.devices == "cpu:2x64MiB"
        assert worker.status == "running"
        assert worker.heartbeat_at > worker.started_at
        assert worker.heartbeat_age_s < 5
    (worker,) = list_workers(engine, sweep_id)
    assert worker.status == "stopped"
    heartbeat(engine, worker.id)  # a late beat of a stopped worker changes nothing
    assert [(w.status, w.heartbeat_at) for w in list_workers(engine, sweep_id)] == [
        ("stopped", worker.heartbeat_at)]


def test_stale_heartbeat_reads_lost_and_is_marked_lost(sweep_engine) -> None:  # type: ignore[no-untyped-def]
    engine, sweep_id = sweep_engine
    fresh = register_worker(engine, sweep_id, "cpu", host="host-a", pid=11)
    stale = register_worker(engine, sweep_id, "cuda:0", host="host-b", pid=12)
    with engine.begin() as connection:
        connection.execute(sa.update(Worker).where(Worker.id == stale)
                           .values(heartbeat_at=utcnow() - timedelta(seconds=120)))
    states = {w.id: w.status for w in list_workers(engine, sweep_id, lost_after_s=30)}
    assert states == {fresh: "running", stale: "lost"}  # read as lost, not yet written
    assert mark_lost_workers(engine, sweep_id, lost_after_s=30) == [stale]
    with engine.connect() as connection:
        stored = dict(connection.execute(sa.select(Worker.id, Worker.status)).all())
    assert stored == {fresh: "running", stale: "lost"}
    assert mark_lost_workers(engine, sweep_id, lost_after_s=30) == []


def test_dead_pid_on_this_host_is_lost_at_once(sweep_engine) -> None:  # type: ignore[no-untyped-def]
    engine, sweep_id = sweep_engine
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = register_worker(engine, sweep_id, "cpu", pid=child.pid)
    alive = register_worker(engine, sweep_id, "cpu", pid=os.getppid())
    other_host = register_worker(engine, sweep_id, "cpu", host="elsewhere", pid=child.pid)
    assert mark_lost_workers(engine, sweep_id) == [dead]
    states = {w.id: w.status for w in list_workers(engine, sweep_id)}
    assert states == {dead: "lost", alive: "running", other_host: "running"}


def test_a_lost_worker_that_beats_again_is_running(sweep_engine) -> None:  # type: ignore[no-untyped-def]
    engine, sweep_id = sweep_engine
    with WorkerSession(engine, sweep_id, "cpu", interval_s=0.1, lost_after_s=5) as session:
        with engine.begin() as connection:
            connection.execute(sa.update(Worker).values(status="lost"))
        beats = session.num_beats
        wait_for(lambda: session.num_beats >= beats + 2, 20, "two more heartbeats")
        assert [w.status for w in list_workers(engine, sweep_id)] == ["running"]


# -- joining -----------------------------------------------------------------------------------
def test_worker_of_an_unknown_sweep_exits_2_listing_the_known_ones(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    new_sweep(url, tmp_path, "known")
    result = sweepmaster("worker", "--storage", url, "--sweep", "nope", cwd=ROOT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nope'" in lines[0] and "'known'" in lines[0], result.stderr


def test_worker_without_a_database_exits_2_and_creates_none(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing.db'}"
    result = sweepmaster("worker", "--storage", url, "--sweep", "grid", cwd=ROOT)
    assert result.returncode == 2 and "missing.db" in result.stderr, result.stderr
    assert not (tmp_path / "missing.db").exists()


def test_joined_config_needs_the_data_on_this_host(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    raw = tiny_sweep(tmp_path, "moved", storage=url)
    data = tmp_path / "data"
    shutil.copytree(Path(raw["data"]["dir"]), data)
    raw["data"]["dir"] = str(data)
    config = load_sweep_config(write_sweep(tmp_path, raw))
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    get_or_create_sweep(engine, "moved", "moved", config.canonical_text())
    joined = load_joined_config(url, "moved")
    assert joined.canonical_text() == config.canonical_text()  # joins, not a new sweep
    shutil.rmtree(data)
    result = sweepmaster("worker", "--storage", url, "--sweep", "moved", cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert "data.dir" in result.stderr and str(data) in result.stderr, result.stderr


@pytest.mark.slow
def test_launch_and_worker_share_a_sqlite_sweep_and_status_shows_both(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    new_sweep(url, tmp_path)  # the same sweep.yaml again: launch joins it
    first = subprocess.Popen(
        [sys.executable, "-m", "sweepmaster", "launch", str(tmp_path / "sweep.yaml"),
         "--storage", url, "--devices", "cpu"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    second = start_worker(url, "grid", ROOT)
    for proc in (first, second):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    outcome = grid_outcome(url)
    assert set(outcome) == EXPECTED_CELLS and set(outcome.values()) == {1}
    status = sweepmaster("status", "--storage", url, "--sweep", "grid", cwd=ROOT)
    assert status.returncode == 0, status.stderr
    assert "workers of sweep grid" in status.stdout
    assert status.stdout.count("stopped") == 2, status.stdout


# -- PostgreSQL: several workers, a cut connection, another host -------------------------------
@pytest.mark.slow
@pytest.mark.postgres
def test_two_workers_on_postgres_share_the_grid(postgres_url: str, tmp_path: Path) -> None:
    # 12 steps a trial: the first to start takes several trials' time to exhaust the grid, far
    # longer than the second takes to start beside it
    new_sweep(postgres_url, tmp_path, max_steps=12)
    workers = [start_worker(postgres_url, "grid", ROOT) for _ in range(2)]
    for proc in workers:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    outcome = grid_outcome(postgres_url)
    assert set(outcome) == EXPECTED_CELLS and set(outcome.values()) == {1}
    done = trials_per_worker(postgres_url)
    assert len(done) == 2 and all(n >= 1 for n in done.values()), done
    assert sum(done.values()) == len(EXPECTED_CELLS)


@pytest.mark.slow
@pytest.mark.postgres
def test_kill_one_worker_the_other_finishes_the_sweep(postgres_url: str, tmp_path: Path) -> None:
    # the victim's trial goes stale 5 s after the kill, not 30; 20 steps a trial: each worker
    # spends most of its time training, so the victim is killed mid-trial
    sweep_id = new_sweep(postgres_url, tmp_path, max_steps=20, grace_period_s=5)
    victim = start_worker(postgres_url, "grid", ROOT)
    survivor = start_worker(postgres_url, "grid", ROOT)
    try:
        wait_for(lambda: len(trials_per_worker(postgres_url)) >= 1
                 and count_running(postgres_url) >= 3, 300, "both workers to train")
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        _, err = survivor.communicate(timeout=600)
        assert survivor.returncode == 0, err
    finally:
        for proc in (victim, survivor):
            if proc.poll() is None:
                proc.kill()
    engine = create_store_engine(postgres_url)
    statuses = {w.pid: w.status for w in list_workers(engine, sweep_id)}
    engine.dispose()
    assert statuses == {victim.pid: "lost", survivor.pid: "stopped"}  # same host: pid probed
    outcome = grid_outcome(postgres_url)
    assert set(outcome) == EXPECTED_CELLS and set(outcome.values()) == {1}


def _via(url: str, host: str, port: int) -> str:
    return sa.make_url(url).set(host=host, port=port).render_as_string(hide_password=False)


@pytest.mark.slow
@pytest.mark.postgres
def test_worker_rides_out_a_database_outage(postgres_url: str, tmp_path: Path) -> None:
    sweep_id = new_sweep(postgres_url, tmp_path, max_steps=12)  # four trials left at the cut
    pg = sa.make_url(postgres_url)
    proxy = TcpProxy((pg.host or "127.0.0.1", pg.port or 5432))
    try:
        proc = start_worker(_via(postgres_url, "127.0.0.1", proxy.port), "grid", ROOT)
        wait_for(lambda: count_running(postgres_url) >= 2, 300, "the second trial to start")
        proxy.cut()
        time.sleep(3.0)
        proxy.restore()
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    finally:
        proxy.close()
    assert proxy.num_refused > 0  # the worker did try to reach the database during the cut
    outcome = grid_outcome(postgres_url)
    assert set(outcome) == EXPECTED_CELLS and set(outcome.values()) == {1}
    (worker,) = list_workers(create_store_engine(postgres_url), sweep_id)
    assert worker.status == "stopped" and worker.num_finished == len(EXPECTED_CELLS)


NETNS = "smw-test"
VETH_HOST, VETH_NS = "10.231.77.1", "10.231.77.2"


@pytest.fixture
def namespace():  # type: ignore[no-untyped-def]
    """A network namespace joined to this one by a veth pair: another host, as far as TCP goes."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) for a second network namespace")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    subprocess.run(["ip", "link", "del", "smw-veth0"], capture_output=True)
    try:
        ip("netns", "add", NETNS)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot create a network namespace: {err.stderr.decode().strip()}")
    try:
        ip("link", "add", "smw-veth0", "type", "veth", "peer", "name", "smw-veth1")
        ip("link", "set", "smw-veth1", "netns", NETNS)
        ip("addr", "add", f"{VETH_HOST}/24", "dev", "smw-veth0")
        ip("link", "set", "smw-veth0", "up")
        ip("-n", NETNS, "addr", "add", f"{VETH_NS}/24", "dev", "smw-veth1")
        ip("-n", NETNS, "link", "set", "smw-veth1", "up")
        ip("-n", NETNS, "link", "set", "lo", "up")
        yield NETNS
    finally:
        subprocess.run(["ip", "link", "del", "smw-veth0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


@pytest.mark.slow
@pytest.mark.postgres
def test_two_hosts_in_network_namespaces(postgres_url: str, tmp_path: Path,
                                         namespace: str) -> None:
    """One worker here, one in another network namespace reaching PostgreSQL over the veth.

    PostgreSQL listens on 127.0.0.1 only, so a forwarder bound to the veth address of this
    namespace carries the other host's connections to it (as a database host's address would).
    """
    new_sweep(postgres_url, tmp_path, max_steps=12)  # as in two_workers_on_postgres
    pg = sa.make_url(postgres_url)
    proxy = TcpProxy((pg.host or "127.0.0.1", pg.port or 5432), bind=VETH_HOST)
    try:
        remote = start_worker(_via(postgres_url, VETH_HOST, proxy.port), "grid", ROOT,
                              "ip", "netns", "exec", namespace)
        local = start_worker(postgres_url, "grid", ROOT)
        for proc in (remote, local):
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err
    finally:
        proxy.close()
    outcome = grid_outcome(postgres_url)
    assert set(outcome) == EXPECTED_CELLS and set(outcome.values()) == {1}
    done = trials_per_worker(postgres_url)
    assert len(done) == 2 and all(n >= 1 for n in done.values()), done
