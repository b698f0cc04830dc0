"""The ``sweepmaster`` command line (Typer + rich).

Every error a user can cause prints one line, ``error: <what>``, and exits with code 2; Ctrl-C
during ``launch`` marks the running trial FAIL (it runs again on relaunch) and exits with 130.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from sweepmaster.errors import SweepmasterError

app = typer.Typer(
    name="sweepmaster",
    help="Hyperparameter sweeps of many oversized models on few devices, kept in Optuna.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Manage sweepmaster's tables in a storage database.",
                     no_args_is_help=True)
app.add_typer(db_app, name="db")

console = Console()
err_console = Console(stderr=True)

DEFAULT_STORAGE = "sqlite:///sweepmaster.db"
StorageOption = Annotated[
    str | None,
    typer.Option("--storage", help="SQLAlchemy URL of the database (default: the sweep's own, "
                 f"else {DEFAULT_STORAGE}).", envvar="SWEEPMASTER_STORAGE", show_default=False),
]
HostOption = Annotated[str, typer.Option(
    "--host", help="Address the dashboard binds; any but a loopback address needs --token.")]
PortOption = Annotated[int, typer.Option("--port", help="Dashboard port (0: a free one).")]
TokenOption = Annotated[str | None, typer.Option(
    "--token", envvar="SWEEPMASTER_DASHBOARD_TOKEN", show_default=False,
    help="Token every dashboard request must carry (required off localhost).")]
T = TypeVar("T")


def _guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; a user error becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except SweepmasterError as exc:  # the message may quote user text: no markup in it
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(2) from None


class _LaunchDisplay:
    """Progress bars for ``launch``: all trials, and the running trial's steps."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.sweep_task: TaskID | None = None
        self.trial_task: TaskID | None = None
        self.eval_text = ""
        self.first_ppl: dict[int, float] = {}
        self.last_ppl: dict[int, float] = {}

    def message(self, text: str) -> None:
        self.progress.console.print(f"[dim]{text}[/]")

    def sweep_started(self, name: str, n_trials: int, n_finished: int) -> None:
        self.progress.start()
        done = f"{n_finished} already finished" if n_finished else "new"
        self.sweep_task = self.progress.add_task(f"sweep {name}", total=n_trials,
                                                 completed=n_finished, info=done)

    def trial_started(self, number: int, params: dict[str, Any], total_steps: int,
                      device: str) -> None:
        shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in params.items())
        self.progress.console.print(f"trial {number} on {device}: {shown}")
        self.eval_text = ""
        if self.trial_task is not None:
            self.progress.remove_task(self.trial_task)
        self.trial_task = self.progress.add_task(f"  trial {number}", total=total_steps,
                                                 info="")

    def trial_step(self, number: int, event: Any) -> None:
        if self.trial_task is None:
            return
        self.progress.update(
            self.trial_task, completed=event.step,
            info=f"loss {event.train_loss:.3f}  {event.tokens_per_s:,.0f} tok/s{self.eval_text}")

    def trial_evaluated(self, number: int, event: Any) -> None:
        self.eval_text = f"  eval ppl {event.eval_perplexity:,.1f}"
        self.first_ppl.setdefault(number, event.eval_perplexity)
        self.last_ppl[number] = event.eval_perplexity

    def trial_finished(self, number: int, state: str, objective: float | None,
                       reason: str | None) -> None:
        colour = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red"}.get(state, "white")
        detail = f" objective {objective:.4f}" if objective is not None else ""
        if number in self.first_ppl:
            detail += (f", eval ppl {self.first_ppl[number]:,.1f} at step 0 -> "
                       f"{self.last_ppl[number]:,.1f}")
        detail += f" ({reason})" if reason else ""
        self.progress.console.print(f"trial {number} [{colour}]{state}[/]{detail}",
                                    highlight=False)
        if self.sweep_task is not None and state in ("COMPLETE", "PRUNED"):
            self.progress.advance(self.sweep_task)

    def stop(self) -> None:
        self.progress.stop()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _short_names(names: list[str]) -> dict[str, str]:
    """Column headers for dotted parameter paths: the last part where that is unambiguous."""
    last = [n.rsplit(".", 1)[-1] for n in names]
    pairs = zip(names, last, strict=True)
    return {n: (short if last.count(short) == 1 else n) for n, short in pairs}


def _results_table(results: Any) -> Table:
    """Render :class:`sweepmaster.results.SweepResults` as a rich table, best trial first."""
    param_names = sorted({k for t in results.trials for k in t.params})
    headers = _short_names(param_names)
    arrow = "↓" if results.direction == "minimize" else "↑"
    table = Table(title=f"sweep {results.name} ({results.status}): "
                  f"{results.count('COMPLETE')} complete, {results.count('PRUNED')} pruned, "
                  f"{results.count('FAIL')} failed, {results.count('RUNNING')} running",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for name in param_names:
        table.add_column(headers[name], no_wrap=True)
    table.add_column(f"{results.metric} {arrow}", justify="right", no_wrap=True)
    table.add_column("eval ppl", justify="right", no_wrap=True)
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("tok/s", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("device", no_wrap=True)
    colours = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red", "RUNNING": "cyan"}
    for t in results.trials:
        ppl = t.eval_perplexity
        table.add_row(
            str(t.number), f"[{colours.get(t.state, 'white')}]{t.state}[/]",
            *[_fmt(t.params[n]) if n in t.params else "" for n in param_names],
            "" if t.objective is None else f"{t.objective:.4f}",
            "" if ppl is None or not math.isfinite(ppl) else f"{ppl:,.1f}",
            f"{t.step}/{t.total_steps}" if t.total_steps else "",
            "" if not t.tokens_per_s else f"{t.tokens_per_s:,.0f}",
            "" if t.duration_s is None else f"{t.duration_s:.0f}s",
            t.device or "",
        )
    return table


def _print_results(storage: str, name: str) -> None:
    from sweepmaster.results import load_results

    results = load_results(storage, name)
    console.print(_results_table(results))
    for t in results.trials:
        if t.state == "FAIL" and t.reason:
            console.print(f"[red]trial {t.number} failed:[/] {t.reason}", highlight=False)
    best = next((t for t in results.trials if t.objective is not None), None)
    if best is not None and best.checkpoint_path:
        console.print(f"best trial {best.number}: weights in {best.checkpoint_path}")


@app.command()
def launch(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep.yaml to run.",
                                               show_default=False)],
    storage: StorageOption = None,
    n_trials: Annotated[int | None, typer.Option(
        "--n-trials", min=1, help="Finished trials wanted in total (default: study.n_trials, "
        "or the grid size).", show_default=False)] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a setting of the file: --set data.dir=/data/wikitext-2 "
        "(repeatable; the value is read as YAML).", show_default=False)] = None,
    dashboard: Annotated[bool, typer.Option(
        "--dashboard", help="Serve the web dashboard while the sweep runs.")] = False,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8080,
    token: TokenOption = None,
) -> None:
    """Run a sweep (or resume it): train its trials and record them in the database."""
    from transformers.utils import logging as transformers_logging

    from sweepmaster.config import load_sweep_config
    from sweepmaster.sweep import run_sweep

    config = _guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    url = storage or config.storage
    transformers_logging.disable_progress_bar()  # ours are enough
    server = None
    if dashboard:
        server = _guarded(lambda: _start_dashboard(url, host, port, token))
    display = _LaunchDisplay()
    try:
        outcome = _guarded(lambda: run_sweep(config, storage=url, n_trials=n_trials,
                                             observer=display))  # type: ignore[arg-type]
    except KeyboardInterrupt:
        display.stop()
        err_console.print("[yellow]interrupted:[/] the running trial is marked FAIL and runs "
                          "again when you launch the sweep again")
        raise typer.Exit(130) from None
    finally:
        display.stop()
        if server is not None:
            server.stop()
    if outcome.num_run == 0:
        console.print(f"sweep {config.name}: nothing left to run "
                      f"({outcome.num_finished} trials finished)")
    _guarded(lambda: _print_results(url, config.name))


@app.command()
def status(
    storage: StorageOption = None,
    sweep: Annotated[str | None, typer.Option("--sweep", help="Sweep name (default: all).",
                                              show_default=False)] = None,
) -> None:
    """Print the trials of one sweep (or of every sweep) from the database, best first."""
    from sweepmaster.results import sweep_names

    url = storage or DEFAULT_STORAGE

    def show() -> None:
        names = [sweep] if sweep else sweep_names(url)
        if not names:
            console.print(f"no sweeps in {url}")
        for name in names:
            _print_results(url, name)

    _guarded(show)


@app.command()
def validate(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep.yaml to check.",
                                               show_default=False)],
) -> None:
    """Check a sweep.yaml and print its search space, without touching any database."""
    from sweepmaster.config import load_sweep_config

    def check() -> None:
        config = load_sweep_config(sweep_file)
        console.print(f"{sweep_file}: sweep {config.name!r} is valid")
        for name, dist in config.search_space().items():
            console.print(f"  {name}: {dist}", highlight=False)
        for name, value in config.constants().items():
            console.print(f"  {name} = {value!r}", highlight=False)
        if config.study.sampler.type == "grid":
            console.print(f"  grid of {config.grid_size()} configurations")

    _guarded(check)


@app.command("dashboard")
def dashboard_command(
    storage: StorageOption = None,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8080,
    token: TokenOption = None,
) -> None:
    """Serve the web dashboard (read-only): live trials, learning curves, devices."""
    from sweepmaster.dashboard import serve

    url = storage or DEFAULT_STORAGE
    try:
        _guarded(lambda: serve(url, host, port, token,
                               on_ready=lambda u: console.print(f"dashboard: {u}")))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _start_dashboard(url: str, host: str, port: int, token: str | None) -> Any:
    """Bring the database to head, then serve the dashboard from a background thread."""
    from sweepmaster.dashboard import start_in_background
    from sweepmaster.store import create_store_engine, upgrade_to_head

    upgrade_to_head(create_store_engine(url))
    handle = start_in_background(url, host, port, token)
    console.print(f"dashboard: {handle.login_url}")
    return handle


@db_app.command("upgrade")
def db_upgrade(storage: StorageOption = None) -> None:
    """Create or migrate sweepmaster's tables to the newest schema."""
    from sweepmaster.store import create_store_engine, current_revision, upgrade_to_head

    url = storage or DEFAULT_STORAGE

    def run() -> None:
        engine = create_store_engine(url)
        upgrade_to_head(engine)
        console.print(f"{url}: sweepmaster tables at revision {current_revision(engine)}")

    _guarded(run)


@db_app.command("current")
def db_current(storage: StorageOption = None) -> None:
    """Print the schema revision of sweepmaster's tables (none before the first upgrade)."""
    from sweepmaster.store import create_store_engine, current_revision

    url = storage or DEFAULT_STORAGE
    _guarded(lambda: console.print(f"{url}: {current_revision(create_store_engine(url))}"))


def main() -> None:
    """Entry point for ``python -m sweepmaster``."""
    app(prog_name="sweepmaster")


if __name__ == "__main__":
    main()
