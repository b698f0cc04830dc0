import os
import subprocess
import sys

import optuna

from tests.kit.data import ROOT
from tests.kit.sweeps import tiny_sweep, write_sweep

#: Launched processes: wide tables, one intra-op thread each (much faster on a busy machine).
ENV = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


def sweepmaster(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sweepmaster", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=ENV)


def test_invalid_file_exits_2_with_one_line_and_writes_nothing(tmp_path):
    raw = tiny_sweep(tmp_path)
    raw["train"]["batch_size"] = "eight"
    path = write_sweep(tmp_path, raw, "bad.yaml")
    result = sweepmaster("launch", path, cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "bad.yaml" in lines[0] and "train.batch_size" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "sweep.db").exists()
    assert not (tmp_path / "checkpoints").exists()


def test_missing_file_exits_2(tmp_path):
    result = sweepmaster("launch", tmp_path / "nope.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "nope.yaml" in result.stderr


def test_launch_then_status_prints_the_table(tmp_path):
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    result = sweepmaster("launch", path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "COMPLETE" in result.stdout
    # the launch closed its SQLite connections before exiting: the -wal is checkpointed, gone
    assert not (tmp_path / "sweep.db-wal").exists()
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    best = study.best_trial

    # status and the relaunch train nothing: in this process (the launch above was a real one)
    runner = CliRunner()
    status = runner.invoke(app, ["status", "--storage", storage], env={"COLUMNS": "200"})
    assert status.exit_code == 0, status.output
    table_lines = [line for line in status.stdout.splitlines() if "COMPLETE" in line]
    assert len(table_lines) == 4
    assert f"{best.value:.4f}" in table_lines[0]  # best first

    again = runner.invoke(app, ["launch", str(path)], env={"COLUMNS": "200"})
    assert again.exit_code == 0, again.output
    assert "nothing left to run" in again.stdout
    assert len(optuna.load_study(study_name="tiny", storage=storage).trials) == 4
    # a relaunch with nothing to run leaves no worker row behind: only the launch that trained
    from sweepmaster.sweep.workers import sweep_workers

    assert [w.num_finished for w in sweep_workers(storage, "tiny")] == [4]

    # other resources join the same sweep: the relaunch says why it trains nothing, and how
    fused = runner.invoke(app, ["launch", str(path), "--set", "resources.fusion=2"],
                          env={"COLUMNS": "200"})
    assert fused.exit_code == 0, fused.output
    line = next(line for line in fused.stdout.splitlines() if "nothing left to run" in line)
    assert "resources (devices, fusion, pipeline) are not part of a sweep's identity" in line
    assert "--set name=tiny-2" in line and "--n-trials 8" in line
    assert len(optuna.load_study(study_name="tiny", storage=storage).trials) == 4
    renamed = runner.invoke(app, ["launch", str(path), "--set", "resources.fusion=2",
                                  "--set", "name=tiny-2"], env={"COLUMNS": "200"})
    assert renamed.exit_code == 0, renamed.output
    assert "nothing left to run" not in renamed.stdout
    trials = optuna.load_study(study_name="tiny-2", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4


def test_status_of_an_unknown_sweep_exits_2(tmp_path):
    storage = f"sqlite:///{tmp_path / 'x.db'}"
    assert sweepmaster("db", "upgrade", "--storage", storage, cwd=tmp_path).returncode == 0
    result = sweepmaster("status", "--storage", storage, "--sweep", "nope", cwd=tmp_path)
    assert result.returncode == 2
    assert "nope" in result.stderr


def test_validate_prints_the_search_space(tmp_path):
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    result = sweepmaster("validate", path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "train.lr" in result.stdout and "grid of 4" in result.stdout
    assert not (tmp_path / "sweep.db").exists()


def test_the_exit_collections_do_not_visit_what_the_command_imported(tmp_path):
    # CPython's exit runs four full collections over every tracked object (some 100,000 after
    # validate: the modules of transformers, pydantic, rich...); main() leaves them almost none
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('tracked at exit:', len(gc.get_objects())))\n"
            "from sweepmaster.cli import main\n"
            f"sys.argv = ['sweepmaster', 'validate', {str(path)!r}]\n"
            "main()\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, env=ENV)
    assert result.returncode == 0, result.stderr
    assert "grid of 4" in result.stdout  # the command ran
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("tracked at exit:"), result.stdout
    assert int(last.split(":")[1]) < 1_000


def test_validate_applies_set_and_reports_a_bad_value_in_one_line(tmp_path):
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    result = sweepmaster("validate", path, "--set",
                         "parameters={train.lr: {values: [0.1, 0.2, 0.3]}}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "grid of 3" in result.stdout and "train.batch_size" not in result.stdout

    bad = sweepmaster("validate", path, "--set", "train.batch_size=eight", cwd=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.batch_size" in lines[0], bad.stderr
    assert "Traceback" not in bad.stderr


def test_sigint_marks_the_running_trial_failed_and_exits_130(tmp_path):
    import signal
    import time

    from sweepmaster.store import create_store_engine, get_sweep, trial_progress

    raw = tiny_sweep(tmp_path, train={"max_steps": 100_000, "eval_every": 100_000})
    path = write_sweep(tmp_path, raw)
    proc = subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, "COLUMNS": "80"})
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    deadline = time.monotonic() + 120
    rows = []
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if not (tmp_path / "sweep.db").exists():
            continue
        try:
            engine = create_store_engine(storage)
            sweep = get_sweep(engine, "tiny")
            rows = trial_progress(engine, sweep.id) if sweep else []
        except Exception:
            continue  # tables not created yet
        if rows and rows[0].step >= 2:
            break
    assert rows and rows[0].step >= 2, "the trial never started"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert [line for line in stderr.splitlines() if line.strip()] == [  # one line at 80 columns
        "interrupted: the running trials are marked FAIL and run again when you launch the "
        "sweep again"]

    engine = create_store_engine(storage)
    sweep = get_sweep(engine, "tiny")
    assert sweep.status == "interrupted"
    (row,) = trial_progress(engine, sweep.id)
    assert row.state == "FAIL" and "interrupted" in row.failure_reason
    (trial,) = optuna.load_study(study_name="tiny", storage=storage).trials
    assert trial.state == optuna.trial.TrialState.FAIL


def record_sweep(storage: str, name: str, device_stats: list[dict | None]) -> None:
    """A study with one COMPLETE trial per entry, its progress rows written by the recorder."""
    from sweepmaster.store import (
        ProgressRecorder,
        create_store_engine,
        get_or_create_sweep,
        upgrade_to_head,
    )

    engine = create_store_engine(storage)
    upgrade_to_head(engine)
    study = optuna.create_study(study_name=name, storage=storage)
    sweep = get_or_create_sweep(engine, name, name, f"name: {name}\n")
    recorder = ProgressRecorder(engine, sweep.id)
    for index, stats in enumerate(device_stats):
        trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2)})
        recorder.trial_started(trial.number, trial._trial_id, total_steps=4, device="cpu:0")
        recorder.step(trial.number, 4, 4, train_loss=3.0, tokens_per_s=100.0, lr=1e-3)
        recorder.finished(trial.number, "COMPLETE", objective=3.0 + index, device_stats=stats)
        study.tell(trial, 3.0 + index)


def test_status_shows_swap_columns_only_for_sweeps_that_spilled(tmp_path):
    from typer.testing import CliRunner

    from sweepmaster.cli import app
    from sweepmaster.sweep.results import load_results

    storage = f"sqlite:///{tmp_path / 'status.db'}"
    spilled = {"swap_bytes": 3 * 2**30 // 2, "num_promotes": 120, "num_demotes": 96,
               "num_shards": 4, "peak_device_bytes": 250 * 2**20}
    plain = {"swap_bytes": 0, "num_promotes": 0, "num_demotes": 0, "num_shards": 1}
    record_sweep(storage, "spilly", [spilled, plain, {**spilled, "swap_bytes": 300 * 2**20}])
    record_sweep(storage, "plainly", [plain, None])

    results = load_results(storage, "spilly")
    assert results.any_spilled and [t.spilled for t in results.trials] == [True, False, True]
    first = results.trials[0]
    assert (first.swap_bytes, first.num_promotes, first.num_demotes, first.num_shards,
            first.peak_device_bytes) == (3 * 2**30 // 2, 120, 96, 4, 250 * 2**20)
    assert not load_results(storage, "plainly").any_spilled

    runner = CliRunner()
    result = runner.invoke(app, ["status", "--storage", storage, "--sweep", "spilly"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "state" in line)
    assert header.split()[-4:] == ["shards", "swap", "promotes", "demotes"]
    rows = [line.split() for line in result.stdout.splitlines() if "COMPLETE" in line]
    assert rows[0][-5:] == ["4", "1.50", "GiB", "120", "96"]
    assert rows[1][-1] == "1"  # the plain trial: one shard, nothing swapped
    assert rows[2][-5:] == ["4", "300.0", "MiB", "120", "96"]

    result = runner.invoke(app, ["status", "--storage", storage, "--sweep", "plainly"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "swap" not in result.stdout and "promotes" not in result.stdout


def test_piped_status_shows_the_spill_columns_with_wide_json_and_csv(tmp_path):
    import csv
    import io
    import json

    from typer.testing import CliRunner

    from sweepmaster.cli import app

    storage = f"sqlite:///{tmp_path / 'status.db'}"
    spilled = {"swap_bytes": 3 * 2**30 // 2, "num_promotes": 120, "num_demotes": 96,
               "num_shards": 4, "peak_device_bytes": 250 * 2**20, "p2p_bytes": 2**20}
    record_sweep(storage, "spilly", [spilled, None])
    runner = CliRunner()
    piped = {"COLUMNS": "80"}

    narrow = runner.invoke(app, ["status", "--storage", storage], env=piped)
    assert narrow.exit_code == 0, narrow.output
    assert "not shown at 80 columns" in narrow.stdout and "promotes" in narrow.stdout

    wide = runner.invoke(app, ["status", "--storage", storage, "--wide"], env=piped)
    assert wide.exit_code == 0, wide.output
    assert "not shown" not in wide.stdout
    header = next(line for line in wide.stdout.splitlines() if "state" in line)
    assert header.split()[-5:] == ["shards", "swap", "p2p", "promotes", "demotes"]
    (row,) = [line.split() for line in wide.stdout.splitlines() if "3.0000" in line]
    assert row[-7:] == ["4", "1.50", "GiB", "1.0", "MiB", "120", "96"]

    as_json = runner.invoke(app, ["status", "--storage", storage, "--format", "json"],
                            env=piped)
    assert as_json.exit_code == 0, as_json.output
    (sweep,) = json.loads(as_json.stdout)["sweeps"]
    assert sweep["name"] == "spilly" and sweep["status"]
    first = sweep["trials"][0]
    assert (first["num_shards"], first["swap_bytes"], first["p2p_bytes"], first["num_promotes"],
            first["num_demotes"], first["objective"]) == (4, 3 * 2**30 // 2, 2**20, 120, 96, 3.0)
    assert first["spilled"] and not sweep["trials"][1]["spilled"]

    as_csv = runner.invoke(app, ["status", "--storage", storage, "--format", "csv"], env=piped)
    assert as_csv.exit_code == 0, as_csv.output
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert len(rows) == 2 and rows[0]["sweep"] == "spilly"
    assert (rows[0]["num_shards"], rows[0]["swap_bytes"], rows[0]["p2p_bytes"],
            rows[0]["num_promotes"], rows[0]["num_demotes"]) == (
        "4", str(3 * 2**30 // 2), str(2**20), "120", "96")
    assert rows[0]["param:lr"] and rows[1]["swap_bytes"] == "0"

    bad = runner.invoke(app, ["status", "--storage", storage, "--format", "xml"], env=piped)
    assert bad.exit_code == 2


def test_status_shows_heartbeat_ages_as_the_dashboard_does(tmp_path):
    from datetime import timedelta

    from sqlalchemy import update
    from typer.testing import CliRunner

    from sweepmaster.cli import app
    from sweepmaster.cli.console import format_duration
    from sweepmaster.store import create_store_engine, get_sweep
    from sweepmaster.store.models import Worker, utcnow
    from sweepmaster.store.workers import register_worker, stop_worker

    assert [format_duration(s) for s in (0, 42.4, 1394, 7500, 59.6)] == [
        "0s", "42s", "23m 14s", "2h 05m", "1m 00s"]  # web/js/format.js's duration
    storage = f"sqlite:///{tmp_path / 'status.db'}"
    record_sweep(storage, "aged", [None])
    engine = create_store_engine(storage)
    worker = register_worker(engine, get_sweep(engine, "aged").id, "cpu")
    stop_worker(engine, worker)
    with engine.begin() as connection:
        connection.execute(update(Worker).values(heartbeat_at=utcnow() - timedelta(seconds=1394)))
    engine.dispose()
    result = CliRunner().invoke(app, ["status", "--storage", storage], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "23m 1" in result.stdout and "s ago" in result.stdout  # "23m 14s ago", not "1394s"
    assert "1394s" not in result.stdout


def test_launch_devices_option_trains_on_a_virtual_device(tmp_path):
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    path = write_sweep(tmp_path, tiny_sweep(tmp_path, train={"max_steps": 2, "eval_every": 2}))
    runner = CliRunner()
    bad = runner.invoke(app, ["launch", str(path), "--devices", "cpu:2xlots"])
    assert bad.exit_code == 2
    assert bad.stderr.startswith("error: --devices: expected a device spec")
    assert not (tmp_path / "sweep.db").exists()

    result = runner.invoke(app, ["launch", str(path), "--devices", "cpu:1x1GiB", "--n-trials",
                                 "1"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "trains as one resident shard on cpu:0" in result.stdout
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    from sweepmaster.sweep.results import load_results

    (trial,) = [t for t in load_results(storage, "tiny").trials if t.state == "COMPLETE"]
    assert trial.device == "cpu:0"
    # Devices are not part of the sweep's identity: it resumes on other devices.
    again = runner.invoke(app, ["launch", str(path), "--n-trials", "2"], env={"COLUMNS": "200"})
    assert again.exit_code == 0, again.output
    assert len(load_results(storage, "tiny").trials) == 2


def test_launch_dashboard_keeps_serving_after_the_sweep_until_ctrl_c(tmp_path):
    import json
    import re
    import signal
    import urllib.request

    path = write_sweep(tmp_path, tiny_sweep(tmp_path, parameters={
        "train.lr": {"values": [1e-2]}, "train.batch_size": {"values": [2]}}))
    proc = subprocess.Popen([sys.executable, "-m", "sweepmaster", "launch", str(path),
                             "--dashboard", "--port", "0"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    try:
        lines = []
        for line in proc.stdout:  # the sweep runs, then the dashboard says it stays
            lines.append(line)
            if "keeps serving" in line:
                break
        assert "keeps serving" in lines[-1], "".join(lines)
        assert "Ctrl-C" in lines[-1] and any("COMPLETE" in line for line in lines)
        url = re.search(r"http://\S+", lines[-1])[0]
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/sweeps", timeout=30) as response:
            assert "tiny" in json.dumps(json.load(response))
        assert proc.poll() is None  # still serving
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest
    assert "dashboard stopped" in rest and "Traceback" not in rest


def test_the_readme_s_bad_example_prints_the_readme_s_line(tmp_path):
    """examples/bad.yaml exists and fails exactly as README.md shows, writing nothing."""
    repo = str(ROOT)
    readme = open(os.path.join(repo, "README.md"), encoding="utf-8").read()
    expected = next(line for line in readme.splitlines()
                    if line.startswith("error: examples/bad.yaml: "))
    before = sorted(os.listdir(repo))
    result = sweepmaster("validate", "examples/bad.yaml", cwd=repo)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == expected
    assert sorted(os.listdir(repo)) == before  # no database, no checkpoints


def test_status_lists_every_device_of_a_trial_and_links_a_retry(tmp_path):
    """status reads the dashboard's links: a trial whose tasks ran on two devices lists both,
    and an interrupted trial points at its retry, also at 80 columns."""
    from typer.testing import CliRunner

    from sweepmaster.cli import app
    from sweepmaster.runtime.events import TaskRecord
    from sweepmaster.store import TaskEventRecorder, create_store_engine, get_sweep
    from sweepmaster.study import fail_trial, requeue_interrupted
    from sweepmaster.sweep.results import load_results

    storage = f"sqlite:///{tmp_path / 'links.db'}"
    record_sweep(storage, "links", [None])
    engine = create_store_engine(storage)
    study = optuna.load_study(study_name="links", storage=storage)
    [spilled] = study.trials
    recorder = TaskEventRecorder(engine, get_sweep(engine, "links").id, min_interval_s=0)
    recorder.name_job("trial-x", spilled.number)
    for shard, device in enumerate(["cpu:1", "cpu:0", "cpu:1"]):
        recorder.record(TaskRecord(device=device, job="trial-x", shard=shard, kind="forward",
                                   start_s=100.0 + shard, end_s=100.5 + shard, swap_bytes=0,
                                   peak_bytes=None, step=0))
    recorder.flush()
    engine.dispose()
    interrupted = study.ask(spilled.distributions)
    fail_trial(study, interrupted, "interrupted (Ctrl-C); runs again on relaunch",
               interrupted=True)
    assert requeue_interrupted(study) == 1
    retry = study.trials[-1].number

    rows = {t.number: t for t in load_results(storage, "links").trials}
    assert rows[spilled.number].devices == ("cpu:0", "cpu:1")
    assert rows[interrupted.number].retried_by == retry
    assert rows[retry].retried_by is None and rows[spilled.number].retried_by is None

    for columns in ("200", "80"):
        result = CliRunner().invoke(app, ["status", "--storage", storage, "--sweep", "links"],
                                    env={"COLUMNS": columns})
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert all(len(line) <= int(columns) for line in lines)
        [failed] = [line for line in lines if "FAIL" in line]
        assert failed.split()[:4] == [str(interrupted.number), "FAIL", "→", f"#{retry}"]
        if columns == "200":
            [complete] = [line for line in lines if "COMPLETE" in line]
            assert "cpu:0, cpu:1" in complete


def test_storage_help_names_each_commands_default():
    """Only the commands that read a sweep.yaml default to its `storage:`."""
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    for args, reads_a_file in ((["launch"], True), (["plan"], True), (["status"], False),
                               (["dashboard"], False), (["db", "upgrade"], False),
                               (["db", "current"], False)):
        result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())
        assert "sqlite:///sweepmaster.db" in text, (args, text)
        assert ("the sweep's own" in text) is reads_a_file, (args, text)


def test_a_port_past_65535_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """Not served on the port modulo 65536 (99999 would be 34463), and nothing is written."""
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    for args in (["dashboard", "--port", "99999"],
                 ["launch", str(path), "--dashboard", "--port", "70000"],
                 ["dashboard", "--port", "-1"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "Invalid value for '--port'" in result.stderr, result.stderr
        assert "dashboard:" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def _commands(command, path=()):
    """Every command and group of the CLI, as argument lists: [], ["launch"], ["db"], ..."""
    yield list(path)
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_help_shows_no_value_after_a_flag():
    """Typer's help types every option, flags too (``--verbose  <bool>``); flags take none."""
    import typer.main
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    helps = {}
    for args in _commands(typer.main.get_command(app)):
        result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (args, result.output)
        helps[" ".join(args)] = result.stdout
    assert {"", "launch", "plan", "db", "db current"} <= set(helps)
    for name, text in helps.items():
        assert "<bool>" not in text, (name, text)
        assert "--help " in text, (name, text)
    assert "--verbose  -v " in helps[""]
    assert "--dashboard " in helps["launch"] and "--measure-fusion " in helps["plan"]
    # an option that takes a value still shows its type
    assert "--port" in helps["dashboard"] and "<int range>" in helps["dashboard"]
    assert "<str>" in helps["db current"]


def test_a_blank_or_short_dashboard_token_is_refused_before_anything_runs(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from sweepmaster.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SWEEPMASTER_DASHBOARD_TOKEN", raising=False)
    path = write_sweep(tmp_path, tiny_sweep(tmp_path))
    for args, got in ((["dashboard", "--host", "0.0.0.0", "--token", "   "], "a blank one"),
                      (["dashboard", "--token", "short"], "one of 5 characters"),
                      (["launch", str(path), "--dashboard", "--host", "0.0.0.0", "--token",
                        "   "], "a blank one")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stderr.strip() == (
            "error: --token: expected a token of at least 8 characters without spaces (leave "
            f"it out off localhost for a generated one), got {got}"), result.stderr
        assert "dashboard:" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


def test_a_dashboard_off_localhost_without_a_token_prints_a_generated_one(tmp_path):
    import re
    import signal
    import urllib.error
    import urllib.request

    from sweepmaster.store import upgrade_to_head

    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    upgrade_to_head(url)
    env = {k: v for k, v in ENV.items() if k != "SWEEPMASTER_DASHBOARD_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "sweepmaster", "dashboard", "--host",
                             "0.0.0.0", "--port", "0", "--storage", url], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        line = proc.stdout.readline()
        found = re.search(r"http://\S+:(\d+)/\?token=([A-Za-z0-9_-]+)$", line.strip())
        assert found, line
        port, token = found.groups()
        assert len(token) >= 40
        local = f"http://127.0.0.1:{port}/api/sweeps"
        try:
            urllib.request.urlopen(local, timeout=30)
            raise AssertionError("served without the token")
        except urllib.error.HTTPError as err:
            assert err.code == 401
        request = urllib.request.Request(local, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
