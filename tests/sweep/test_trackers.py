"""output.report_to: each trial's run in TensorBoard, MLflow and W&B, read back offline.

TensorBoard's event files are read with its ``EventAccumulator``, MLflow's local file store
(``file:`` URI) with ``MlflowClient``, and W&B's offline run files (``WANDB_MODE=offline``)
record by record with wandb's own protobuf messages.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from sweepmaster.cli import app
from sweepmaster.config import load_sweep_config, parse_sweep_config
from sweepmaster.errors import ConfigError
from sweepmaster.sweep import SweepObserver, run_sweep
from tests.kit.sweeps import tiny_sweep, write_sweep

LRS = [1e-2, 3e-3]


def tracked_sweep(tmp_path: Path, report_to: list[str], **sections: Any) -> dict[str, Any]:
    """The tiny sweep, 2 trials of 4 steps evaluated every 2, reported to ``report_to``."""
    raw = tiny_sweep(tmp_path, train={"max_steps": 4, "eval_every": 2},
                     output={"report_to": report_to}, **sections)
    raw["parameters"] = {"train.lr": {"values": LRS}, "train.weight_decay": {"value": 0.01}}
    return raw


def sweep_dir(tmp_path: Path) -> Path:
    """The tiny sweep's output directory (``<output.dir>/<name>-<id>``)."""
    (found,) = (tmp_path / "checkpoints").glob("tiny-*")
    return found


def trial_params(url: str) -> dict[int, dict[str, Any]]:
    """Each trial's parameters as Optuna holds them, with the constant one."""
    import optuna

    study = optuna.load_study(study_name="tiny", storage=url)
    return {t.number: {**t.params, "train.weight_decay": 0.01} for t in study.trials}


def recorded_metrics(url: str) -> dict[int, dict[str, dict[int, float]]]:
    """sweepmaster's own sm_metrics: trial number -> metric -> step -> value."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text(
                "SELECT p.trial_number, m.name, m.step, m.value FROM sm_metrics m "
                "JOIN sm_trial_progress p ON p.id = m.trial_progress_id")).all()
            objectives = dict(connection.execute(sa.text(
                "SELECT trial_number, objective FROM sm_trial_progress")).all())
    finally:
        engine.dispose()
    out: dict[int, dict[str, dict[int, float]]] = {}
    for number, name, step, value in rows:
        out.setdefault(number, {}).setdefault(name, {})[step] = value
    for number, objective in objectives.items():
        out.setdefault(number, {})["objective"] = {-1: objective}
    return out


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B ``.wandb`` file (a LevelDB-style log of protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, header = 32768, 7
    position, chunk, records = header, b"", []
    while position + header <= len(data):
        left = block - position % block
        if left < header:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + header])
        if length == 0 and kind == 0:
            position += left
            continue
        chunk += data[position + header:position + header + length]
        position += header + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _key(item: Any) -> str:
    """A W&B history or summary item's key (nested keys joined by ``/``)."""
    return item.key or "/".join(item.nested_key)


def wandb_run(run_file: Path) -> tuple[str, str, dict[str, Any], dict[str, dict[int, float]],
                                       dict[str, Any]]:
    """Name, group, config, history (metric -> step -> value) and summary of a W&B run file."""
    name = group = ""
    config: dict[str, Any] = {}
    history: dict[str, dict[int, float]] = {}
    summary: dict[str, Any] = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name, group = record.run.display_name, record.run.run_group
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[row.get("_step", 0)] = value
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
    return name, group, config, history, summary


def tensorboard_run(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, Any]]:
    """Scalars (tag -> step -> value) and HParams (name -> value) of a TensorBoard run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
               for tag in events.Tags()["scalars"]}
    hparams: dict[str, Any] = {}
    for content in events.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                hparams[key] = getattr(value, value.WhichOneof("kind"))
    return scalars, hparams


def approx(metrics: dict[str, dict[int, float]]) -> dict[str, dict[int, Any]]:
    return {name: {step: pytest.approx(v, rel=1e-6) for step, v in by_step.items()}
            for name, by_step in metrics.items()}


@pytest.fixture
def offline_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MLflow on a local file store, W&B offline: both under ``tmp_path``."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3: file stores opt in
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return tmp_path


def test_every_tracker_gets_a_run_per_trial_with_every_metric(offline_trackers: Path) -> None:
    tmp_path = offline_trackers
    raw = tracked_sweep(tmp_path, ["tensorboard", "mlflow", "wandb"])
    config = load_sweep_config(write_sweep(tmp_path, raw))
    messages: list[str] = []

    class Messages(SweepObserver):
        def message(self, text: str) -> None:
            messages.append(text)

    outcome = run_sweep(config, observer=Messages())

    assert (outcome.num_finished, outcome.status) == (2, "completed")
    assert not [m for m in messages if "no longer reported" in m], messages
    stored = recorded_metrics(raw["storage"])
    params_of = trial_params(raw["storage"])
    assert sorted(stored) == [0, 1]
    assert sorted(p["train.lr"] for p in params_of.values()) == sorted(LRS)
    for number in (0, 1):
        params = params_of[number]
        mine = {name: by_step for name, by_step in stored[number].items() if name != "objective"}
        objective = stored[number]["objective"][-1]
        assert set(mine) == {"train_loss", "lr", "tokens_per_s", "eval_loss", "eval_perplexity"}
        assert sorted(mine["train_loss"]) == [1, 2, 3, 4]
        assert sorted(mine["eval_loss"]) == [0, 2, 4]
        run_name = f"tiny-trial-{number}"

        # TensorBoard: one folder per trial, every metric by step, params and objective.
        scalars, hparams = tensorboard_run(sweep_dir(tmp_path) / "tensorboard"
                                           / run_name)
        assert scalars.pop("objective") == {4: pytest.approx(objective)}
        assert scalars == approx(mine)
        assert hparams == pytest.approx(params)

        # MLflow: experiment named after the sweep, one run per trial.
        from mlflow import MlflowClient

        client = MlflowClient()
        experiment = client.get_experiment_by_name("tiny")
        (run,) = client.search_runs([experiment.experiment_id],
                                    f"attributes.run_name = '{run_name}'")
        assert run.info.status == "FINISHED"
        assert run.data.params == {key: str(value) for key, value in params.items()}
        assert run.data.tags["sweepmaster.trial"] == str(number)
        logged = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id,
                                                                            name)}
                  for name in [*mine, "objective"]}
        assert logged.pop("objective") == {4: pytest.approx(objective)}
        assert logged == approx(mine)

    # W&B: offline run files, one per trial, grouped under the sweep.
    runs = {}
    for run_file in (sweep_dir(tmp_path) / "wandb").glob("offline-run-*/*.wandb"):
        name, group, wandb_config, history, summary = wandb_run(run_file)
        runs[name] = (group, wandb_config, history, summary)
    assert sorted(runs) == ["tiny-trial-0", "tiny-trial-1"]
    for number in (0, 1):
        group, wandb_config, history, summary = runs[f"tiny-trial-{number}"]
        mine = {name: by_step for name, by_step in stored[number].items() if name != "objective"}
        assert group == "tiny"
        assert {k: v for k, v in wandb_config.items() if k != "_wandb"} == params_of[number]
        assert history == approx(mine)
        assert summary["objective"] == pytest.approx(stored[number]["objective"][-1])
        assert summary["state"] == "COMPLETE"


def test_fused_arrays_report_each_member(tmp_path: Path) -> None:
    raw = tracked_sweep(tmp_path, ["tensorboard"], resources={"fusion": 2})
    config = load_sweep_config(write_sweep(tmp_path, raw))

    assert run_sweep(config).num_finished == 2

    engine = sa.create_engine(raw["storage"])
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT COUNT(*) FROM sm_fusion_groups")).scalar()
    engine.dispose()
    stored = recorded_metrics(raw["storage"])
    for number in (0, 1):
        scalars, hparams = tensorboard_run(sweep_dir(tmp_path) / "tensorboard"
                                           / f"tiny-trial-{number}")
        assert scalars.pop("objective") == {4: pytest.approx(stored[number]["objective"][-1])}
        assert scalars == approx({k: v for k, v in stored[number].items() if k != "objective"})
        assert hparams == pytest.approx(trial_params(raw["storage"])[number])


def test_a_tracker_without_its_library_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    path = write_sweep(tmp_path, tracked_sweep(tmp_path, ["tensorboard", "wandb"]))
    before = sorted(tmp_path.iterdir())

    result = CliRunner().invoke(app, ["launch", str(path)])

    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {path}: output.report_to: trackers whose library is installed: "
                     "wandb needs the wandb package (pip install 'sweepmaster[trackers]', or "
                     "pip install wandb)"]
    assert sorted(tmp_path.iterdir()) == before


def test_report_to_names(tmp_path: Path) -> None:
    base = tiny_sweep(tmp_path)
    for value, expected in (("tensorboard", ["tensorboard"]), ("none", []), (None, []),
                            (["mlflow", "wandb"], ["mlflow", "wandb"])):
        raw = {**base, "output": {**base["output"], "report_to": value}}
        assert parse_sweep_config(raw).output.report_to == expected
    raw = {**base, "output": {**base["output"], "report_to": ["tensorbord"]}}
    with pytest.raises(ConfigError, match=r"output\.report_to\.0: .*'tensorboard'"):
        parse_sweep_config(raw)
    # A sweep recorded before report_to existed keeps its text; one that reports records it.
    assert "report_to" not in json.loads(parse_sweep_config(base).canonical_text())["output"]
    raw = {**base, "output": {**base["output"], "report_to": "tensorboard"}}
    text = parse_sweep_config(raw).canonical_text()
    assert json.loads(text)["output"]["report_to"] == ["tensorboard"]


def test_a_worker_joining_the_sweep_reports_its_trials(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    raw = tracked_sweep(tmp_path, ["tensorboard"])
    config = load_sweep_config(write_sweep(tmp_path, raw))
    assert run_sweep(config, n_trials=1).num_run == 1  # the launch trains trial 0 only

    result = CliRunner().invoke(app, ["worker", "--storage", raw["storage"], "--sweep", "tiny"])

    assert result.exit_code == 0, result.output
    stored = recorded_metrics(raw["storage"])
    assert sorted(stored) == [0, 1]
    runs = sorted(p.name for p in (sweep_dir(tmp_path) / "tensorboard").iterdir())
    assert runs == ["tiny-trial-0", "tiny-trial-1"]
    scalars, _ = tensorboard_run(sweep_dir(tmp_path) / "tensorboard" / "tiny-trial-1")
    assert scalars.pop("objective") == {4: pytest.approx(stored[1]["objective"][-1])}
    assert scalars == approx({k: v for k, v in stored[1].items() if k != "objective"})
