"""A database password is never stored nor served: sweep records, the dashboard, migrations."""

from __future__ import annotations

import hashlib

import optuna
import pytest
import sqlalchemy as sa
from alembic import command
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config
from sweepmaster.dashboard import create_app
from sweepmaster.store import create_store_engine, get_sweep, upgrade_to_head
from sweepmaster.store.engine import masked_text
from sweepmaster.store.migrate import _alembic_config
from sweepmaster.sweep import run_sweep
from tests.kit.sweeps import tiny_sweep, write_sweep

PASSWORD = "s3cret-Pw"


def _raw_rows(url: str) -> list[tuple[str, str]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(
                sa.text("SELECT config_text, config_hash FROM sm_sweeps"))]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_launch_with_a_password_stores_and_serves_none(postgres_url: str, tmp_path) -> None:
    url = sa.make_url(postgres_url).set(password=PASSWORD).render_as_string(hide_password=False)
    raw = tiny_sweep(tmp_path, name="secret", storage=url, train={"max_steps": 2, "eval_every": 2},
                     parameters={"train.lr": {"values": [1e-2]},
                                 "train.batch_size": {"values": [4]}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    outcome = run_sweep(config)
    assert outcome.num_finished == 1 and PASSWORD not in outcome.storage
    ((text, digest),) = _raw_rows(url)
    assert PASSWORD not in text and ":***@" in text
    assert digest == hashlib.sha256(text.encode()).hexdigest()
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        for path in ("/api/sweeps/secret", "/api/sweeps", "/api/info"):
            response = client.get(path)
            assert response.status_code == 200, path
            assert PASSWORD not in response.text, path
        assert client.get("/api/sweeps/secret").json()["config"]["storage"].count("***") == 1
    assert run_sweep(config).num_run == 0  # the masked record is the same sweep: it joins
    for args in (["db", "upgrade", "--storage", url], ["db", "current", "--storage", url],
                 ["status", "--storage", url]):
        result = CliRunner().invoke(app, args, terminal_width=200)
        assert result.exit_code == 0, result.output
        assert PASSWORD not in result.output, args


def test_existing_records_are_masked_by_the_migration(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_store_engine(url)
    stored = ('{\n  "name": "old",\n  "storage": "postgresql://bob:' + PASSWORD
              + '@db.example:5432/sweeps"\n}')
    try:
        with engine.connect() as connection:
            command.upgrade(_alembic_config(connection), "0007")
            connection.execute(sa.text(
                "INSERT INTO sm_sweeps (name, study_name, config_text, config_hash, status, "
                "created_at, updated_at) VALUES ('old', 'old', :text, :hash, 'completed', "
                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                {"text": stored, "hash": hashlib.sha256(stored.encode()).hexdigest()})
            connection.commit()
        upgrade_to_head(engine)
        info = get_sweep(engine, "old")
    finally:
        engine.dispose()
    assert info is not None
    assert info.config_text == stored.replace(PASSWORD, "***")
    assert info.config_hash == hashlib.sha256(info.config_text.encode()).hexdigest()
    assert _raw_rows(url) == [(info.config_text, info.config_hash)]


def test_a_database_not_migrated_yet_is_served_masked(tmp_path) -> None:
    """The dashboard reads without migrating: what it serves is masked all the same."""
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    raw = tiny_sweep(tmp_path, name="unmigrated", train={"max_steps": 2, "eval_every": 2},
                     parameters={"train.lr": {"values": [1e-2]},
                                 "train.batch_size": {"values": [4]}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    assert run_sweep(config).num_finished == 1
    plain = config.canonical_text().replace(
        f'"storage": "{config.storage}"',
        f'"storage": "postgresql://bob:{PASSWORD}@db.example/sweeps"')
    assert PASSWORD in plain
    engine = sa.create_engine(url)
    with engine.begin() as connection:  # a row as an older sweepmaster wrote it
        connection.execute(sa.text("UPDATE sm_sweeps SET config_text = :text"), {"text": plain})
    engine.dispose()
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        response = client.get("/api/sweeps/unmigrated")
    assert response.status_code == 200
    assert PASSWORD not in response.text
    assert response.json()["config"]["storage"] == "postgresql://bob:***@db.example/sweeps"
    assert optuna.load_study(study_name="unmigrated", storage=url).best_trial is not None


@pytest.mark.parametrize(("text", "shown"), [
    ("postgresql+psycopg://u:p@ss:w@h:5432/db?x=1", "postgresql+psycopg://u:***@h:5432/db?x=1"),
    ("sqlite:///dir:a/b@c.db", "sqlite:///dir:a/b@c.db"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
    ("a postgresql://u:***@h/db b", "a postgresql://u:***@h/db b"),
])
def test_masked_text(text: str, shown: str) -> None:
    assert masked_text(text) == shown
