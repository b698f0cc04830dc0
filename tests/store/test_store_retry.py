"""Database hiccups: writes ride out a locked SQLite file and killed PostgreSQL connections.

The outages are real: a second SQLite connection holding an exclusive transaction, and
``pg_terminate_backend`` on the server connections of sweepmaster's and Optuna's pools, in the
middle of a transaction. Retries must leave exactly the rows an undisturbed run writes; an outage
longer than the retry policy must end in one clear ``StorageError``.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from sweepmaster import study as study_manager
from sweepmaster.config import SweepConfig, parse_sweep_config
from sweepmaster.errors import StorageError
from sweepmaster.runtime.events import TaskRecord
from sweepmaster.store import (
    ProgressRecorder,
    RetryPolicy,
    TaskEventRecorder,
    create_store_engine,
    get_or_create_sweep,
    get_sweep,
    is_transient,
    metric_history,
    run_with_retry,
    set_sweep_status,
    trial_progress,
    upgrade_to_head,
)
from sweepmaster.store.partitions import load_partition, save_partition
from tests.kit.sweeps import tiny_sweep

PATIENT = RetryPolicy(timeout_s=60.0, initial_delay_s=0.02, max_delay_s=0.2)
RETRY_LOG = "sweepmaster.store.retry"


# --- SQLite: a lock held by another connection -----------------------------------------------

@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[tuple[Path, sa.Engine]]:
    """A database at head whose engine gives up on a lock after 20 ms (the retries take over)."""
    path = tmp_path / "sweep.db"
    upgrade_to_head(f"sqlite:///{path}")
    engine = create_store_engine(f"sqlite:///{path}", sqlite_busy_timeout_ms=20)
    yield path, engine
    engine.dispose()


@contextlib.contextmanager
def exclusive_lock(path: Path, release_after_s: float | None) -> Iterator[threading.Event]:
    """Hold ``BEGIN EXCLUSIVE`` on a SQLite file; commit after ``release_after_s`` (or on exit).

    Yields an event that is set once the lock is released.
    """
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("BEGIN EXCLUSIVE")
    connection.execute("CREATE TABLE IF NOT EXISTS lock_holder (x INTEGER)")
    released = threading.Event()
    lock = threading.Lock()

    def release() -> None:
        with lock:
            if not released.is_set():
                connection.execute("COMMIT")
                released.set()

    timer = threading.Timer(release_after_s, release) if release_after_s is not None else None
    if timer is not None:
        timer.start()
    try:
        yield released
    finally:
        if timer is not None:
            timer.cancel()
        release()
        connection.close()


def retry_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == RETRY_LOG and "database unavailable" in r.getMessage()]


def test_progress_rides_out_a_two_second_lock(
    sqlite_db: tuple[Path, sa.Engine], caplog: pytest.LogCaptureFixture
) -> None:
    path, engine = sqlite_db
    caplog.set_level(logging.WARNING, RETRY_LOG)
    with exclusive_lock(path, 2.0) as released:
        sweep = get_or_create_sweep(engine, "s", "s", "config", retry=PATIENT)
        assert released.is_set()  # it could only be written after the lock went
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0, retry=PATIENT)
    with exclusive_lock(path, 2.0):
        recorder.trial_started(0, optuna_trial_id=7, total_steps=3, device="cpu")
    for step in (1, 2, 3):
        recorder.step(0, step, 3, train_loss=4.0 - step, tokens_per_s=10.0, lr=0.1)
    recorder.evaluated(0, 3, eval_loss=1.5, eval_perplexity=4.48)
    with exclusive_lock(path, 2.0):
        recorder.finished(0, "COMPLETE", objective=1.5)
    with exclusive_lock(path, 2.0):
        set_sweep_status(engine, sweep.id, "completed", retry=PATIENT)

    assert len(retry_warnings(caplog)) == 4
    (row,) = trial_progress(engine, sweep.id)
    assert (row.state, row.step, row.objective, row.optuna_trial_id) == ("COMPLETE", 3, 1.5, 7)
    history = metric_history(engine, sweep.id, 0)
    assert len(history) == 3 * 3 + 2  # train_loss, lr, tokens_per_s per step; two eval metrics
    assert get_sweep(engine, "s").status == "completed"


def test_timeline_and_partition_cache_ride_out_a_lock(
    sqlite_db: tuple[Path, sa.Engine], caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    path, engine = sqlite_db
    monkeypatch.setenv("SWEEPMASTER_STORAGE_RETRY_S", "60")
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    timeline = TaskEventRecorder(engine, sweep.id, min_interval_s=3600.0, retry=PATIENT)
    timeline.name_job("trial-0", 0)
    timeline.record(TaskRecord(device="cpu:0", job="trial-0", shard=1, kind="forward",
                               start_s=0.0, end_s=0.5, swap_bytes=1024, peak_bytes=None,
                               step=1))
    caplog.set_level(logging.WARNING, RETRY_LOG)
    with exclusive_lock(path, 1.0):
        timeline.flush()
    with exclusive_lock(path, 1.0):
        assert save_partition(engine, "arch", 2**28, "virtual", "{}")
    assert not save_partition(engine, "arch", 2**28, "virtual", "{}")  # kept, not rewritten
    assert load_partition(engine, "arch", 2**28, "virtual") == "{}"
    assert len(retry_warnings(caplog)) == 2
    with engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT job, trial_number, bytes FROM sm_task_events"))
        assert rows.all() == [("trial-0", 0, 1024)]


def test_a_lock_longer_than_the_policy_fails_clearly_and_keeps_the_values(
    sqlite_db: tuple[Path, sa.Engine],
) -> None:
    path, engine = sqlite_db
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0,
                                retry=RetryPolicy(timeout_s=0.3, initial_delay_s=0.02))
    recorder.trial_started(0, optuna_trial_id=None, total_steps=5, device="cpu")
    recorder.step(0, 1, 5, train_loss=3.0, tokens_per_s=1.0, lr=0.1)
    with exclusive_lock(path, None):
        with pytest.raises(StorageError) as info:
            recorder.finished(0, "FAIL", failure_reason="boom")
    message = str(info.value)
    assert message.startswith("cannot record the end of trial 0: database unavailable for ")
    assert "database is locked" in message and "\n" not in message
    (row,) = trial_progress(engine, sweep.id)
    assert (row.state, row.step) == ("RUNNING", 0)  # nothing half-written
    recorder.finished(0, "FAIL", failure_reason="boom")  # the buffered step was kept
    (row,) = trial_progress(engine, sweep.id)
    assert (row.state, row.step, row.failure_reason) == ("FAIL", 1, "boom")
    assert len(metric_history(engine, sweep.id, 0)) == 3


def test_periodic_flushes_do_not_block_training_until_the_outage_is_too_long(
    sqlite_db: tuple[Path, sa.Engine],
) -> None:
    path, engine = sqlite_db
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=0.0,
                                retry=RetryPolicy(timeout_s=0.5, initial_delay_s=0.02))
    recorder.trial_started(0, optuna_trial_id=None, total_steps=100, device="cpu")
    with exclusive_lock(path, None):
        recorder.step(0, 1, 100, train_loss=3.0, tokens_per_s=1.0, lr=0.1)  # buffered, logged
        threading.Event().wait(0.6)  # the outage outlasts the policy
        with pytest.raises(StorageError, match="cannot record progress of sweep .* database "
                                               "unavailable"):
            recorder.step(0, 2, 100, train_loss=2.0, tokens_per_s=1.0, lr=0.1)
    recorder.flush()
    assert trial_progress(engine, sweep.id)[0].step == 2
    assert [s for s, name, _ in metric_history(engine, sweep.id, 0) if name == "lr"] == [1, 2]


def test_errors_that_do_not_go_away_are_not_retried(
    sqlite_db: tuple[Path, sa.Engine], caplog: pytest.LogCaptureFixture
) -> None:
    _, engine = sqlite_db
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0, retry=PATIENT)
    recorder.trial_started(0, optuna_trial_id=None, total_steps=5, device="cpu")
    recorder.step(0, 1, 5, train_loss=3.0, tokens_per_s=1.0, lr=0.1)
    with engine.begin() as connection:
        connection.execute(sa.text("DROP TABLE sm_metrics"))
    caplog.set_level(logging.WARNING, RETRY_LOG)
    with pytest.raises(StorageError, match="^cannot record progress: no such table: sm_metrics$"):
        recorder.flush()
    assert retry_warnings(caplog) == []


def test_a_trial_that_never_started_is_recorded_in_its_final_state(
    sqlite_db: tuple[Path, sa.Engine],
) -> None:
    _, engine = sqlite_db
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    recorder = ProgressRecorder(engine, sweep.id)
    recorder.finished(3, "FAIL", failure_reason="DataError: text shorter than one block")
    (row,) = trial_progress(engine, sweep.id)
    assert (row.trial_number, row.state, row.step, row.total_steps) == (3, "FAIL", 0, 0)
    assert row.failure_reason == "DataError: text shorter than one block"
    with pytest.raises(ValueError, match="not running"):
        recorder.finished(3, "FAIL")


def test_optuna_calls_ride_out_a_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "optuna.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{path}",
                                         engine_kwargs={"connect_args": {"timeout": 0.02}})
    study = optuna.create_study(storage=storage, study_name="s",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    config = _config(tmp_path, sampler="random")
    caplog.set_level(logging.WARNING, RETRY_LOG)
    with exclusive_lock(path, 1.0):
        trial = study_manager.next_trial(study, config, 10, retry=PATIENT)
    assert trial is not None and set(trial.params) == {"train.lr", "train.batch_size"}
    with exclusive_lock(path, 1.0):
        study_manager.report(trial, 2.5, 1, retry=PATIENT)
    with exclusive_lock(path, 1.0):
        study_manager.tell(study, trial, 2.0, retry=PATIENT)
    second = study_manager.next_trial(study, config, 10, retry=PATIENT)
    assert second is not None
    with exclusive_lock(path, 1.0):
        study_manager.fail_trial(study, second, "boom", interrupted=True, retry=PATIENT)
    with exclusive_lock(path, 1.0):
        assert study_manager.requeue_interrupted(study, retry=PATIENT) == 1

    assert len(retry_warnings(caplog)) == 5
    first, failed, queued = study.get_trials()
    assert (first.state, first.value, first.intermediate_values) == (
        TrialState.COMPLETE, 2.0, {1: 2.5})
    assert failed.state == TrialState.FAIL and failed.system_attrs["fail_reason"] == "boom"
    assert queued.state == TrialState.WAITING
    assert queued.system_attrs["fixed_params"] == failed.params


def _config(tmp_path: Path, sampler: str = "grid") -> SweepConfig:
    raw = tiny_sweep(tmp_path)
    raw["study"]["sampler"] = sampler
    raw["study"]["n_trials"] = 10
    return parse_sweep_config(raw)


def test_is_transient_on_real_errors(sqlite_db: tuple[Path, sa.Engine]) -> None:
    path, engine = sqlite_db
    with exclusive_lock(path, None), pytest.raises(sa.exc.OperationalError) as locked:
        with engine.begin() as connection:
            connection.execute(sa.text("DELETE FROM sm_sweeps"))
    assert is_transient(locked.value)
    with pytest.raises(sa.exc.OperationalError) as missing:
        with engine.begin() as connection:
            connection.execute(sa.text("SELECT * FROM no_such_table"))
    assert not is_transient(missing.value)
    assert not is_transient(ValueError("not a database error"))


def test_retry_policy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWEEPMASTER_STORAGE_RETRY_S", raising=False)
    assert RetryPolicy.from_env().timeout_s == 60.0
    monkeypatch.setenv("SWEEPMASTER_STORAGE_RETRY_S", "5")
    assert RetryPolicy.from_env().timeout_s == 5.0
    monkeypatch.setenv("SWEEPMASTER_STORAGE_RETRY_S", "soon")
    with pytest.raises(StorageError, match="SWEEPMASTER_STORAGE_RETRY_S: expected a number"):
        RetryPolicy.from_env()
    calls = []
    assert run_with_retry(lambda: calls.append(1) or 42, "do nothing",
                          RetryPolicy(timeout_s=0)) == 42
    with pytest.raises(KeyError):  # not a database error: raised as it is
        run_with_retry(lambda: {}["x"], "look up", PATIENT)


# --- PostgreSQL: server connections terminated mid-transaction -------------------------------

@pytest.fixture
def pg(postgres_url: str) -> Iterator[tuple[str, sa.Engine]]:
    """The test schema's URL with a unique application_name, and an admin engine."""
    app_name = f"sm-retry-{uuid.uuid4().hex[:8]}"
    url = sa.make_url(postgres_url).update_query_dict({"application_name": app_name})
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    yield url.render_as_string(hide_password=False), admin
    admin.dispose()


def _kill_on_begin(engine: sa.Engine, admin: sa.Engine) -> Callable[[int], None]:
    """Arrange for the server to terminate the connection of each of the next N transactions.

    Each kill happens right after the transaction begins on the client, before its first
    statement reaches the server, so that statement fails with the connection gone.
    """
    pending = [0]

    def on_begin(connection: sa.Connection) -> None:
        if pending[0] <= 0:
            return
        pending[0] -= 1
        pid = connection.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
        with admin.connect() as killer:
            killed = killer.execute(sa.text("SELECT pg_terminate_backend(:pid, 5000)"),
                                    {"pid": pid}).scalar_one()
        assert killed

    sa.event.listen(engine, "begin", on_begin)

    def arm(count: int) -> None:
        pending[0] = count

    return arm


@pytest.mark.postgres
def test_progress_and_optuna_survive_killed_connections(
    pg: tuple[str, sa.Engine], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, admin = pg
    caplog.set_level(logging.WARNING, RETRY_LOG)
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
    config = _config(tmp_path)
    study = optuna.create_study(storage=storage, study_name="s",
                                sampler=study_manager.build_sampler(config))
    kill_store = _kill_on_begin(engine, admin)
    kill_optuna = _kill_on_begin(storage.engine, admin)
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0, retry=PATIENT)

    kill_optuna(2)
    trial = study_manager.next_trial(study, config, 4, retry=PATIENT)
    assert trial is not None
    kill_store(1)
    recorder.trial_started(trial.number, trial._trial_id, total_steps=2, device="cpu")
    for step in (1, 2):
        recorder.step(trial.number, step, 2, train_loss=1.0 / step, tokens_per_s=5.0, lr=0.1)
        kill_optuna(1)
        study_manager.report(trial, 1.0 / step, step, retry=PATIENT)
        kill_optuna(1)
        assert not study_manager.should_prune(trial, retry=PATIENT)
    kill_store(2)
    recorder.finished(trial.number, "COMPLETE", objective=0.5)
    kill_optuna(1)
    study_manager.tell(study, trial, 0.5, retry=PATIENT)
    kill_store(1)
    set_sweep_status(engine, sweep.id, "completed", retry=PATIENT)

    assert len(retry_warnings(caplog)) >= 8
    (done,) = study.get_trials()
    assert (done.state, done.value, done.intermediate_values) == (
        TrialState.COMPLETE, 0.5, {1: 1.0, 2: 0.5})
    assert set(done.params) == {"train.lr", "train.batch_size"}
    (row,) = trial_progress(engine, sweep.id)
    assert (row.state, row.step, row.objective) == ("COMPLETE", 2, 0.5)
    assert len(metric_history(engine, sweep.id, trial.number)) == 6
    assert get_sweep(engine, "s").status == "completed"
    engine.dispose()
    storage.engine.dispose()


@pytest.mark.postgres
def test_a_sweep_loop_survives_a_connection_killer(
    pg: tuple[str, sa.Engine], tmp_path: Path
) -> None:
    """Trials asked, reported and told while the server's connections keep being killed.

    After each operation that got through, every connection of the sweep is killed 20 ms later
    (mid-operation or idle in the pool): each operation sees kills, yet the loop progresses
    however slow the machine is (a killer on a fixed period alone could starve it).
    """
    url, admin = pg
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    sweep = get_or_create_sweep(engine, "s", "s", "config")
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
    config = _config(tmp_path)
    study = optuna.create_study(storage=storage, study_name="s",
                                sampler=study_manager.build_sampler(config))
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=0.0, retry=PATIENT)
    app_name = sa.make_url(url).query["application_name"]
    stop = threading.Event()
    progress = threading.Event()  # an operation got through since the last kill
    kills = []

    def killer() -> None:
        with admin.connect() as connection:
            while not stop.is_set():
                if not progress.wait(0.02):
                    continue
                progress.clear()
                if stop.wait(0.02):
                    return
                kills.extend(connection.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = :name"), {"name": app_name}).scalars())

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        for _ in range(4):
            trial = study_manager.next_trial(study, config, 4, retry=PATIENT)
            assert trial is not None
            progress.set()
            recorder.trial_started(trial.number, trial._trial_id, total_steps=5, device="cpu")
            progress.set()
            for step in range(1, 6):
                recorder.step(trial.number, step, 5, train_loss=1.0, tokens_per_s=1.0, lr=0.1)
                progress.set()
                study_manager.report(trial, float(step), step, retry=PATIENT)
                progress.set()
            recorder.finished(trial.number, "COMPLETE", objective=float(trial.number))
            progress.set()
            study_manager.tell(study, trial, float(trial.number), retry=PATIENT)
            progress.set()
        assert study_manager.next_trial(study, config, 5, retry=PATIENT) is None  # grid done
    finally:
        stop.set()
        thread.join()
    assert any(kills)  # connections were really terminated while it ran

    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert sorted(tuple(sorted(t.params.items())) for t in trials) == sorted(
        tuple(sorted(p.items())) for p in [
            {"train.lr": lr, "train.batch_size": b} for lr in (1e-2, 3e-3) for b in (2, 4)])
    assert all(t.intermediate_values == {s: float(s) for s in range(1, 6)} for t in trials)
    rows = trial_progress(engine, sweep.id)
    assert [(r.state, r.step) for r in rows] == [("COMPLETE", 5)] * 4
    for row in rows:  # a retried commit may add a duplicate, never lose a point
        history = metric_history(engine, sweep.id, row.trial_number)
        assert {(s, n) for s, n, _ in history} == {
            (s, n) for s in range(1, 6) for n in ("train_loss", "lr", "tokens_per_s")}
    engine.dispose()
    storage.engine.dispose()


def test_distributions_are_suggested_as_given(tmp_path: Path) -> None:
    """next_trial suggests through the public API exactly the sweep's distributions."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}")
    raw = tiny_sweep(tmp_path)
    raw["study"].update(sampler="random", n_trials=3)
    raw["parameters"] = {"train.lr": {"min": 1e-4, "max": 1e-2,
                                      "distribution": "log_uniform_values"},
                         "train.batch_size": {"values": [2, 4]},
                         "train.warmup_steps": {"min": 0, "max": 4},
                         "train.weight_decay": {"min": 0.0, "max": 0.1, "q": 0.05}}
    config = parse_sweep_config(raw)
    trial = study_manager.next_trial(study, config, 3)
    assert trial is not None
    frozen = study.get_trials()[0]
    assert frozen.distributions == config.search_space()
    assert isinstance(frozen.distributions["train.lr"], FloatDistribution)
    assert isinstance(frozen.distributions["train.batch_size"], CategoricalDistribution)
