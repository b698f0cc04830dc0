"""sweepmaster's own tables: migrations, sweeps, batched progress, queries.

Every test taking ``storage_url`` runs on a SQLite file and on a PostgreSQL schema (the latter
skipped without a server): one conformance suite for both backends.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import threading
from dataclasses import replace
from datetime import timedelta, timezone
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from sweepmaster.errors import StorageError
from sweepmaster.store import (
    ProgressRecorder,
    SweepInfo,
    config_hash,
    create_store_engine,
    current_revision,
    get_or_create_sweep,
    get_sweep,
    head_revision,
    list_sweeps,
    metric_history,
    set_sweep_status,
    trial_progress,
    upgrade_to_head,
)
from sweepmaster.store.migrate import migrations_dir
from sweepmaster.store.models import ALEMBIC_VERSION_TABLE, Base
from tests.kit.threads import start_and_join

# Not resolved: the CLI must run from the checkout these tests were collected from.
REPO_ROOT = Path(__file__).absolute().parents[2]
SM_TABLES = {
    "sm_sweeps", "sm_trial_progress", "sm_metrics", "sm_partitions", "sm_task_events",
    "sm_fusion_groups", "sm_fusion_measurements", "sm_workers",
}
CONFIG = "study:\n  direction: minimize\n"


@pytest.fixture
def engine(store_engine: sa.Engine) -> sa.Engine:
    """An engine on a database upgraded to head."""
    return store_engine


@pytest.fixture
def sweep(engine: sa.Engine) -> SweepInfo:
    return get_or_create_sweep(engine, "sweep-a", "study-a", CONFIG)


def _table_names(url: str) -> set[str]:
    engine = create_store_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _optuna_alembic_version(url: str) -> str:
    engine = create_store_engine(url)
    try:
        with engine.connect() as connection:
            return str(
                connection.execute(sa.text("SELECT version_num FROM alembic_version")).one()[0]
            )
    finally:
        engine.dispose()


def _schema_diff(url: str) -> list[object]:
    """What autogenerate would change to make the database match the models."""
    engine = create_store_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection,
                opts={
                    "include_name": lambda name, type_, parents: (
                        type_ != "table" or (name or "").startswith("sm_")
                    ),
                    "version_table": ALEMBIC_VERSION_TABLE,
                },
            )
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def _alembic(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", "alembic.ini", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


# --- migrations -----------------------------------------------------------------------------


def test_migrations_are_found_with_their_revision() -> None:
    directory = migrations_dir()
    assert (directory / "env.py").is_file()
    assert (directory / "script.py.mako").is_file()
    assert (directory / "versions" / "0001_initial.py").is_file()
    assert head_revision() == "0008"


def test_upgrade_creates_tables_matching_the_models(storage_url: str) -> None:
    engine = create_store_engine(storage_url)
    try:
        assert current_revision(engine) is None
        upgrade_to_head(engine)
        assert current_revision(engine) == head_revision()
        if engine.dialect.name == "sqlite":  # turned off for the migration, back on after it
            with engine.connect() as connection:
                assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()
    assert _table_names(storage_url) == SM_TABLES | {ALEMBIC_VERSION_TABLE}
    assert _schema_diff(storage_url) == []


def test_upgrade_twice_is_a_noop(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    try:
        created = get_or_create_sweep(engine, "kept", "study", CONFIG)
        upgrade_to_head(engine)
        assert current_revision(engine) == head_revision()
        assert get_sweep(engine, "kept") == replace(created, created=False)
    finally:
        engine.dispose()


def test_concurrent_upgrades_of_one_database_both_succeed(storage_url: str) -> None:
    errors: list[BaseException] = []

    def upgrade() -> None:
        try:
            upgrade_to_head(storage_url)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    start_and_join([threading.Thread(target=upgrade) for _ in range(4)])
    assert errors == []
    engine = create_store_engine(storage_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_upgrade_leaves_an_existing_optuna_study_alone(storage_url: str) -> None:
    study = optuna.create_study(storage=storage_url, study_name="s")
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=2)
    optuna_version = _optuna_alembic_version(storage_url)
    optuna_tables = _table_names(storage_url)

    upgrade_to_head(storage_url)

    loaded = optuna.load_study(storage=storage_url, study_name="s")
    assert len(loaded.trials) == 2
    assert loaded.best_value == study.best_value
    assert _optuna_alembic_version(storage_url) == optuna_version
    assert _table_names(storage_url) == optuna_tables | SM_TABLES | {ALEMBIC_VERSION_TABLE}
    engine = create_store_engine(storage_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    assert _schema_diff(storage_url) == []


def test_optuna_creates_its_study_after_our_upgrade(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    study = optuna.create_study(storage=storage_url, study_name="s")
    study.optimize(lambda trial: trial.suggest_float("x", 0.0, 1.0), n_trials=1)
    assert len(optuna.load_study(storage=storage_url, study_name="s").trials) == 1
    upgrade_to_head(storage_url)


def test_upgrade_refuses_a_database_from_a_newer_sweepmaster(storage_url: str) -> None:
    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    try:
        with engine.begin() as connection:
            connection.execute(sa.text(f"UPDATE {ALEMBIC_VERSION_TABLE} SET version_num = 'ffff'"))
        with pytest.raises(StorageError, match="cannot upgrade storage .*ffff"):
            upgrade_to_head(engine)
    finally:
        engine.dispose()


def test_alembic_cli_upgrades_with_x_url_and_sees_no_drift(storage_url: str) -> None:
    optuna.create_study(storage=storage_url, study_name="s")
    result = _alembic("-x", f"url={storage_url}", "upgrade", "head")
    assert result.returncode == 0, result.stderr
    assert _table_names(storage_url) >= SM_TABLES
    # Autogenerate compares sm_* tables only: Optuna's tables are not proposed for dropping.
    check = _alembic("-x", f"url={storage_url}", "check")
    assert check.returncode == 0, check.stderr + check.stdout
    engine = create_store_engine(storage_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_upgrade_from_0001_keeps_rows_and_adds_spill_columns(storage_url: str) -> None:
    assert _alembic("-x", f"url={storage_url}", "upgrade", "0001").returncode == 0
    engine = create_store_engine(storage_url)
    try:
        sweep = get_or_create_sweep(engine, "old", "old", "name: old")
        with engine.begin() as connection:
            connection.execute(sa.text(
                "INSERT INTO sm_trial_progress (sweep_id, trial_number, state, step, total_steps,"
                " device, started_at, updated_at) VALUES (:s, 0, 'COMPLETE', 5, 5, 'cpu',"
                " CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"s": sweep.id})
        upgrade_to_head(engine)
        assert current_revision(engine) == head_revision()
        (row,) = trial_progress(engine, sweep.id)
        assert (row.state, row.step, row.swap_bytes, row.num_promotes) == ("COMPLETE", 5, 0, 0)
        assert {"sm_partitions", "sm_task_events", "sm_fusion_groups", "sm_workers",
                "sm_fusion_measurements"} <= _table_names(storage_url)
    finally:
        engine.dispose()


def test_alembic_cli_takes_the_url_from_sweepmaster_storage(sqlite_url: str) -> None:
    result = _alembic("upgrade", "head", env={"SWEEPMASTER_STORAGE": sqlite_url})
    assert result.returncode == 0, result.stderr
    assert _table_names(sqlite_url) >= SM_TABLES


# --- engine ---------------------------------------------------------------------------------


def test_sqlite_connections_use_wal_busy_timeout_and_foreign_keys(sqlite_url: str) -> None:
    engine = create_store_engine(sqlite_url)
    try:
        with engine.connect() as connection:
            pragma = connection.exec_driver_sql
            assert pragma("PRAGMA journal_mode").scalar() == "wal"
            assert pragma("PRAGMA busy_timeout").scalar() == 30_000
            assert pragma("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


def test_unreachable_server_raises_storage_error_with_masked_password() -> None:
    with pytest.raises(StorageError) as info:
        create_store_engine("postgresql+psycopg://postgres:hunter2@127.0.0.1:1/test")
    message = str(info.value)
    assert "hunter2" not in message
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/test" in message
    assert "\n" not in message


def test_sqlite_file_in_a_missing_directory_raises_storage_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing' / 'sweepmaster.db'}"
    with pytest.raises(StorageError, match="does not exist"):
        create_store_engine(url)
    with pytest.raises(StorageError, match="does not exist"):
        upgrade_to_head(url)
    assert not (tmp_path / "missing").exists()


def test_invalid_url_raises_storage_error() -> None:
    with pytest.raises(StorageError, match="invalid storage URL"):
        create_store_engine("not a url")
    with pytest.raises(StorageError, match="cannot use storage"):
        create_store_engine("nosuchdialect://host/db")


# --- sweeps ---------------------------------------------------------------------------------


def test_get_or_create_sweep_creates_once(engine: sa.Engine) -> None:
    first = get_or_create_sweep(engine, "sweep-a", "study-a", CONFIG)
    assert first.created
    assert first.status == "running"
    assert first.config_hash == hashlib.sha256(CONFIG.encode()).hexdigest() == config_hash(CONFIG)
    assert first.created_at.utcoffset() == timedelta(0)
    assert first.created_at.tzinfo is not None

    again = get_or_create_sweep(engine, "sweep-a", "other-study", "changed: true\n")
    assert not again.created
    assert again.id == first.id
    assert (again.study_name, again.config_text) == ("study-a", CONFIG)

    other = get_or_create_sweep(engine, "sweep-b", "study-b", CONFIG)
    assert other.created and other.id != first.id
    assert [s.name for s in list_sweeps(engine)] == ["sweep-a", "sweep-b"]
    assert get_sweep(engine, "nope") is None


def test_set_sweep_status(engine: sa.Engine, sweep: SweepInfo) -> None:
    set_sweep_status(engine, sweep.id, "interrupted")
    stored = get_sweep(engine, sweep.name)
    assert stored is not None
    assert stored.status == "interrupted"
    assert stored.updated_at >= sweep.updated_at
    assert stored.updated_at.tzinfo == timezone.utc
    with pytest.raises(ValueError, match="sweep status must be one of"):
        set_sweep_status(engine, sweep.id, "paused")
    with pytest.raises(StorageError, match="no sweep with id"):
        set_sweep_status(engine, sweep.id + 100, "failed")


# --- progress -------------------------------------------------------------------------------


def _steps(recorder: ProgressRecorder, trial_number: int, num_steps: int) -> None:
    for step in range(1, num_steps + 1):
        recorder.step(
            trial_number,
            step=step,
            total_steps=num_steps,
            train_loss=10.0 / step,
            tokens_per_s=1000.0 + step,
            lr=1e-3,
        )


def test_recorder_batches_steps_and_finished_writes_them_all(
    engine: sa.Engine, sweep: SweepInfo
) -> None:
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0)
    recorder.trial_started(0, optuna_trial_id=7, total_steps=100, device="cpu")
    (started,) = trial_progress(engine, sweep.id)
    assert (started.state, started.step, started.optuna_trial_id) == ("RUNNING", 0, 7)

    _steps(recorder, 0, 100)
    for step in (50, 100):
        recorder.evaluated(0, step=step, eval_loss=2.0, eval_perplexity=math.exp(2.0))
    assert recorder.flush_count == 0
    assert trial_progress(engine, sweep.id)[0].step == 0  # still buffered
    assert metric_history(engine, sweep.id, 0) == []

    recorder.finished(0, "COMPLETE", objective=1.5, checkpoint_path="/ckpt/0")
    assert recorder.flush_count == 1
    (row,) = trial_progress(engine, sweep.id)
    assert row.state == "COMPLETE"
    assert (row.step, row.total_steps, row.objective) == (100, 100, 1.5)
    assert (row.train_loss, row.tokens_per_s, row.eval_loss) == (0.1, 1100.0, 2.0)
    assert row.checkpoint_path == "/ckpt/0"
    assert row.failure_reason is None
    assert row.device == "cpu"
    assert row.updated_at >= row.started_at
    history = metric_history(engine, sweep.id, 0)
    assert len(history) == 3 * 100 + 2 * 2
    assert [name for _, name, _ in history[:3]] == ["lr", "tokens_per_s", "train_loss"]
    losses = metric_history(engine, sweep.id, 0, "train_loss")
    assert losses == [(step, "train_loss", 10.0 / step) for step in range(1, 101)]
    assert metric_history(engine, sweep.id, 0, "eval_perplexity") == [
        (50, "eval_perplexity", math.exp(2.0)),
        (100, "eval_perplexity", math.exp(2.0)),
    ]


def test_recorder_with_zero_interval_flushes_every_step(
    engine: sa.Engine, sweep: SweepInfo
) -> None:
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=0.0)
    recorder.trial_started(3, optuna_trial_id=None, total_steps=20, device="cuda:0")
    _steps(recorder, 3, 20)
    assert recorder.flush_count == 20
    assert trial_progress(engine, sweep.id)[0].step == 20
    assert len(metric_history(engine, sweep.id, 3)) == 60
    recorder.flush()  # nothing buffered: no transaction
    assert recorder.flush_count == 20


def test_recorder_with_default_interval_flushes_far_less_than_it_steps(
    engine: sa.Engine, sweep: SweepInfo
) -> None:
    recorder = ProgressRecorder(engine, sweep.id)
    recorder.trial_started(0, optuna_trial_id=0, total_steps=100, device="cpu")
    _steps(recorder, 0, 100)
    recorder.finished(0, "PRUNED", objective=None)
    assert recorder.flush_count < 100
    assert len(metric_history(engine, sweep.id, 0)) == 300
    assert trial_progress(engine, sweep.id)[0].state == "PRUNED"


def test_finished_records_failure_and_ends_the_trial(engine: sa.Engine, sweep: SweepInfo) -> None:
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0)
    recorder.trial_started(1, optuna_trial_id=2, total_steps=10, device="cpu")
    _steps(recorder, 1, 3)
    with pytest.raises(ValueError, match="state must be one of"):
        recorder.finished(1, "RUNNING")
    recorder.finished(1, "FAIL", failure_reason="torch.OutOfMemoryError: budget 1 GiB exceeded")
    (row,) = trial_progress(engine, sweep.id)
    assert (row.state, row.step, row.objective) == ("FAIL", 3, None)
    assert row.failure_reason == "torch.OutOfMemoryError: budget 1 GiB exceeded"
    with pytest.raises(ValueError, match="not running"):
        recorder.step(1, step=4, total_steps=10, train_loss=1.0, tokens_per_s=1.0, lr=1.0)
    with pytest.raises(ValueError, match="not running"):
        recorder.finished(1, "COMPLETE")


def test_relaunching_a_trial_resets_its_row_and_metrics(
    engine: sa.Engine, sweep: SweepInfo
) -> None:
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0)
    recorder.trial_started(5, optuna_trial_id=5, total_steps=10, device="cpu")
    _steps(recorder, 5, 4)
    recorder.finished(5, "FAIL", failure_reason="killed")
    recorder.trial_started(5, optuna_trial_id=9, total_steps=10, device="cuda:1")
    _steps(recorder, 5, 2)  # buffered, then dropped by the next relaunch
    recorder.trial_started(5, optuna_trial_id=11, total_steps=10, device="cuda:1")
    (row,) = trial_progress(engine, sweep.id)
    assert (row.state, row.step, row.optuna_trial_id, row.device) == ("RUNNING", 0, 11, "cuda:1")
    assert (row.failure_reason, row.train_loss) == (None, None)
    assert metric_history(engine, sweep.id, 5) == []
    _steps(recorder, 5, 1)
    recorder.flush()
    assert len(metric_history(engine, sweep.id, 5)) == 3


def test_nan_losses_are_recorded(engine: sa.Engine, sweep: SweepInfo) -> None:
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=3600.0)
    recorder.trial_started(0, optuna_trial_id=0, total_steps=2, device="cpu")
    recorder.step(0, step=1, total_steps=2, train_loss=math.nan, tokens_per_s=5.0, lr=0.1)
    recorder.evaluated(0, step=1, eval_loss=math.inf, eval_perplexity=math.inf)
    recorder.finished(0, "FAIL", failure_reason="loss is NaN")
    (row,) = trial_progress(engine, sweep.id)
    assert row.train_loss is None
    assert row.eval_loss == math.inf
    ((_, _, loss),) = metric_history(engine, sweep.id, 0, "train_loss")
    assert math.isnan(loss)
    assert metric_history(engine, sweep.id, 0, "eval_perplexity") == [
        (1, "eval_perplexity", math.inf)
    ]


def test_unknown_trial_is_rejected(engine: sa.Engine, sweep: SweepInfo) -> None:
    recorder = ProgressRecorder(engine, sweep.id)
    with pytest.raises(ValueError, match="call trial_started"):
        recorder.evaluated(4, step=1, eval_loss=1.0, eval_perplexity=math.e)


def test_recorder_is_thread_safe(engine: sa.Engine, sweep: SweepInfo) -> None:
    recorder = ProgressRecorder(engine, sweep.id, min_interval_s=0.0)
    num_trials, num_steps = 4, 50
    for trial_number in range(num_trials):
        recorder.trial_started(trial_number, trial_number, num_steps, f"cuda:{trial_number}")

    def train(trial_number: int) -> None:
        _steps(recorder, trial_number, num_steps)
        recorder.finished(trial_number, "COMPLETE", objective=float(trial_number))

    start_and_join([threading.Thread(target=train, args=(n,)) for n in range(num_trials)])
    rows = trial_progress(engine, sweep.id)
    assert [(r.trial_number, r.state, r.step) for r in rows] == [
        (n, "COMPLETE", num_steps) for n in range(num_trials)
    ]
    for trial_number in range(num_trials):
        assert len(metric_history(engine, sweep.id, trial_number)) == 3 * num_steps


def test_reader_runs_while_the_writer_records(storage_url: str, sweep: SweepInfo) -> None:
    # Separate engines, like a dashboard process reading while a sweep writes.
    writer_engine = create_store_engine(storage_url)
    reader_engine = create_store_engine(storage_url)
    recorder = ProgressRecorder(writer_engine, sweep.id, min_interval_s=0.0)
    recorder.trial_started(0, optuna_trial_id=0, total_steps=300, device="cpu")
    done = threading.Event()
    errors: list[BaseException] = []
    seen_steps: list[int] = []

    def read() -> None:
        try:
            while not done.is_set():
                seen_steps.append(trial_progress(reader_engine, sweep.id)[0].step)
                metric_history(reader_engine, sweep.id, 0, "train_loss")
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        _steps(recorder, 0, 300)
        recorder.finished(0, "COMPLETE", objective=0.0)
    finally:
        done.set()
        reader.join()
        writer_engine.dispose()
        reader_engine.dispose()
    assert errors == []
    assert seen_steps and seen_steps == sorted(seen_steps)
    assert recorder.flush_count == 301
