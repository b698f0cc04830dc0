"""`status`, `plan`, `validate` and `dashboard` only read: no database made, migrated or changed.

Each command runs through the real CLI (Typer's runner, or a subprocess for the console script)
against a real SQLite file that a real launch wrote, in a directory made read-only; the file's
sha256 and the directory's listing must be the same afterwards. A missing database is one error
line and exit code 2, with no file created.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.dashboard.app import create_app
from tests.kit.data import ROOT as REPO
from tests.kit.sweeps import tiny_sweep, write_sweep


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _journal_mode(path: Path) -> str:
    """The journal mode a SQLite file's header records (bytes 18-19: 1 rollback, 2 WAL)."""
    return "wal" if path.read_bytes()[18:20] == b"\x02\x02" else "rollback"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a sweep.yaml and the sweepmaster.db its one-step launch wrote."""
    root = tmp_path_factory.mktemp("launched")
    raw = tiny_sweep(root, storage=f"sqlite:///{root / 'sweepmaster.db'}",
                     train={"max_steps": 1, "eval_every": 1},
                     parameters={"train.lr": {"values": [1e-2]}},
                     output={"dir": str(root / "checkpoints"), "save": "none"})
    write_sweep(root, raw)
    result = CliRunner().invoke(app, ["launch", str(root / "sweep.yaml")])
    assert result.exit_code == 0, result.output
    shutil.rmtree(root / "token-cache", ignore_errors=True)
    return root


@pytest.fixture(params=["wal", "rollback"])
def read_only_dir(request: pytest.FixtureRequest, launched: Path,
                  tmp_path: Path) -> Iterator[Path]:
    """A copy of the launched directory in WAL or rollback-journal mode, made read-only."""
    folder = tmp_path / "ro"
    shutil.copytree(launched, folder)
    connection = sqlite3.connect(folder / "sweepmaster.db")
    connection.execute(f"PRAGMA journal_mode = {'WAL' if request.param == 'wal' else 'DELETE'}")
    connection.close()
    assert _journal_mode(folder / "sweepmaster.db") == request.param
    (folder / "sweepmaster.db").chmod(0o444)
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


READ_COMMANDS = [  # with a word of the output each prints
    pytest.param(["status"], "tiny", id="status"),
    pytest.param(["status", "--sweep", "tiny"], "tiny", id="status-sweep"),
    pytest.param(["plan", "sweep.yaml"], "job", id="plan"),
    pytest.param(["validate", "sweep.yaml"], "valid", id="validate"),
    pytest.param(["db", "current"], "sqlite:///sweepmaster.db: 0", id="db-current"),
]


@pytest.mark.parametrize(("args", "expected"), READ_COMMANDS)
def test_read_commands_leave_the_database_byte_identical(
    args: list[str], expected: str, read_only_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(read_only_dir)
    db = read_only_dir / "sweepmaster.db"
    before, listing, mode = _sha256(db), _listing(read_only_dir), _journal_mode(db)

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 0, (result.output, result.exception)
    assert expected in result.stdout
    assert _sha256(db) == before
    assert _journal_mode(db) == mode
    assert _listing(read_only_dir) == listing  # no -wal, -shm or journal file left behind


def test_dashboard_reads_without_switching_the_journal_mode(read_only_dir: Path) -> None:
    db = read_only_dir / "sweepmaster.db"
    before, listing, mode = _sha256(db), _listing(read_only_dir), _journal_mode(db)

    with TestClient(create_app(f"sqlite:///{db}"), base_url="http://127.0.0.1") as client:
        response = client.get("/api/sweeps")
        assert response.status_code == 200, response.text
        assert [s["name"] for s in response.json()["sweeps"]] == ["tiny"]

    assert _sha256(db) == before
    assert _journal_mode(db) == mode
    assert _listing(read_only_dir) == listing


@pytest.mark.parametrize("args", [
    pytest.param(["status"], id="status"),
    pytest.param(["status", "--sweep", "tiny"], id="status-sweep"),
    pytest.param(["dashboard", "--port", "0"], id="dashboard"),
    pytest.param(["status", "--storage", "sqlite:///elsewhere/nope.db"], id="status-storage"),
    pytest.param(["db", "current"], id="db-current"),
])
def test_a_missing_database_is_one_line_exit_2_and_no_file(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()

    result = CliRunner().invoke(app, args)

    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no database at sqlite:///"), lines[0]
    assert "Traceback" not in result.output
    assert _listing(tmp_path) == ["elsewhere"]
    assert _listing(tmp_path / "elsewhere") == []


def test_plan_without_a_database_creates_none(launched: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(launched / "sweep.yaml", tmp_path)
    sweep = (tmp_path / "sweep.yaml").read_text().replace(str(launched / "sweepmaster.db"),
                                                          str(tmp_path / "none.db"))
    (tmp_path / "sweep.yaml").write_text(sweep)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["plan", "sweep.yaml"])
    assert result.exit_code == 0, result.output
    assert "no database at" in result.stdout
    assert _listing(tmp_path) == ["sweep.yaml"]


def test_plan_does_not_write_the_partition_cache(launched: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A spilling plan on a database without cached plans leaves it without them."""
    shutil.copytree(launched, tmp_path / "db")
    db = tmp_path / "db" / "sweepmaster.db"
    before = _sha256(db)
    monkeypatch.chdir(tmp_path / "db")
    result = CliRunner().invoke(app, ["plan", "sweep.yaml", "--devices", "cpu:1x64MiB"])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())
    assert "(read only)" in shown  # the cache was consulted
    assert "written" not in shown and "(read only) (" not in shown  # nothing is written
    assert _sha256(db) == before
    count = sqlite3.connect(f"file:{db}?mode=ro", uri=True).execute(
        "SELECT COUNT(*) FROM sm_partitions").fetchone()[0]
    assert count == 0


def test_the_console_script_status_in_a_folder_without_a_database(tmp_path: Path) -> None:
    """The real entry point, in a subprocess, in a read-only folder."""
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    try:
        result = subprocess.run([sys.executable, "-m", "sweepmaster", "status"], cwd=tmp_path,
                                capture_output=True, text=True, env=env)
    finally:
        tmp_path.chmod(0o755)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: no database at sqlite:///sweepmaster.db"), \
        result.stderr
    assert list(tmp_path.iterdir()) == []


def _rows(url: str) -> dict[str, list[tuple[object, ...]]]:
    """Every table of a database with all its rows, sorted."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return {name: sorted(map(tuple, connection.execute(
                sa.text(f'SELECT * FROM "{name}"')).all()), key=repr)
                for name in sa.inspect(engine).get_table_names()}
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_read_commands_on_postgres_change_no_row(postgres_url: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from sweepmaster.config import parse_sweep_config
    from sweepmaster.store import create_store_engine, get_or_create_sweep, upgrade_to_head
    from sweepmaster.study import open_study

    monkeypatch.chdir(tmp_path)
    empty = CliRunner().invoke(app, ["status", "--storage", postgres_url])
    assert empty.exit_code == 0 and "no sweeps in" in empty.stdout, empty.output
    missing = CliRunner().invoke(app, ["status", "--storage", postgres_url, "--sweep", "tiny"])
    assert missing.exit_code == 2 and "no sweep named 'tiny'" in missing.stderr
    assert _rows(postgres_url) == {}  # neither Optuna's tables nor sweepmaster's were made

    raw = tiny_sweep(tmp_path, storage=postgres_url)
    config = parse_sweep_config(raw)
    engine = create_store_engine(postgres_url)
    upgrade_to_head(engine)
    study, _ = open_study(config, postgres_url)
    get_or_create_sweep(engine, config.name, study.study_name, config.canonical_text())
    study.enqueue_trial({"train.lr": 1e-2, "train.batch_size": 2})
    engine.dispose()
    write_sweep(tmp_path, raw)
    before = _rows(postgres_url)

    for args in (["status", "--storage", postgres_url],
                 ["status", "--storage", postgres_url, "--sweep", "tiny"],
                 ["plan", "sweep.yaml", "--devices", "cpu:1x64MiB"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    with TestClient(create_app(postgres_url), base_url="http://127.0.0.1") as client:
        assert [s["name"] for s in client.get("/api/sweeps").json()["sweeps"]] == ["tiny"]

    assert _rows(postgres_url) == before


def test_status_sees_what_a_live_writer_has_not_checkpointed(launched: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             ) -> None:
    """With a writer's -wal beside the file, status reads it (mode=ro), and changes nothing."""
    shutil.copytree(launched, tmp_path / "db")
    db = tmp_path / "db" / "sweepmaster.db"
    writer = sqlite3.connect(db)
    try:
        writer.execute("PRAGMA journal_mode = WAL")
        writer.execute("PRAGMA wal_autocheckpoint = 0")  # the change stays in the -wal file
        with writer:
            writer.execute("UPDATE sm_sweeps SET status = 'interrupted'")
        assert (tmp_path / "db" / "sweepmaster.db-wal").stat().st_size > 0
        before = _sha256(db), _sha256(tmp_path / "db" / "sweepmaster.db-wal")
        monkeypatch.chdir(tmp_path / "db")
        result = CliRunner().invoke(app, ["status"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        assert "interrupted" in result.stdout  # the status only the -wal holds
        assert (_sha256(db), _sha256(tmp_path / "db" / "sweepmaster.db-wal")) == before
    finally:
        writer.close()


def test_the_dashboard_leaves_no_file_beside_a_wal_database_without_a_writer(
    launched: Path, tmp_path: Path
) -> None:
    """In a writable folder, with no writer: no -wal / -shm made; a writer's changes still seen."""
    shutil.copytree(launched, tmp_path / "db")
    db = tmp_path / "db" / "sweepmaster.db"
    connection = sqlite3.connect(db)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.close()
    assert _journal_mode(db) == "wal"
    before, listing = _sha256(db), _listing(tmp_path / "db")

    with TestClient(create_app(f"sqlite:///{db}"), base_url="http://127.0.0.1") as client:
        for _ in range(2):  # the second request reuses the pooled connection
            sweeps = client.get("/api/sweeps").json()["sweeps"]
            assert [(s["name"], s["status"]) for s in sweeps] == [("tiny", "completed")]
            assert client.get("/api/sweeps/tiny/plots/history").status_code == 200
        assert _listing(tmp_path / "db") == listing
        assert _sha256(db) == before

        writer = sqlite3.connect(db)  # a sweep starts writing while the dashboard serves
        try:
            writer.execute("PRAGMA wal_autocheckpoint = 0")
            with writer:
                writer.execute("UPDATE sm_sweeps SET status = 'interrupted'")
            sweeps = client.get("/api/sweeps").json()["sweeps"]
            assert [s["status"] for s in sweeps] == ["interrupted"]
        finally:
            writer.close()
