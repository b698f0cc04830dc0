"""The ``sweepmaster`` command line (Typer + rich).

Every error a user can cause prints one line, ``error: <what>``, and exits with code 2; Ctrl-C
during ``launch`` marks the running trial FAIL (it runs again on relaunch) and exits with 130,
SIGTERM likewise with 143.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import gc
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.text import Text
from typer.core import TyperCommand, TyperGroup, TyperOption

from sweepmaster.errors import ConfigError, SweepmasterError


def _without_flag_metavars(params: list[Any]) -> list[Any]:
    """``params`` with an empty metavar on every flag, so help shows no value after it.

    Typer's rich help gives every option its type (``--verbose  <bool>``), flags too, which
    reads as if a flag took a value.
    """
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class _Command(TyperCommand):
    """A command whose help shows flags without a type (:func:`_without_flag_metavars`)."""

    def get_params(self, ctx: Any) -> list[Any]:  # a (vendored) click.Context
        return _without_flag_metavars(super().get_params(ctx))


class _Group(TyperGroup):
    """A group whose help, like a :class:`_Command`'s, shows flags without a type."""

    def get_params(self, ctx: Any) -> list[Any]:  # a (vendored) click.Context
        return _without_flag_metavars(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    name="sweepmaster",
    help="Hyperparameter sweeps of many oversized models on few devices, kept in Optuna.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs reflow to the terminal's width
)
db_app = typer.Typer(cls=_Group, help="Manage sweepmaster's tables in a storage database.",
                     no_args_is_help=True)
app.add_typer(db_app, name="db")

#: Libraries whose warnings (and, for transformers, log warnings) only ``--verbose`` shows.
_QUIET_MODULES = ("torch", "transformers", "optuna", "huggingface_hub", "tokenizers", "peft",
                  "plotly", "pydantic", "sqlalchemy", "alembic", "uvicorn", "fastapi")


@app.callback()
def _options(
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Also show the warnings of the libraries underneath (PyTorch, "
        "transformers, Optuna).")] = False,
) -> None:
    if verbose:
        return
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for module in _QUIET_MODULES:
        warnings.filterwarnings("ignore", module=rf"{module}(\.|$)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers loads

console = Console()
err_console = Console(stderr=True)
#: Whether this process runs one command and exits (:func:`main`), rather than calling the
#: app in-process (tests, ``CliRunner``).
_WHOLE_PROCESS = False

DEFAULT_STORAGE = "sqlite:///sweepmaster.db"
#: ``--storage`` of the commands that read a sweep.yaml, whose ``storage:`` is the default.
StorageOption = Annotated[
    str | None,
    typer.Option("--storage", help="SQLAlchemy URL of the database (default: the sweep's own, "
                 f"else {DEFAULT_STORAGE}).", envvar="SWEEPMASTER_STORAGE", show_default=False),
]
#: ``--storage`` of the commands without a sweep.yaml.
DatabaseOption = Annotated[
    str | None,
    typer.Option("--storage", help=f"SQLAlchemy URL of the database (default: {DEFAULT_STORAGE}).",
                 envvar="SWEEPMASTER_STORAGE", show_default=False),
]
HostOption = Annotated[str, typer.Option(
    "--host", help="Address the dashboard binds; any but a loopback address needs a token "
    "(--token, else a generated one in the printed URL).")]
PortOption = Annotated[int, typer.Option("--port", min=0, max=65535,
                                         help="Dashboard port (0: a free one).")]
TokenOption = Annotated[str | None, typer.Option(
    "--token", envvar="SWEEPMASTER_DASHBOARD_TOKEN", show_default=False,
    help="Token every dashboard request must carry: at least 8 characters without spaces "
    "(off localhost, one is generated when left out).")]
DevicesOption = Annotated[str | None, typer.Option(
    "--devices", show_default=False,
    help="Devices to train on, overriding resources.devices: auto (every GPU, else the CPU), "
    "cpu, cuda:0,cuda:1, or cpu:2x512MiB (two virtual devices: CPU memory with a 512 MiB "
    "budget each).")]
DeviceMemoryOption = Annotated[str | None, typer.Option(
    "--device-memory", show_default=False,
    help="Cap every device's memory budget, e.g. 8GiB (overrides resources.device_memory).")]
SetOption = Annotated[list[str] | None, typer.Option(
    "--set", show_default=False,
    help="Override a setting of the file: --set data.dir=/data/wikitext-2 (repeatable; the "
    "value is read as YAML).")]
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


def format_duration(seconds: float) -> str:
    """Seconds for people, as the dashboard shows them: ``"42s"``, ``"23m 14s"``, ``"2h 05m"``.

    The same rules as ``duration`` in ``web/js/format.js``.
    """
    whole = max(0, round(seconds))
    hours, minutes, rest = whole // 3600, whole % 3600 // 60, whole % 60
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {rest:02d}s"
    return f"{rest}s"


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


def _state_cell(trial: Any, colours: dict[str, str]) -> Text:
    """A trial's state, and ``→ #n`` where trial ``n`` runs it again after an interruption."""
    state = Text(trial.state, style=colours.get(trial.state, "white"))
    if trial.retried_by is not None:
        state.append(f" → #{trial.retried_by}")
    return state


def _results_table(results: Any, out: Console | None = None,
                   wide: bool = False) -> RenderableType:
    """Render :class:`sweepmaster.sweep.results.SweepResults` as a table, best trial first.

    Columns that do not fit ``out``'s width are left out by priority (tok/s, promotes and
    demotes first), unless ``wide``; ``#``, state (with the retry of an interrupted trial,
    ``FAIL → #7``) and the objective always stay. The device column lists every device a
    trial used.
    """
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    param_names = sorted({k for t in results.trials for k in t.params})
    headers = _short_names(param_names)
    arrow = "↓" if results.direction == "minimize" else "↑"
    title = (f"sweep {results.name} ({results.status}): "
             f"{results.count('COMPLETE')} complete, {results.count('PRUNED')} pruned, "
             f"{results.count('FAIL')} failed, {results.count('RUNNING')} running")
    colours = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red", "RUNNING": "cyan"}
    trials = results.trials

    def column(header: str, priority: int, values: list[Any], justify: Any = "left",
               wrap: bool = False) -> TableColumn:
        return TableColumn(header, priority, justify, wrap, [cell(v) for v in values])

    columns = [
        column("#", 0, [t.number for t in trials], "right"),
        TableColumn("state", 0, cells=[_state_cell(t, colours) for t in trials]),
        *(column(headers[n], 1, [_fmt(t.params[n]) if n in t.params else "" for t in trials],
                 wrap=True) for n in param_names),
        column(f"{results.metric} {arrow}", 0,
               ["" if t.objective is None else f"{t.objective:.4f}" for t in trials], "right"),
        column("eval ppl", 3, ["" if t.eval_perplexity is None
                               or not math.isfinite(t.eval_perplexity)
                               else f"{t.eval_perplexity:,.1f}" for t in trials], "right"),
        column("steps", 2, [f"{t.step}/{t.total_steps}" if t.total_steps else ""
                            for t in trials], "right"),
        column("tok/s", 5, ["" if not t.tokens_per_s else f"{t.tokens_per_s:,.0f}"
                            for t in trials], "right"),
        column("time", 4, ["" if t.duration_s is None else format_duration(t.duration_s)
                           for t in trials], "right"),
        column("device", 2, [", ".join(t.devices) for t in trials], wrap=True),
    ]
    if results.any_spilled:  # swap columns only for sweeps where some trial spilled
        columns += [
            column("shards", 3, ["" if t.num_shards is None else t.num_shards
                                 for t in trials], "right"),
            column("swap", 3, [format_size(t.swap_bytes) if t.swap_bytes else ""
                               for t in trials], "right"),
            *([column("p2p", 3, [format_size(t.p2p_bytes) if t.p2p_bytes else ""
                                 for t in trials], "right")]
              if any(t.p2p_bytes for t in trials) else []),
            column("promotes", 6, [f"{t.num_promotes:,}" if t.spilled else ""
                                   for t in trials], "right"),
            column("demotes", 6, [f"{t.num_demotes:,}" if t.spilled else ""
                                  for t in trials], "right"),
        ]
    if any(t.num_replans for t in trials):
        columns.append(column("replans", 6, [t.num_replans or "" for t in trials], "right"))
    return fitted_table(out or console, columns, title, wide=wide)


def _ratio(num_bytes: int, budget_bytes: int) -> str:
    ratio = num_bytes / budget_bytes
    return f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2f}x"


def _layers_text(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _job_mode(job: Any) -> Text:
    if job.error is not None:
        return Text("too large", style="red")
    if job.plan is None:
        return Text("plain (host)")
    return Text("spills", style="yellow") if job.spill else Text("plain", style="green")


def _plan_jobs_table(sweep_plan: Any, out: Console | None = None) -> RenderableType:
    """The jobs of a :class:`sweepmaster.sweep.plan.SweepPlan`, one row per job and device class."""
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    jobs = sweep_plan.jobs
    spilled = [job.plan if job.spill else None for job in jobs]

    def column(header: str, priority: int, values: list[Any], justify: Any = "right",
               wrap: bool = False) -> TableColumn:
        return TableColumn(header, priority, justify, wrap,
                           [v if isinstance(v, Text) else cell(v) for v in values])

    columns = [
        column("job", 0, [job.number for job in jobs]),
        column("trials", 4, [len(job.configs) for job in jobs]),
    ]
    if any(job.params for job in jobs):
        columns.append(column("parameters", 1, [job.label for job in jobs], "left", wrap=True))
    if len({job.devices for job in jobs}) > 1:
        columns.append(column("devices", 2, [", ".join(job.devices) for job in jobs], "left",
                              wrap=True))
    columns += [
        column("mode", 0, [_job_mode(job) for job in jobs], "left"),
        column("shards", 1, [len(p.shards) if p else "" for p in spilled]),
        column("tasks/step", 5, [p.num_tasks_per_step if p else "" for p in spilled]),
        column("swap/step", 2, [format_size(p.swap_bytes_per_step) if p else ""
                                for p in spilled]),
        column("est. step", 3, [f"{p.step_s:.2f} s" if p else "" for p in spilled]),
        column("peak", 3, [format_size(p.peak_bytes) if p else "" for p in spilled]),
        column("plain footprint", 2, [format_size(job.plain_bytes) for job in jobs]),
        column("budget", 4, [format_size(job.budget_bytes) for job in jobs]),
        column("footprint/budget", 1, [_ratio(job.plain_bytes, job.budget_bytes) for job in jobs]),
        column("plan", 6, ["" if job.plan is None else ("cached" if job.cached else "new")
                           for job in jobs], "left"),
    ]
    if sweep_plan.fusion != "off":
        columns.append(column("fusion", 1, [_fusion_cell(job.fusion) for job in jobs]))
    return fitted_table(out or console, columns, stack_rows=True)


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


def _plan_memory_table(job: Any, what: str = "",
                       out: Console | None = None) -> RenderableType:
    """The swap / recompute plan of one spilled job's activations (mu-TWO).

    ``what``: e.g. a fused array's, whose stacked shards and memory plan ``job`` then holds.
    """
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    memory, plan = job.memory_plan, job.plan
    rows = memory.summary()
    label = f" ({what})" if what else ""
    title = (f"job {job.number}{label}: activations kept (K), swapped (S) or recomputed (R) per "
             f"layer; est. step {memory.step_s:.3f} s against {plan.step_s:.3f} s recomputing "
             f"all, {format_size(memory.swap_bytes_per_step)} swapped per step at "
             f"{memory.bandwidth / 2**30:.1f} GiB/s")
    specs: list[tuple[str, int, Callable[[Any], Any]]] = [
        ("shard", 0, lambda r: r.shard),
        ("layers", 2, lambda r: r.layers),
        ("decisions", 0, lambda r: r.decisions),
        ("kept", 1, lambda r: format_size(r.kept_bytes)),
        ("swapped", 1, lambda r: format_size(r.swapped_bytes)),
        ("recomputed", 2, lambda r: format_size(r.recomputed_bytes)),
        ("peak", 1, lambda r: format_size(r.peak_bytes)),
        ("overhead s", 3, lambda r: f"{r.overhead_s:.3f}"),
        ("recompute-all s", 4, lambda r: f"{r.full_recompute_s:.3f}"),
    ]
    columns = [TableColumn(name, priority,
                           "left" if name in ("layers", "decisions") else "right",
                           name == "decisions", [cell(get(r)) for r in rows])
               for name, priority, get in specs]
    return fitted_table(out or console, columns, title, stack_rows=True)


def _print_memory_plan(job: Any, what: str = "") -> None:
    """Print a spilled job's memory plan (``what``: e.g. a fused array's), or that it has none."""
    if job.memory_plan is not None:
        console.print(_plan_memory_table(job, what))
        return
    label = f" ({what})" if what else ""
    console.print(f"job {job.number}{label}: every activation is recomputed in the backward "
                  "tasks (Hydra): no keep / swap plan fits beside the shards' peaks",
                  highlight=False, markup=False)


def _plan_shards_table(job: Any, what: str = "",
                       out: Console | None = None) -> RenderableType:
    """The shards of one spilled job (``what``: e.g. a fused array's stacked shards).

    Gradients take the bytes of the trainable parameters, so they have no column of their own
    (params: trainable and frozen, e.g. a LoRA adapter and its base).
    """
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    plan = job.plan
    label = f" ({job.label})" if job.params else ""
    label += f" {what}" if what else ""
    title = (f"job {job.number}{label}: {_count(len(plan.shards), 'shard')} on "
             f"{', '.join(job.devices)}, batch {plan.batch_size}, "
             f"{_count(plan.num_tasks_per_step, 'shard task')} and "
             f"{format_size(plan.swap_bytes_per_step)} swapped per step; gradients take the "
             "bytes of the trainable parameters")
    specs: list[tuple[str, int, Callable[[Any], Any]]] = [
        ("shard", 0, lambda s: s.index),
        ("layers", 1, lambda s: _layers_text(s.layer_names)),
        ("microbatch", 3, lambda s: s.microbatch_size),
        ("params", 2, lambda s: format_size(s.param_bytes)),
        ("optimizer", 3, lambda s: format_size(s.optimizer_bytes)),
        ("activations", 3, lambda s: format_size(s.activation_bytes)),
        ("fwd peak", 2, lambda s: format_size(s.forward_peak_bytes)
         if s.forward_peak_bytes else ""),
        ("bwd peak", 1, lambda s: format_size(s.backward_peak_bytes)),
        ("fwd s", 4, lambda s: f"{s.forward_s:.3f}" if s.forward_peak_bytes else ""),
        ("bwd s", 4, lambda s: f"{s.backward_s:.3f}"),
    ]
    columns = [TableColumn(name, priority, "left" if name == "layers" else "right",
                           name == "layers", [cell(get(s)) for s in plan.shards])
               for name, priority, get in specs]
    return fitted_table(out or console, columns, title, stack_rows=True)


def _plan_pipeline_table(job: Any, out: Console | None = None) -> RenderableType:
    """How one spilled job pipelines over several devices (Harmony PP), one row per layout."""
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table

    pipeline, plan = job.pipeline, job.plan
    title = (f"job {job.number}: pipelines when runnable jobs are fewer than free devices, "
             f"{pipeline.num_microbatches} microbatches per step; spilled on one device: est. "
             f"{plan.step_s:.3f} s and {format_size(plan.swap_bytes_per_step)} swapped per step")

    def packs(layout: Any) -> str:
        return ", ".join(f"{device}: {_shards_text(pack)}"
                         for device, pack in zip(layout.devices, layout.packs, strict=True))

    specs: list[tuple[str, int, Callable[[Any], Any]]] = [
        ("runnable jobs", 0, lambda r: f"{r.runnable[0]}-{r.runnable[1]}"
         if r.runnable[0] < r.runnable[1] else r.runnable[0]),
        ("packs per device", 0, packs),
        ("est. step", 1, lambda r: f"{r.step_s:.3f} s"),
        ("host/step", 1, lambda r: format_size(r.host_bytes_per_step)),
        ("p2p/step", 1, lambda r: format_size(r.p2p_bytes_per_step)),
        ("host/step no p2p", 3, lambda r: format_size(r.host_bytes_per_step_without_p2p)),
        ("load", 2, lambda r: format_size(r.load_bytes)),
    ]
    columns = [TableColumn(name, priority, "left" if name == "packs per device" else "right",
                           name == "packs per device", [cell(get(r)) for r in pipeline.layouts])
               for name, priority, get in specs]
    return fitted_table(out or console, columns, title, stack_rows=True)


def _shards_text(pack: tuple[int, ...]) -> str:
    return f"shard {pack[0]}" if len(pack) == 1 else f"shards {pack[0]}-{pack[-1]}"


def _job_line(job: Any) -> str:
    """One line per job for ``launch``: how it will train."""
    label = f" ({job.label})" if job.params else ""
    where = ", ".join(job.devices)
    ratio = f"{format_size(job.plain_bytes)}, {_ratio(job.plain_bytes, job.budget_bytes)} " \
        f"the {format_size(job.budget_bytes)} budget"
    if job.spill:
        plan = job.plan
        return (f"job {job.number}{label}: spills into {_count(len(plan.shards), 'shard')} on "
                f"{where} (plain footprint {ratio}); est. {plan.step_s:.2f} s and "
                f"{format_size(plan.swap_bytes_per_step)} swapped per step")
    return (f"job {job.number}{label}: trains as one resident shard on {where} "
            f"(footprint {ratio})")


def _print_results(storage: str, name: str, wide: bool = False) -> None:
    from sweepmaster.cli.tables import print_wide
    from sweepmaster.sweep.results import load_results

    results = load_results(storage, name)
    if wide:
        print_wide(console, _results_table(results, wide=True))
    else:
        console.print(_results_table(results))
    for t in results.trials:
        if t.state == "FAIL" and t.reason:
            console.print(f"[red]trial {t.number} failed:[/] {escape(t.reason)}",
                          highlight=False)
    best = next((t for t in results.trials if t.objective is not None), None)
    if best is not None and best.checkpoint_path:
        console.print(f"best trial {best.number}: weights in {best.checkpoint_path}",
                      markup=False)
    elif best is not None and best.missing_checkpoint:
        console.print(f"[yellow]best trial {best.number}: weights missing:[/] "
                      f"{escape(best.missing_checkpoint)} is no longer there (deleted or moved)",
                      highlight=False)
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
    _print_workers(storage, name, wide)


def _print_workers(storage: str, name: str, wide: bool = False) -> None:
    """The sweep's workers (host, pid, devices, state, heartbeat age, trials), if it has any."""
    from sweepmaster.sweep.workers import sweep_workers

    workers = sweep_workers(storage, name)
    if not workers:
        return
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table, print_wide

    colours = {"running": "green", "stopped": "white", "lost": "red"}
    columns = [
        TableColumn("worker", 0, "right", cells=[cell(w.id) for w in workers]),
        TableColumn("host", 1, wrap=True, cells=[cell(w.host) for w in workers]),
        TableColumn("pid", 3, "right", cells=[cell(w.pid) for w in workers]),
        TableColumn("devices", 2, wrap=True, cells=[cell(w.devices) for w in workers]),
        TableColumn("state", 0, cells=[cell(w.status, colours[w.status]) for w in workers]),
        TableColumn("last heartbeat", 2, cells=[
            cell(f"{format_duration(w.heartbeat_age_s)} ago") for w in workers]),
        TableColumn("running", 1, "right", cells=[cell(w.num_running) for w in workers]),
        TableColumn("finished", 1, "right", cells=[cell(w.num_finished) for w in workers]),
    ]
    table = fitted_table(console, columns, f"workers of sweep {name}", wide=wide)
    if wide:
        print_wide(console, table)
    else:
        console.print(table)


@app.command(cls=_Command)
def launch(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep.yaml to run.",
                                               show_default=False)],
    storage: StorageOption = None,
    n_trials: Annotated[int | None, typer.Option(
        "--n-trials", min=1, max=2**31 - 1, help="Finished trials wanted in total (default: "
        "study.n_trials, or the grid size).", show_default=False)] = None,
    overrides: SetOption = None,
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    dashboard: Annotated[bool, typer.Option(
        "--dashboard", help="Serve the web dashboard while the sweep runs, and after it "
        "ends until Ctrl-C.")] = False,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8080,
    token: TokenOption = None,
) -> None:
    """Run a sweep (or resume it): train its trials and record them in the database.

    Jobs that do not fit their device spill (train shard by shard); a layer that fits no device
    is an error before anything is written.
    """
    from sweepmaster.config.preflight import check_environment
    from sweepmaster.config.schema import check_storage_option, load_sweep_config

    _guarded(check_environment)
    _guarded(lambda: check_storage_option(storage))
    from sweepmaster.dashboard.server import TOKEN_ENV, resolve_token

    if dashboard:  # a bad token is refused before anything runs; a generated one is kept
        token = _guarded(lambda: resolve_token(host, token))
    else:  # the dashboard's options do nothing without it
        _guarded(lambda: _check_no_dashboard_options(host, port, token, TOKEN_ENV))
    config = _guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    config = _guarded(lambda: config.with_resources(devices, device_memory))
    _train(config, storage or config.storage, n_trials, devices, device_memory,
           (host, port, token) if dashboard else None)


def _check_no_dashboard_options(host: str, port: int, token: str | None,
                                token_env: str) -> None:
    """``launch`` without ``--dashboard``: its ``--host``, ``--port`` and ``--token`` do nothing.

    Raises:
        ConfigError: ``"--port: only with --dashboard ..."`` for the first one given (a token
            from ``token_env`` alone is not one given).
    """
    given = {"--host": host if host != "127.0.0.1" else None,
             "--port": port if port != 8080 else None,
             "--token": "..." if token not in (None, os.environ.get(token_env)) else None}
    for option, value in given.items():
        if value is not None:
            raise ConfigError(option, "", f"only with --dashboard (it sets the dashboard's "
                              f"{option.lstrip('-')}, and no dashboard is served without it), "
                              f"got {value!r}")


def _train(config: Any, url: str, n_trials: int | None, devices: str | None,
           device_memory: str | None, dashboard: tuple[str, int, str | None] | None) -> None:
    """Train a sweep's trials as one worker (``launch`` and ``worker``), then print them."""
    from transformers.utils import logging as transformers_logging

    from sweepmaster.config.preflight import check_sweep
    from sweepmaster.sweep.run import run_sweep

    transformers_logging.disable_progress_bar()  # ours are enough
    _guarded(lambda: check_sweep(config, launching=True))  # before anything is written
    from sweepmaster.study import check_storage_writable

    _guarded(lambda: check_storage_writable(url))
    job_lines = _guarded(lambda: _check_jobs_fit(config, url, devices, device_memory))
    server = None
    if dashboard is not None:
        server = _guarded(lambda: _start_dashboard(url, *dashboard))
    from sweepmaster.cli.launch_progress import LaunchDisplay

    display = LaunchDisplay(console)
    for line in job_lines:
        display.message(line)
    try:
        try:
            outcome = _guarded(lambda: run_sweep(config, storage=url, n_trials=n_trials,
                                                 observer=display, preflight=False))
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (signals.Terminated)
            from sweepmaster.sweep.signals import Terminated, ignore_signals

            ignore_signals()  # stopping: a second Ctrl-C must not break the exit
            display.stop()
            why = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
            err_console.print(f"[yellow]{why}:[/] the running trials are marked FAIL and run "
                              "again when you launch the sweep again", soft_wrap=True)
            raise typer.Exit(143 if isinstance(stop, Terminated) else 130) from None
        finally:
            display.stop()
        if outcome.num_run == 0 and outcome.status == "completed":
            console.print(_nothing_left_line(config.name, outcome.num_finished), markup=False,
                          highlight=False, soft_wrap=True)
        _guarded(lambda: _print_results(url, config.name))
        if server is not None:
            _serve_until_interrupted(server.login_url)
    finally:
        if server is not None:
            server.stop()
    if outcome.status != "completed":  # every trial failed, or cells were abandoned
        raise typer.Exit(1)


def _nothing_left_line(name: str, num_finished: int) -> str:
    """Why a relaunch of a finished sweep trains nothing, and how to train again.

    ``resources`` (devices, fusion, pipeline) are not part of a sweep's identity: other
    resources join the same sweep, whose finished trials stand.
    """
    return (f"sweep {name}: nothing left to run ({num_finished} trials finished); resources "
            "(devices, fusion, pipeline) are not part of a sweep's identity, so other ones do "
            f"not train it again: to train with them, give it a new name (--set name={name}-2) "
            f"or ask for more trials (--n-trials {2 * num_finished})")


def _serve_until_interrupted(login_url: str) -> None:
    """After the sweep, keep the dashboard (a background thread) serving until Ctrl-C."""
    console.print(f"the sweep has ended; the dashboard keeps serving at {login_url} until you "
                  "press Ctrl-C", markup=False, highlight=False)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("dashboard stopped", markup=False)


@app.command(cls=_Command)
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
        "--n-trials", min=1, max=2**31 - 1, help="Finished trials wanted in total (default: "
        "study.n_trials, or the grid size).", show_default=False)] = None,
) -> None:
    """Join a sweep that was launched elsewhere: train its trials here until it is done.

    The sweep's configuration is read from the database (its data and tokenizer paths must
    exist on this host); Optuna hands out the trials, so several workers on several hosts
    share one sweep and no grid cell runs twice. `status` and the dashboard show every worker.
    """
    from sweepmaster.config.preflight import check_environment
    from sweepmaster.config.schema import check_storage_option
    from sweepmaster.sweep.workers import load_joined_config

    _guarded(check_environment)
    _guarded(lambda: check_storage_option(storage))
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
    from sweepmaster.sweep.plan import open_devices, plan_sweep

    if all(device.meter is None for device in open_devices(config, devices, device_memory)):
        return []  # the host CPU trains every job plain
    sweep_plan = plan_sweep(config, devices=devices, device_memory=device_memory, storage=url)
    return [_job_line(job) for job in sweep_plan.jobs]


@app.command(cls=_Command)
def plan(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep.yaml to plan.",
                                               show_default=False)],
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    storage: StorageOption = None,
    overrides: SetOption = None,
    measure_fusion: Annotated[bool, typer.Option(
        "--measure-fusion", help="With resources.fusion: auto, measure the fusion degrees the "
        "cache lacks (trains a few steps of K = 1, 2, 4, ... models on a device).")] = False,
) -> None:
    """Print how each job of a sweep would train, without training anything.

    Per job: spilled or plain, its shards with their bytes and estimated times, shard tasks and
    swap volume per step, its plain footprint against the device budget, and for a spilled job
    which activations each shard keeps, swaps to the host or recomputes, and on several devices
    how it pipelines when runnable jobs are fewer than devices (packs per device, host and p2p
    bytes per step; whether resources.pipeline turns it on). A job
    is a set of trials sharing one architecture (model, dtype, batch and block size, optimizer
    kind). Plans are read from the storage's partition cache when its database exists; plan
    never creates or changes a database (launch keeps the new plans). With resources.fusion
    on, each job's fusion degree K (auto: from the storage's fusion cache, else "not
    measured" unless --measure-fusion) and, for a grid, the fused arrays its trials form; for
    trials that spill, each size of fused array's stacked shards and memory plan.
    """
    from sweepmaster.config.schema import check_storage_option, load_sweep_config
    from sweepmaster.sweep.plan import plan_sweep

    _guarded(lambda: check_storage_option(storage))
    config = _guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    config = _guarded(lambda: config.with_resources(devices, device_memory))
    with console.status("planning (profiling each architecture once"
                        + (", measuring fusion degrees)" if measure_fusion else ")")):
        sweep_plan = _guarded(lambda: plan_sweep(config, devices=devices,
                                                 device_memory=device_memory, storage=storage,
                                                 measure_fusion=measure_fusion, read_only=True))
    console.print(f"sweep {sweep_plan.name}: {sweep_plan.num_jobs} job(s) from "
                  f"{sweep_plan.num_configs} configuration(s) on {', '.join(sweep_plan.devices)}",
                  highlight=False, markup=False)
    for note in sweep_plan.notes:
        console.print(f"  [dim]{escape(note)}[/]", highlight=False)
    console.print(_plan_jobs_table(sweep_plan))
    for job in sweep_plan.jobs:
        if job.fusion is not None:
            console.print(_fusion_line(job), highlight=False, markup=False)
    for job in sweep_plan.jobs:
        if job.spill:
            console.print(_plan_shards_table(job))
        if job.pipeline is not None and job.pipeline.layouts:
            if config.resources.pipeline == "off":
                console.print(f"job {job.number}: pipelining is off (resources.pipeline: off); "
                              "with auto:", highlight=False, markup=False)
            console.print(_plan_pipeline_table(job))
        elif job.pipeline is not None and job.pipeline.shape is not None and (
                job.pipeline.shape.packs or job.pipeline.shape.wrap):
            console.print(f"job {job.number}: never pipelines: no pack layout's step is "
                          "predicted as short as its step as shard tasks "
                          f"({job.pipeline.shard_step_s:.3g} s)", highlight=False, markup=False)
        elif job.pipeline is not None:
            console.print(f"job {job.number}: never pipelines: no two packs of its shards fit "
                          "a device's budget", highlight=False, markup=False)
        if job.spill:
            _print_memory_plan(job)
        for array in job.fusion.arrays if job.fusion is not None else ():
            what = f"fused array of {array.num_members}"
            shown = dataclasses.replace(job, plan=array.stacked_plan,
                                        memory_plan=array.memory_plan)
            console.print(_plan_shards_table(shown, f"{what} (stacked shards)"))
            _print_memory_plan(shown, what)
        if job.error is not None:
            console.print(f"[red]job {job.number} on {', '.join(job.devices)}:[/] "
                          f"{escape(str(job.error))}", highlight=False)


class StatusFormat(str, enum.Enum):
    """What ``status --format`` writes."""

    table = "table"
    json = "json"
    csv = "csv"


@app.command(cls=_Command)
def status(
    storage: DatabaseOption = None,
    sweep: Annotated[str | None, typer.Option("--sweep", help="Sweep name (default: all).",
                                              show_default=False)] = None,
    wide: Annotated[bool, typer.Option(
        "--wide", help="Show every column, however wide (tables otherwise fit the terminal, "
        "80 columns when piped, leaving out the least important columns).")] = False,
    output_format: Annotated[StatusFormat, typer.Option(
        "--format", help="table, or every column of every trial as json or csv (for scripts).",
        case_sensitive=False)] = StatusFormat.table,
) -> None:
    """Print the trials of one sweep (or of every sweep) from the database, best first.

    For a sweep in which a trial spilled, also its shards, swap volume and promotes/demotes.
    Reads only: the database is never created or changed (a missing one is an error).
    """
    from sweepmaster.config.schema import check_storage_option
    from sweepmaster.sweep.results import sweep_names

    _guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE

    def show() -> None:
        from sweepmaster.store.engine import masked_text

        names = [sweep] if sweep else sweep_names(url)
        if output_format is not StatusFormat.table:
            _export_results(url, names, output_format)
            return
        if not names:
            console.print(f"no sweeps in {masked_text(url)}", markup=False)
        for name in names:
            _print_results(url, name, wide)

    _guarded(show)


def _export_results(storage: str, names: list[str], output_format: StatusFormat) -> None:
    """Write the sweeps' results to stdout as JSON or CSV (:mod:`sweepmaster.sweep.export`)."""
    from sweepmaster.sweep.export import results_csv, results_json
    from sweepmaster.sweep.results import load_results
    from sweepmaster.sweep.workers import sweep_workers

    results = [load_results(storage, name) for name in names]
    if output_format is StatusFormat.json:
        text = results_json([(r, sweep_workers(storage, r.name)) for r in results])
    else:
        text = results_csv(results)
    sys.stdout.write(text)
    sys.stdout.flush()


@app.command(cls=_Command)
def validate(
    sweep_file: Annotated[Path, typer.Argument(help="The sweep.yaml to check.",
                                               show_default=False)],
    overrides: SetOption = None,
) -> None:
    """Check a sweep.yaml and print its search space, without touching any database.

    Checks everything that can fail before training, for every grid cell and the bounds of
    every range: the schema, the model config, the data (read and tokenized as far as needed),
    the paths, and the SWEEPMASTER_* environment settings. ``--set`` overrides settings of the
    file as for launch, so a launch command line is checked as it would run.
    """
    if _WHOLE_PROCESS:
        _import_transformers_without_torch()
    from sweepmaster.config.preflight import check_environment, check_sweep
    from sweepmaster.config.schema import load_sweep_config

    def check() -> None:
        check_environment()
        config = load_sweep_config(sweep_file, overrides or ())
        check_sweep(config)
        console.print(f"{sweep_file}: sweep {config.name!r} is valid", markup=False)
        for name, dist in config.search_space().items():
            console.print(f"  {name}: {dist}", highlight=False, markup=False)
        for name, value in config.constants().items():
            console.print(f"  {name} = {value!r}", highlight=False, markup=False)
        if config.study.sampler.type == "grid":
            console.print(f"  grid of {config.grid_size()} configurations")

    _guarded(check)


def _import_transformers_without_torch() -> None:
    """Import transformers as if torch were not installed, for a process that only validates.

    ``validate`` uses transformers' tokenizers and config classes, never a model class, but
    importing either imports torch whenever torch is installed (``configuration_utils`` imports
    ``modeling_rope_utils``): a second of a two-second command. Hidden while transformers loads,
    torch is left out as on a machine without it (transformers' supported tokenizers-and-configs
    mode); it stays importable (a ``cuda:N`` device spec imports it). Only for a process that
    runs nothing else after (:func:`main`): a model built later in it would find no torch.
    """
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # not its note that PyTorch was not found
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails, no spec
    try:
        import transformers.configuration_utils  # noqa: F401
        import transformers.models.auto.tokenization_auto  # noqa: F401
    finally:
        del sys.modules["torch"]
        if verbosity is None:
            del os.environ["TRANSFORMERS_VERBOSITY"]
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = verbosity
    from transformers.utils import logging as transformers_logging

    level = logging.getLevelName((verbosity or "warning").upper())  # a number if a level name
    transformers_logging.set_verbosity(level if isinstance(level, int) else logging.WARNING)


@app.command("dashboard", cls=_Command)
def dashboard_command(
    storage: DatabaseOption = None,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8080,
    token: TokenOption = None,
) -> None:
    """Serve the web dashboard (read-only): live trials, learning curves, devices."""
    from sweepmaster.config.schema import check_storage_option
    from sweepmaster.dashboard import serve

    _guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE
    try:
        _guarded(lambda: serve(url, host, port, token,
                               on_ready=lambda u: console.print(f"dashboard: {u}",
                                                                markup=False)))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _start_dashboard(url: str, host: str, port: int, token: str | None) -> Any:
    """Bring the database to head, then serve the dashboard from a background thread."""
    from sweepmaster.dashboard import start_in_background
    from sweepmaster.store import create_store_engine, upgrade_to_head

    upgrade_to_head(create_store_engine(url))
    handle = start_in_background(url, host, port, token)
    console.print(f"dashboard: {handle.login_url}", markup=False)
    return handle


@db_app.command("upgrade", cls=_Command)
def db_upgrade(storage: DatabaseOption = None) -> None:
    """Create or migrate sweepmaster's tables to the newest schema."""
    from sweepmaster.config.schema import check_storage_option
    from sweepmaster.store import create_store_engine, current_revision, upgrade_to_head

    _guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE

    def run() -> None:
        from sweepmaster.store.engine import masked_text

        engine = create_store_engine(url)
        upgrade_to_head(engine)
        console.print(f"{masked_text(url)}: sweepmaster tables at revision "
                      f"{current_revision(engine)}",
                      markup=False)

    _guarded(run)


@db_app.command("current", cls=_Command)
def db_current(storage: DatabaseOption = None) -> None:
    """Print the schema revision of sweepmaster's tables (none before the first upgrade).

    Reads only: the database is never created or changed (a missing one is an error).
    """
    from sweepmaster.config.schema import check_storage_option
    from sweepmaster.store import current_revision
    from sweepmaster.store.engine import create_read_only_engine, masked_text

    _guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE

    def show() -> None:
        engine = create_read_only_engine(url)
        try:
            revision = current_revision(engine)
        finally:
            engine.dispose()
        console.print(f"{masked_text(url)}: "
                      f"{revision or 'none (sweepmaster db upgrade creates the tables)'}",
                      markup=False)

    _guarded(show)


def _count(number: int, noun: str) -> str:
    """``"1 shard"``, ``"3 shards"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def main() -> None:
    """Entry point of the ``sweepmaster`` command and ``python -m sweepmaster``."""
    global _WHOLE_PROCESS
    _WHOLE_PROCESS = True
    try:
        app(prog_name="sweepmaster")
    finally:
        _collect_and_freeze()


def _collect_and_freeze() -> None:
    """Finalize the garbage a command left, then keep the exit's collections off the rest.

    While it exits, CPython 3.11 runs four full garbage collections (after the atexit hooks,
    twice while it tears the modules down, once clearing the interpreter), each visiting every
    object the collector tracks: about 100,000 after ``status`` or ``validate`` and 500,000
    after ``plan`` or ``launch`` (the 4,000 modules of torch, transformers, sympy, peft...),
    which kept a command alive 0.6 s (``validate``) to 4.4 s (``launch``) after its last output
    on a busy two-core machine.

    One collection here finalizes what the command dropped, as the exit did (an Optuna
    storage's pooled SQLite connections are closed, so the ``-wal`` file is checkpointed and
    removed); :func:`gc.freeze` then moves every survivor to the permanent generation, which the
    exit's collections skip. Atexit hooks, thread joins and module teardown still run; only
    reference cycles still alive at exit are not collected (their finalizers were never
    guaranteed to run at exit).
    """
    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    main()
