"""The terminal: user text printed as text, tables that fit 80 columns, quiet and quick commands.

A real sweep whose parameter value and failure reason hold rich markup (``[/x]``) runs through
``launch``, ``status``, ``validate`` and ``plan`` in subprocesses, output piped (80 columns).
"""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from sweepmaster.sweep.results import SweepResults, TrialRow
from tests.kit.sweeps import EXAMPLES, tiny_sweep, write_sweep

MARKUP = "[/x]"  # rich reads it as a closing tag that matches nothing: MarkupError


def sweepmaster(*args: object, cwd: Path, columns: int | None = None
                ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["OMP_NUM_THREADS"] = "1"  # one intra-op thread: much faster on a busy machine
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "sweepmaster", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=600)


def assert_plain(result: subprocess.CompletedProcess[str]) -> None:
    both = result.stdout + result.stderr
    assert "Traceback" not in both and "MarkupError" not in both, both
    assert "Warning" not in both, both  # third-party warnings only with --verbose


@pytest.fixture(scope="module")
def markup_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A launched sweep, plus a failed trial whose parameter value and reason are ``[/x]``."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    root = tmp_path_factory.mktemp("markup")
    raw = tiny_sweep(root, parameters={"train.batch_size": {"values": [2, 4]}})
    path = write_sweep(root, raw)
    launched = sweepmaster("launch", path, cwd=root)
    assert launched.returncode == 0, launched.stderr
    assert_plain(launched)
    storage = f"sqlite:///{root / 'sweep.db'}"
    study = optuna.load_study(study_name="tiny", storage=storage)
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL,
        params={"train.batch_size": 2, "model.config.activation_function": MARKUP},
        distributions={"train.batch_size": CategoricalDistribution([2, 4]),
                       "model.config.activation_function": CategoricalDistribution([MARKUP])},
        system_attrs={"fail_reason": f"KeyError: '{MARKUP}' [bold]"}))
    return path, storage


def test_status_prints_markup_as_text_at_80_columns(markup_sweep: tuple[Path, str]) -> None:
    path, storage = markup_sweep
    result = sweepmaster("status", "--storage", storage, cwd=path.parent)  # piped: 80 columns
    assert result.returncode == 0, result.stderr
    assert_plain(result)
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    header = next(line for line in lines if line.split()[:2] == ["#", "state"])
    assert header
    rows = [line.split() for line in lines if line.split()[1:2] in (["COMPLETE"], ["FAIL"])]
    import optuna

    numbers = [t.number for t in optuna.load_study(study_name="tiny", storage=storage).trials]
    assert sorted(int(row[0]) for row in rows) == numbers
    assert sum(MARKUP in row for row in rows) == 1
    assert f"failed: KeyError: '{MARKUP}' [bold]" in result.stdout
    again = sweepmaster("status", "--storage", storage, cwd=path.parent)  # stays readable
    assert again.returncode == 0 and MARKUP in again.stdout


def test_validate_prints_markup_as_text(tmp_path: Path) -> None:
    raw = tiny_sweep(tmp_path, parameters={
        "model.config.activation_function": {"values": ["gelu_new", MARKUP]}})
    path = write_sweep(tmp_path, raw)
    validated = sweepmaster("validate", path, cwd=tmp_path)
    assert_plain(validated)  # valid (a search space line) or not (one error line): as typed
    assert validated.returncode in (0, 2)
    assert MARKUP in validated.stdout + validated.stderr


def test_launch_display_prints_markup_as_text() -> None:
    from sweepmaster.cli.launch_progress import LaunchDisplay

    out = Console(file=io.StringIO(), width=120, record=True)
    display = LaunchDisplay(out)
    display.message(f"job 1 ({MARKUP}): trains plain")
    display.sweep_started("s", n_trials=2, n_finished=0)
    display.trial_started(0, {"model.config.activation_function": MARKUP}, total_steps=4,
                          device="cpu")
    display.trial_finished(0, "FAIL", None, f"KeyError: '{MARKUP}' [bold]")
    display.stop()
    text = out.export_text()
    assert f"job 1 ({MARKUP})" in text and f"activation_function={MARKUP}" in text
    assert f"(KeyError: '{MARKUP}' [bold])" in text


def test_plan_of_a_spilled_sweep_fits_80_columns(tmp_path: Path) -> None:
    result = sweepmaster("plan", EXAMPLES / "spill-cpu.yaml", "--storage",
                         f"sqlite:///{tmp_path / 'x.db'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_plain(result)
    out = result.stdout
    assert out.count("spills") == 2 and "embed .. " in out and "recompute" in out
    assert "trains spills" not in out and "mode spills" in out
    for name in ("est. step", "peak", "budget", "bwd peak", "activations"):  # nothing left out
        assert name in out
    assert "not shown" not in out
    assert max(len(line) for line in out.splitlines()) <= 80, out


def _results(num_params: int, spilled: bool) -> SweepResults:
    params = {f"model.config.param_{i}": 0.001234 * (i + 1) for i in range(num_params)}
    trials = [TrialRow(number=n, state="COMPLETE", params=params, objective=3.5 - n / 10,
                       eval_loss=3.4, step=100, total_steps=100, tokens_per_s=12345.0,
                       device="cuda:0, cuda:1", duration_s=61.0, num_shards=3 if spilled else 1,
                       swap_bytes=2**30 if spilled else 0, num_promotes=1200, num_demotes=1200,
                       p2p_bytes=2**20 if spilled else 0, num_replans=n % 2)
              for n in range(12)]
    return SweepResults("wide", "completed", "minimize", "eval_loss", trials)


@pytest.mark.parametrize("num_params", [1, 4, 9])
def test_results_table_keeps_the_number_column_at_80_columns(num_params: int) -> None:
    from sweepmaster.cli.results_tables import results_table as _results_table

    out = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    out.print(_results_table(_results(num_params, spilled=True), out))
    text = out.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert any(line.split()[:2] == ["#", "state"] for line in lines), text
    numbers = [line.split()[0] for line in lines if "COMPLETE" in line]
    assert sorted(map(int, numbers)) == list(range(12))
    assert "3.5000" in text  # the objective always stays
    wide = Console(width=250, file=io.StringIO(), record=True, color_system=None)
    wide.print(_results_table(_results(num_params, spilled=True), wide))
    wide_text = wide.export_text()
    assert "not shown" not in wide_text and "promotes" in wide_text
    assert "p2p" in wide_text and "1.0 MiB" in wide_text and "replans" in wide_text
    header = next(line for line in lines if line.split()[:2] == ["#", "state"])
    assert "p2p" not in header and "p2p" in text  # hidden at 80 columns, named as not shown


def test_help_does_not_import_torch_or_transformers() -> None:
    code = ("import sys, click, typer.main, sweepmaster.cli as cli\n"
            "command = typer.main.get_command(cli.app)\n"
            "context = click.Context(command, info_name='sweepmaster')\n"
            "command.get_help(context)\n"
            "for sub in command.commands.values():\n"
            "    sub.get_help(click.Context(sub, info_name=sub.name, parent=context))\n"
            "import sweepmaster.sweep.results, sweepmaster.sweep.workers  # what status needs\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_launch_display_estimates_time_left_and_names_each_step_task() -> None:
    from sweepmaster.cli.launch_progress import _UTILIZATION_WINDOW_S, LaunchDisplay
    from sweepmaster.runtime.events import StepEvent, TaskRecord

    display = LaunchDisplay(Console(file=io.StringIO(), width=120))
    display.sweep_started("s", n_trials=4, n_finished=0)
    display.trial_started(0, {"train.lr": 0.1}, total_steps=10, device="cpu")
    sweep = next(t for t in display.progress.tasks if t.description == "sweep s")
    for step in range(1, 6):
        time.sleep(0.01)  # rich estimates speed from distinct sample times
        display.trial_step(0, StepEvent(job="trial-0", step=step, total_steps=10, epoch=0,
                                        train_loss=1.0, lr=0.1, tokens_per_s=1.0,
                                        device="cpu"))
    assert sweep.completed == pytest.approx(0.5)
    assert sweep.time_remaining is not None  # shown as a time, not -:--:--
    now = time.time()
    display.task_finished(TaskRecord(device="cpu", job="trial-0", shard=0, kind="backward",
                                     start_s=now - 1, end_s=now, swap_bytes=0, peak_bytes=None,
                                     step=5))  # a trial that fits: one shard, a task per step
    assert display.devices["cpu"].current == "trial-0 step 6"  # not "backward shard 0"
    # busy for what its tasks took, once (the trial's own start does not count again)
    busy = display.devices["cpu"].utilization(now)
    assert busy == pytest.approx(1.0 / _UTILIZATION_WINDOW_S)
    display.trial_finished(0, "COMPLETE", 1.0, None)
    assert sweep.completed == 1
    display.stop()


def test_a_resumed_trial_names_the_step_of_its_first_evaluation() -> None:
    from sweepmaster.cli.launch_progress import LaunchDisplay
    from sweepmaster.runtime.events import EvalEvent

    out = Console(file=io.StringIO(), width=120, record=True)
    display = LaunchDisplay(out)
    display.sweep_started("s", n_trials=1, n_finished=0)
    display.trial_started(1, {"train.lr": 0.1}, total_steps=100, device="cpu")
    for step, ppl in ((50, 200.0), (100, 150.0)):  # resumed from its checkpoint of step 25
        display.trial_evaluated(1, EvalEvent(job="trial-1", step=step, total_steps=100,
                                             eval_loss=math.log(ppl), eval_perplexity=ppl))
    display.trial_finished(1, "COMPLETE", 5.0, None)
    display.stop()
    assert "trial 1 COMPLETE objective 5.0000, eval ppl 200.0 at step 50 -> 150.0" \
        in out.export_text()


def test_tokenizing_is_announced_only_when_the_cache_misses(tmp_path: Path) -> None:
    from sweepmaster.config import load_sweep_config
    from sweepmaster.config.train_specs import prepare_data

    config = load_sweep_config(write_sweep(tmp_path, tiny_sweep(tmp_path)))
    calls: list[int] = []
    first = prepare_data(config, on_tokenize=lambda: calls.append(1))
    assert calls  # a cold cache tokenizes
    calls.clear()
    second = prepare_data(config, on_tokenize=lambda: calls.append(1))
    assert not calls
    assert (first.train == second.train).all()


def test_help_reflows_to_80_columns(tmp_path: Path) -> None:
    result = sweepmaster("launch", "--help", cwd=tmp_path, columns=80)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any("fits no device is an error" in line for line in lines), result.stdout
    assert "--dashboard" in result.stdout and "Ctrl-C" in result.stdout


def test_piped_launch_display_keeps_counts_and_times_whole_and_says_how_far_it_is() -> None:
    from sweepmaster.cli.launch_progress import LaunchDisplay
    from sweepmaster.runtime.events import EvalEvent, StepEvent, TaskRecord

    out = Console(file=io.StringIO(), width=80, record=True, color_system=None)
    display = LaunchDisplay(out)
    display.sweep_started("llama-spill-cpu-quickstart", n_trials=6, n_finished=2)
    display.trial_started(12, {"train.lr": 0.001}, total_steps=120, device="cpu")
    display.trial_evaluated(12, EvalEvent(job="trial-12", step=60, total_steps=120,
                                          eval_loss=7.0, eval_perplexity=1234.5))
    display.trial_step(12, StepEvent(job="trial-12", step=61, total_steps=120, epoch=0,
                                     train_loss=5.123, lr=1e-3, tokens_per_s=12345.0,
                                     device="cpu"))
    now = time.time()
    for job, shard, kind in (("trial-12", 0, "backward"), ("trial-7", 0, "forward"),
                             ("trial-7", 0, "backward")):
        display.task_finished(TaskRecord(device="cpu", job=job, shard=shard, kind=kind,
                                         start_s=now - 1, end_s=now, swap_bytes=3 << 30,
                                         peak_bytes=None, step=60))
    sweep = next(t for t in display.progress.tasks if t.description.startswith("sweep"))
    assert sweep.fields["info"] == "2 finished, 1 running"  # not "new" for the whole run
    assert display.devices["cpu"].current == "trial-7 backward shard 0"  # a spilled job's
    display.stop()
    text = out.export_text()
    assert "…" not in text, text  # nothing squeezed to "0…" or "0:0…"
    assert "61/120" in text and "2/6" in text and "0:00:0" in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
