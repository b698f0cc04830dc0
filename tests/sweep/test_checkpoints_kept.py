"""Nothing lost: each sweep's weights in its own directory, records never name deleted files.

Two sweeps of the same name in two databases, launched from one folder, keep their best weights
apart; ``save: best`` clears the records of the folders it deletes; a launch killed with
SIGKILL while it writes weights leaves every record pointing at complete weights, and the
relaunch ends with the best trial's weights alone.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from safetensors.torch import load_file

from sweepmaster.config import load_sweep_config
from sweepmaster.store import create_store_engine, get_sweep, trial_progress
from sweepmaster.sweep import SweepObserver, run_sweep
from sweepmaster.sweep.results import load_results
from sweepmaster.sweep.resume import sweep_output_dir
from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep

TWO_CELLS = {"train.lr": {"values": [1e-2, 3e-3]}, "train.batch_size": {"values": [4]}}


def _recorded_paths(url: str, name: str) -> dict[int, str]:
    engine = create_store_engine(url)
    try:
        sweep = get_sweep(engine, name)
        assert sweep is not None
        return {r.trial_number: r.checkpoint_path for r in trial_progress(engine, sweep.id)
                if r.checkpoint_path}
    finally:
        engine.dispose()


def test_two_sweeps_of_one_name_in_two_databases_keep_their_own_weights(
        tmp_path: Path, storage_url: str) -> None:
    out = tmp_path / "checkpoints"  # one folder, as when both are launched from one directory
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    first = load_sweep_config(write_sweep(first_dir, tiny_sweep(
        first_dir, "quickstart", parameters=TWO_CELLS, output={"dir": str(out)})))
    second = load_sweep_config(write_sweep(second_dir, tiny_sweep(
        second_dir, "quickstart", storage=storage_url, output={"dir": str(out)},
        parameters={"train.lr": {"values": [3e-3, 1e-3]}, "train.batch_size": {"values": [2]}})))
    run_sweep(first)
    before = load_results(first.storage, "quickstart")
    run_sweep(second)

    dirs = sorted(out.iterdir())
    assert len(dirs) == 2 and all(d.name.startswith("quickstart-") for d in dirs)
    results = [load_results(first.storage, "quickstart"), load_results(storage_url, "quickstart")]
    paths = []
    for config, url, result in zip((first, second), (first.storage, storage_url), results,
                                   strict=True):
        engine = create_store_engine(url)
        sweep = get_sweep(engine, "quickstart")
        engine.dispose()
        assert sweep is not None
        (best,) = [t for t in result.trials if t.checkpoint_path]
        assert Path(best.checkpoint_path or "").parent == sweep_output_dir(config, sweep)
        assert load_file(Path(best.checkpoint_path or "") / "model.safetensors")
        paths.append(best.checkpoint_path)
    assert paths[0] != paths[1]
    assert [t.checkpoint_path for t in results[0].trials] == [
        t.checkpoint_path for t in before.trials]  # the second sweep left the first's alone


def test_save_best_never_leaves_a_record_of_a_deleted_folder(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={"train.lr": {"values": [1e-4, 1e-3, 3e-3, 1e-2]},
                                           "train.batch_size": {"values": [4]}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    run_sweep(config)
    recorded = _recorded_paths(config.storage, "tiny")
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    assert list(recorded) == [study.best_trial.number]
    assert all(Path(p).is_dir() for p in recorded.values())
    assert not any("checkpoint_path" in t.user_attrs for t in study.trials)
    (sweep_dir,) = (tmp_path / "checkpoints").iterdir()
    assert [p.name for p in sweep_dir.glob("trial-*")] == [f"trial-{study.best_trial.number}"]


def _launch(path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                            cwd=path.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _assert_records_point_at_complete_weights(url: str, name: str) -> dict[int, str]:
    recorded = _recorded_paths(url, name)
    for path in recorded.values():
        assert (Path(path) / "config.json").is_file(), path
        assert load_file(Path(path) / "model.safetensors"), path
    return recorded


@pytest.mark.slow
def test_sigkill_while_weights_are_written_loses_nothing(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, "kill", train={"max_steps": 6, "eval_every": 3,
                                              "checkpoint_every": 3},
                     resources={"devices": "cpu",
                                "trial_heartbeat": {"interval_s": 1, "grace_period_s": 2}})
    path = write_sweep(tmp_path, raw)
    config = load_sweep_config(path)
    out = Path(config.output.dir)

    first = _launch(path)
    deadline = time.monotonic() + 300
    # Killed the moment weights start to appear: a temporary folder, or the finished one.
    while not (list(out.glob("kill-*/.trial-*")) or list(out.glob("kill-*/trial-*"))):
        assert first.poll() is None, first.communicate()[0].decode()[-2000:]
        assert time.monotonic() < deadline, "no weights written within 300 s"
        time.sleep(0.001)
    first.send_signal(signal.SIGKILL)
    first.wait()
    _assert_records_point_at_complete_weights(config.storage, "kill")

    second = _launch(path)
    output = second.communicate(timeout=600)[0].decode()
    assert second.returncode == 0, output[-3000:]
    recorded = _assert_records_point_at_complete_weights(config.storage, "kill")
    study = optuna.load_study(study_name="kill", storage=config.storage)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    cells = Counter((t.params["train.lr"], t.params["train.batch_size"]) for t in complete)
    assert len(cells) == 4 and set(cells.values()) == {1}
    assert list(recorded) == [study.best_trial.number]
    (sweep_dir,) = out.glob("kill-*")
    assert [p.name for p in sweep_dir.glob("trial-*")] == [f"trial-{study.best_trial.number}"]


def test_a_relaunch_deletes_the_folders_of_dead_saves_but_not_a_running_trial_s(
        tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={"train.lr": {"values": [1e-2]},
                                           "train.batch_size": {"values": [4]}},
                     resources={"trial_heartbeat": {"interval_s": None}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    run_sweep(config)
    (sweep_dir,) = (tmp_path / "checkpoints").iterdir()
    kept = sorted(p.name for p in sweep_dir.iterdir())
    study = optuna.load_study(study_name="tiny", storage=config.storage)
    running = study.ask()  # another launch's trial, saving its weights right now
    dead = [sweep_dir / ".trial-0.tmp-k9x2", sweep_dir / ".trial-0.old-3fa1",
            sweep_dir / ".trial-17.tmp-0001"]  # the last: a trial the study never had
    live = sweep_dir / f".trial-{running.number}.tmp-ab12"
    for folder in (*dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)

    run_sweep(config)

    assert sorted(p.name for p in sweep_dir.iterdir()) == sorted([*kept, live.name])
    assert (live / "model.safetensors").stat().st_size == 4096


class _Messages(SweepObserver):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)


@pytest.mark.parametrize("recorded", [True, False], ids=["named", "not-named"])
def test_the_folder_of_an_older_layout_is_adopted_when_the_records_name_it(
        recorded: bool, tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={"train.lr": {"values": [1e-2]},
                                           "train.batch_size": {"values": [4]}})
    config = load_sweep_config(write_sweep(tmp_path, raw))
    run_sweep(config)
    # What an older version left: <output.dir>/<sweep>/ with the weights its records name,
    # and the training state of a trial interrupted before the upgrade.
    out = tmp_path / "checkpoints"
    (new,) = out.iterdir()
    old = out / "tiny"
    new.rename(old)
    (old / "state" / "trial-7").mkdir(parents=True)
    (old / "state" / "trial-7" / "state-000003.pt").write_bytes(b"\1" * 1000)
    weights = (old / "trial-0" / "model.safetensors").read_bytes()
    connection = sqlite3.connect(tmp_path / "sweep.db")
    with connection:
        connection.execute("UPDATE sm_trial_progress SET checkpoint_path = ?",
                           (str(old / "trial-0") if recorded else None,))
    connection.close()

    observer = _Messages()
    run_sweep(config, observer=observer)

    if not recorded:  # another database's sweep of this name may own it: left alone
        assert sorted(p.name for p in out.iterdir()) == ["tiny"]
        assert observer.lines[0] == (f"{old} holds files of an older sweepmaster that no record "
                                     "of this sweep names: left there; this sweep keeps its "
                                     f"weights and training state in {new}")
        return
    assert observer.lines[0] == (f"moved {old} (this sweep's files, written by an older "
                                 f"sweepmaster) to {new}; its interrupted trials resume from "
                                 "there")
    assert old.is_symlink() and old.resolve() == new
    assert (new / "trial-0" / "model.safetensors").read_bytes() == weights
    assert (new / "state" / "trial-7" / "state-000003.pt").stat().st_size == 1000
    assert _recorded_paths(config.storage, "tiny") == {0: str(new / "trial-0")}
