"""A launch joins only the study it created, with the same direction, metric and search space.

Every refusal is one line naming the file, the key and the recorded value, and writes nothing
(every table's rows are the same before and after).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa

from sweepmaster import study as study_manager
from sweepmaster.config import load_sweep_config
from sweepmaster.errors import ConfigError, StorageError
from sweepmaster.store import create_store_engine, get_or_create_sweep, upgrade_to_head
from sweepmaster.sweep import run_sweep
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep


def _snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return {name: sorted(map(tuple, connection.execute(
                        sa.text(f'SELECT * FROM "{name}"'))), key=repr)
                    for name in sa.inspect(connection).get_table_names()}
    finally:
        engine.dispose()


def _create(url: str, tmp_path: Path) -> None:
    """The sweep ``tiny``'s records, as its first launch makes them (without training)."""
    config = load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path, storage=url),
                                           "first.yaml"))
    engine = create_store_engine(url)
    upgrade_to_head(engine)
    study, _ = study_manager.open_study(config, url)
    get_or_create_sweep(engine, "tiny", study.study_name, config.canonical_text())
    engine.dispose()


CHANGES = {
    "study.direction": ({"study": {"direction": "maximize", "metric": "eval_loss",
                                   "sampler": "grid", "seed": 0}},
                        "created with 'minimize', not 'maximize'"),
    "study.metric": ({"study": {"direction": "minimize", "metric": "train_loss",
                                "sampler": "grid", "seed": 0}},
                     "created with 'eval_loss', not 'train_loss'"),
    "parameters": ({"parameters": {"train.lr": {"values": [1e-2, 1e-3]}}},
                   "created with another search space"),
}


@pytest.mark.parametrize("key", list(CHANGES))
def test_a_sweep_recorded_otherwise_is_refused_naming_the_key(
        key: str, storage_url: str, tmp_path: Path) -> None:
    _create(storage_url, tmp_path)
    before = _snapshot(storage_url)
    sections, expected = CHANGES[key]
    path = write_sweep(tmp_path, tiny_sweep(tmp_path, storage=storage_url, **sections))
    with pytest.raises(ConfigError) as info:
        run_sweep(load_sweep_config(path))
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: sweep 'tiny' already exists in ")
    assert expected in message and "\n" not in message
    assert _snapshot(storage_url) == before


def test_another_difference_is_refused_too(storage_url: str, tmp_path: Path) -> None:
    _create(storage_url, tmp_path)
    before = _snapshot(storage_url)
    path = write_sweep(tmp_path, tiny_sweep(tmp_path, storage=storage_url,
                                            train={"max_steps": 7}))
    with pytest.raises(StorageError, match="tiny.*different configuration"):
        run_sweep(load_sweep_config(path))
    assert _snapshot(storage_url) == before


@pytest.mark.parametrize(("section", "key", "expected"), [
    ({"train": {"max_steps": 7}}, "train.max_steps", "created with train.max_steps 6, not 7"),
    ({"model": {"config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32}}},
     "model.config.n_layer", "created with model.config.n_layer 1, not 2"),
    ({"model": {"config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32},
                "peft": {"r": 4}}}, "model.peft", "created with model.peft null, not {"),
    ({"output": {"save": "all"}}, "output.save", 'created with output.save "best", not "all"'),
])
def test_another_difference_names_the_file_and_the_key(
    storage_url: str, tmp_path: Path, section: dict[str, Any], key: str, expected: str,
) -> None:
    _create(storage_url, tmp_path)
    before = _snapshot(storage_url)
    path = write_sweep(tmp_path, tiny_sweep(tmp_path, storage=storage_url, **section))
    with pytest.raises(StorageError) as info:
        run_sweep(load_sweep_config(path))
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: sweep 'tiny' already exists in "), message
    assert expected in message and "\n" not in message
    assert "give the sweep a new name (--set name=...)" in message
    assert _snapshot(storage_url) == before


def test_a_study_sweepmaster_did_not_create_is_refused_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.create_study(study_name="tiny", storage=url, direction="maximize")
    study.enqueue_trial({"train.lr": 1e-2, "train.batch_size": 2})
    before = _snapshot(url)
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: study 'tiny' in {url} was not created by sweepmaster for this sweep; give the "
        "sweep another name or use another --storage"]
    assert _snapshot(url) == before
    assert not (tmp_path / "checkpoints").exists()


def test_a_study_made_by_open_study_is_joined_only_with_its_direction(tmp_path: Path) -> None:
    minimize = load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path), "min.yaml"))
    study_manager.open_study(minimize, minimize.storage)  # the Python API, no launch yet
    before = _snapshot(minimize.storage)
    maximize = load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path, study={
        "direction": "maximize", "metric": "eval_loss", "sampler": "grid", "seed": 0})))
    with pytest.raises(ConfigError, match="study.direction: .*created with 'minimize'"):
        run_sweep(maximize)
    assert _snapshot(minimize.storage) == before
