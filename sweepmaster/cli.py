"""The ``sweepmaster`` command line (Typer + rich).

Every error a user can cause prints one line, ``error: <what>``, and exits with code 2; Ctrl-C
during ``launch`` marks the running trial FAIL (it runs again on relaunch) and exits with 130.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
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
DevicesOption = Annotated[str | None, typer.Option(
    "--devices", show_default=False,
    help="Devices to train on, overriding resources.devices: auto (every GPU, else the CPU), "
    "cpu, cuda:0,cuda:1, or cpu:2x512MiB (two virtual devices: CPU memory with a 512 MiB "
    "budget each).")]
DeviceMemoryOption = Annotated[str | None, typer.Option(
    "--device-memory", show_default=False,
    help="Cap every device's memory budget, e.g. 8GiB (overrides resources.device_memory).")]
T = TypeVar("T")


def _guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; a user error becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except SweepmasterError as exc:  # the message may quote user text: no markup in it
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(2) from None


def _fmt(value: Any) -> str:
    """A parameter value for a table: floats with 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_size(num_bytes: float) -> str:
    """Bytes for people: ``"512 B"``, ``"12.0 KiB"``, ``"256.0 MiB"``, ``"1.25 GiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            digits = 2 if unit == "GiB" else 1
            return f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{num_bytes:.0f} B"


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
    spilled = results.any_spilled  # swap columns only for sweeps where some trial spilled
    if spilled:
        table.add_column("shards", justify="right", no_wrap=True)
        table.add_column("swap", justify="right", no_wrap=True)
        table.add_column("promotes", justify="right", no_wrap=True)
        table.add_column("demotes", justify="right", no_wrap=True)
    colours = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red", "RUNNING": "cyan"}
    for t in results.trials:
        ppl = t.eval_perplexity
        swap_cells = [
            "" if t.num_shards is None else str(t.num_shards),
            format_size(t.swap_bytes) if t.swap_bytes else "",
            f"{t.num_promotes:,}" if t.spilled else "",
            f"{t.num_demotes:,}" if t.spilled else "",
        ] if spilled else []
        table.add_row(
            str(t.number), f"[{colours.get(t.state, 'white')}]{t.state}[/]",
            *[_fmt(t.params[n]) if n in t.params else "" for n in param_names],
            "" if t.objective is None else f"{t.objective:.4f}",
            "" if ppl is None or not math.isfinite(ppl) else f"{ppl:,.1f}",
            f"{t.step}/{t.total_steps}" if t.total_steps else "",
            "" if not t.tokens_per_s else f"{t.tokens_per_s:,.0f}",
            "" if t.duration_s is None else f"{t.duration_s:.0f}s",
            t.device or "",
            *swap_cells,
        )
    return table


def _ratio(num_bytes: int, budget_bytes: int) -> str:
    ratio = num_bytes / budget_bytes
    return f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2f}x"


def _layers_text(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _job_mode(job: Any) -> str:
    if job.error is not None:
        return "[red]too large[/]"
    if job.plan is None:
        return "plain (host)"
    return "[yellow]spills[/]" if job.spill else "[green]plain[/]"


def _plan_jobs_table(sweep_plan: Any) -> Table:
    """The jobs of a :class:`sweepmaster.planning.SweepPlan`, one row per job and device class."""
    jobs = sweep_plan.jobs
    labelled = any(job.params for job in jobs)
    classes = len({job.devices for job in jobs}) > 1
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    table.add_column("job", justify="right", no_wrap=True)
    table.add_column("trials", justify="right", no_wrap=True)
    if labelled:
        table.add_column("parameters", no_wrap=True)
    if classes:
        table.add_column("devices", no_wrap=True)
    fusion = sweep_plan.fusion != "off"
    for name in ("trains", "shards", "tasks/step", "swap/step", "est. step", "peak",
                 "plain footprint", "budget", "footprint/budget", "plan",
                 *(["fusion"] if fusion else [])):
        table.add_column(name, justify="left" if name in ("trains", "plan") else "right",
                         no_wrap=True)
    for job in jobs:
        plan = job.plan if job.spill else None
        cells = [str(job.number), str(len(job.configs))]
        cells += [job.label] if labelled else []
        cells += [", ".join(job.devices)] if classes else []
        cells += [
            _job_mode(job),
            str(len(plan.shards)) if plan else "",
            str(plan.num_tasks_per_step) if plan else "",
            format_size(plan.swap_bytes_per_step) if plan else "",
            f"{plan.step_s:.2f} s" if plan else "",
            format_size(plan.peak_bytes) if plan else "",
            format_size(job.plain_bytes),
            format_size(job.budget_bytes),
            _ratio(job.plain_bytes, job.budget_bytes),
            "" if job.plan is None else ("cached" if job.cached else "new"),
        ]
        cells += [_fusion_cell(job.fusion)] if fusion else []
        table.add_row(*cells)
    return table


def _fusion_cell(fusion: Any) -> str:
    """The fusion column of ``plan``: ``K=2``, ``K=? (auto)``, ``1 (spills)``."""
    if fusion is None or fusion.k is None:
        return "K=? (auto)"
    if fusion.source in ("spills", "unfusable"):
        return f"1 ({fusion.source})"
    return f"K={fusion.k}"


def _fusion_line(job: Any) -> str:
    """One line per job for ``plan``: its fusion degree, why, and the fused arrays of a grid."""
    label = f" ({job.label})" if job.params else ""
    line = f"job {job.number}{label} fusion on {', '.join(job.devices)}: {job.fusion.note}"
    sizes = job.fusion.array_sizes
    arrays = [size for size in sizes if size > 1]
    if arrays:
        counts = sorted(collections.Counter(arrays).items(), reverse=True)
        shape = " and ".join(f"{n} of {size}" for size, n in counts)
        plural = "s" if len(arrays) > 1 else ""
        line += f"; its {sum(sizes)} trials form {len(arrays)} fused array{plural} " + (
            f"of {arrays[0]}" if len(counts) == 1 else f"({shape})")
        alone = len(sizes) - len(arrays)
        line += f", {alone} trial{'s' if alone > 1 else ''} train{'s' * (alone == 1)} alone" \
            if alone else ""
    return line


def _plan_memory_table(job: Any) -> Table:
    """The swap / recompute plan of one spilled job's activations (mu-TWO)."""
    memory, plan = job.memory_plan, job.plan
    table = Table(
        title=f"job {job.number}: activations kept (K), swapped (S) or recomputed (R) per "
        f"layer; est. step {memory.step_s:.3f} s against {plan.step_s:.3f} s recomputing all, "
        f"{format_size(memory.swap_bytes_per_step)} swapped per step at "
        f"{memory.bandwidth / 2**30:.1f} GiB/s",
        box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for name in ("shard", "layers", "decisions", "kept", "swapped", "recomputed", "peak",
                 "overhead s", "recompute-all s"):
        table.add_column(name, justify="left" if name in ("layers", "decisions") else "right",
                         no_wrap=True)
    for row in memory.summary():
        table.add_row(str(row.shard), row.layers, row.decisions, format_size(row.kept_bytes),
                      format_size(row.swapped_bytes), format_size(row.recomputed_bytes),
                      format_size(row.peak_bytes), f"{row.overhead_s:.3f}",
                      f"{row.full_recompute_s:.3f}")
    return table


def _plan_shards_table(job: Any, what: str = "") -> Table:
    """The shards of one spilled job (``what``: e.g. a fused array's stacked shards)."""
    plan = job.plan
    label = f" ({job.label})" if job.params else ""
    label += f" {what}" if what else ""
    table = Table(
        title=f"job {job.number}{label}: {len(plan.shards)} shards on {', '.join(job.devices)}, "
        f"batch {plan.batch_size}, {plan.num_tasks_per_step} shard tasks and "
        f"{format_size(plan.swap_bytes_per_step)} swapped per step",
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("shard", "layers", "microbatch", "params", "grads", "optimizer",
                 "activations", "fwd peak", "bwd peak", "fwd s", "bwd s"):
        table.add_column(name, justify="left" if name == "layers" else "right", no_wrap=True)
    for shard in plan.shards:
        table.add_row(
            str(shard.index), _layers_text(shard.layer_names), str(shard.microbatch_size),
            format_size(shard.param_bytes), format_size(shard.param_bytes),
            format_size(shard.optimizer_bytes), format_size(shard.activation_bytes),
            format_size(shard.forward_peak_bytes) if shard.forward_peak_bytes else "",
            format_size(shard.backward_peak_bytes),
            f"{shard.forward_s:.3f}" if shard.forward_peak_bytes else "",
            f"{shard.backward_s:.3f}",
        )
    return table


def _job_line(job: Any) -> str:
    """One line per job for ``launch``: how it will train."""
    label = f" ({job.label})" if job.params else ""
    where = ", ".join(job.devices)
    ratio = f"{format_size(job.plain_bytes)}, {_ratio(job.plain_bytes, job.budget_bytes)} " \
        f"the {format_size(job.budget_bytes)} budget"
    if job.spill:
        plan = job.plan
        return (f"job {job.number}{label}: spills into {len(plan.shards)} shards on {where} "
                f"(plain footprint {ratio}); est. {plan.step_s:.2f} s and "
                f"{format_size(plan.swap_bytes_per_step)} swapped per step")
    return f"job {job.number}{label}: trains plain on {where} (footprint {ratio})"


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
    for cell in results.unfinished:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in cell.params.items())
        why = (f"failed {cell.num_failed} time(s): {cell.reason}" if cell.num_failed
               else "never ran")
        console.print(f"[yellow]cell not finished:[/] {escape(params)} ({escape(why)})",
                      highlight=False)
    if results.status in ("failed", "incomplete"):
        console.print(f"[red]sweep {escape(name)} {results.status}:[/] "
                      f"{results.count('COMPLETE') + results.count('PRUNED')} trial(s) finished",
                      highlight=False)
    _print_workers(storage, name)


def _print_workers(storage: str, name: str) -> None:
    """The sweep's workers (host, pid, devices, state, heartbeat age, trials), if it has any."""
    from sweepmaster.workers import sweep_workers

    workers = sweep_workers(storage, name)
    if not workers:
        return
    table = Table(title=f"workers of sweep {name}", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False)
    for column in ("worker", "host", "pid", "devices", "state", "last heartbeat", "running",
                   "finished"):
        table.add_column(column, no_wrap=True,
                         justify="right" if column in ("worker", "pid", "running", "finished")
                         else "left")
    colours = {"running": "green", "stopped": "white", "lost": "red"}
    for w in workers:
        table.add_row(str(w.id), w.host, str(w.pid), w.devices,
                      f"[{colours[w.status]}]{w.status}[/]", f"{w.heartbeat_age_s:.0f}s ago",
                      str(w.num_running), str(w.num_finished))
    console.print(table)


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
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    dashboard: Annotated[bool, typer.Option(
        "--dashboard", help="Serve the web dashboard while the sweep runs.")] = False,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8080,
    token: TokenOption = None,
) -> None:
    """Run a sweep (or resume it): train its trials and record them in the database.

    Jobs that do not fit their device spill (train shard by shard); a layer that fits no device
    is an error before anything is written.
    """
    from sweepmaster.config import load_sweep_config

    config = _guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    config = _guarded(lambda: config.with_resources(devices, device_memory))
    _train(config, storage or config.storage, n_trials, devices, device_memory,
           (host, port, token) if dashboard else None)


def _train(config: Any, url: str, n_trials: int | None, devices: str | None,
           device_memory: str | None, dashboard: tuple[str, int, str | None] | None) -> None:
    """Train a sweep's trials as one worker (``launch`` and ``worker``), then print them."""
    from transformers.utils import logging as transformers_logging

    from sweepmaster.sweep import run_sweep

    transformers_logging.disable_progress_bar()  # ours are enough
    job_lines = _guarded(lambda: _check_jobs_fit(config, url, devices, device_memory))
    server = None
    if dashboard is not None:
        server = _guarded(lambda: _start_dashboard(url, *dashboard))
    from sweepmaster.display import LaunchDisplay

    display = LaunchDisplay(console)
    for line in job_lines:
        display.message(line)
    try:
        outcome = _guarded(lambda: run_sweep(config, storage=url, n_trials=n_trials,
                                             observer=display))
    except KeyboardInterrupt:
        display.stop()
        err_console.print("[yellow]interrupted:[/] the running trials are marked FAIL and run "
                          "again when you launch the sweep again")
        raise typer.Exit(130) from None
    finally:
        display.stop()
        if server is not None:
            server.stop()
    if outcome.num_run == 0 and outcome.status == "completed":
        console.print(f"sweep {config.name}: nothing left to run "
                      f"({outcome.num_finished} trials finished)")
    _guarded(lambda: _print_results(url, config.name))
    if outcome.status != "completed":  # every trial failed, or cells were abandoned
        raise typer.Exit(1)


@app.command()
def worker(
    storage: Annotated[str, typer.Option(
        "--storage", envvar="SWEEPMASTER_STORAGE", show_default=False,
        help="SQLAlchemy URL of the sweep's database, e.g. "
        "postgresql+psycopg://user@dbhost:5432/sweeps.")],
    sweep: Annotated[str, typer.Option("--sweep", help="Name of the sweep to join.",
                                       show_default=False)],
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    n_trials: Annotated[int | None, typer.Option(
        "--n-trials", min=1, help="Finished trials wanted in total (default: study.n_trials, "
        "or the grid size).", show_default=False)] = None,
) -> None:
    """Join a sweep that was launched elsewhere: train its trials here until it is done.

    The sweep's configuration is read from the database (its data and tokenizer paths must
    exist on this host); Optuna hands out the trials, so several workers on several hosts
    share one sweep and no grid cell runs twice. `status` and the dashboard show every worker.
    """
    from sweepmaster.workers import load_joined_config

    config = _guarded(lambda: load_joined_config(storage, sweep))
    config = _guarded(lambda: config.with_resources(devices, device_memory))
    _train(config, storage, n_trials, devices, device_memory, None)


def _check_jobs_fit(config: Any, url: str, devices: str | None,
                    device_memory: str | None) -> list[str]:
    """Open the devices and plan the sweep's jobs on metered ones; one line per job.

    ``devices`` / ``device_memory`` are the command line's (already in ``config``), so that
    errors name the option rather than the file.

    Raises:
        DeviceError: A device is missing, or a job has a layer that fits no device.
    """
    from sweepmaster.planning import open_devices, plan_sweep

    if all(device.meter is None for device in open_devices(config, devices, device_memory)):
        return []  # the host CPU trains every job plain
    sweep_plan = plan_sweep(config, devices=devices, device_memory=device_memory, storage=url)
    return [_job_line(job) for job in sweep_plan.jobs]


@app.command()
def plan(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep.yaml to plan.",
                                               show_default=False)],
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    storage: StorageOption = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a setting of the file, as for launch (repeatable).",
        show_default=False)] = None,
    measure_fusion: Annotated[bool, typer.Option(
        "--measure-fusion", help="With resources.fusion: auto, measure the fusion degrees the "
        "cache lacks (trains a few steps of K = 1, 2, 4, ... models on a device).")] = False,
) -> None:
    """Print how each job of a sweep would train, without training anything.

    Per job: spilled or plain, its shards with their bytes and estimated times, shard tasks and
    swap volume per step, its plain footprint against the device budget, and for a spilled job
    which activations each shard keeps, swaps to the host or recomputes. A job is a set of
    trials sharing one architecture (model, dtype, batch and block size, optimizer kind). Plans
    are read from, and new ones written to, the storage's partition cache when its database
    exists; plan never creates a database. With resources.fusion on, each job's fusion degree K
    (auto: from the storage's fusion cache, else "not measured" unless --measure-fusion) and,
    for a grid, the fused arrays its trials form.
    """
    from sweepmaster.config import load_sweep_config
    from sweepmaster.planning import plan_sweep

    config = _guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    config = _guarded(lambda: config.with_resources(devices, device_memory))
    with console.status("planning (profiling each architecture once"
                        + (", measuring fusion degrees)" if measure_fusion else ")")):
        sweep_plan = _guarded(lambda: plan_sweep(config, devices=devices,
                                                 device_memory=device_memory, storage=storage,
                                                 measure_fusion=measure_fusion))
    console.print(f"sweep {sweep_plan.name}: {sweep_plan.num_jobs} job(s) from "
                  f"{sweep_plan.num_configs} configuration(s) on {', '.join(sweep_plan.devices)}",
                  highlight=False)
    for note in sweep_plan.notes:
        console.print(f"  [dim]{note}[/]", highlight=False)
    console.print(_plan_jobs_table(sweep_plan))
    for job in sweep_plan.jobs:
        if job.fusion is not None:
            console.print(_fusion_line(job), highlight=False)
    for job in sweep_plan.jobs:
        if job.spill:
            console.print(_plan_shards_table(job))
        fusion = job.fusion
        if fusion is not None and fusion.stacked_plan is not None:
            console.print(_plan_shards_table(dataclasses.replace(job, plan=fusion.stacked_plan),
                                             f"fused array of {fusion.k} (stacked shards)"))
        if job.memory_plan is not None:
            console.print(_plan_memory_table(job))
        elif job.spill:
            console.print(f"job {job.number}: every activation is recomputed in the backward "
                          "tasks (Hydra): no keep / swap plan fits beside the shards' peaks",
                          highlight=False)
        if job.error is not None:
            console.print(f"[red]job {job.number} on {', '.join(job.devices)}:[/] {job.error}",
                          highlight=False)


@app.command()
def status(
    storage: StorageOption = None,
    sweep: Annotated[str | None, typer.Option("--sweep", help="Sweep name (default: all).",
                                              show_default=False)] = None,
) -> None:
    """Print the trials of one sweep (or of every sweep) from the database, best first.

    For a sweep in which a trial spilled, also its shards, swap volume and promotes/demotes.
    """
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
