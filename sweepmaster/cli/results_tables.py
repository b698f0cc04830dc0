"""The trials of a sweep as tables (``status``, and ``launch`` when it ends)."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.text import Text

from sweepmaster.cli.console import console, format_duration, format_size, format_value


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


def _statistic_cell(unit: str, value: int | None) -> str:
    """A statistic in the status table: a size or a count, blank when 0 or unknown."""
    if not value:
        return ""
    return format_size(value) if unit == "bytes" else f"{value:,}"


def results_table(results: Any, out: Console | None = None,
                   wide: bool = False) -> RenderableType:
    """Render :class:`sweepmaster.sweep.results.SweepResults` as a table, best trial first.

    Columns that do not fit ``out``'s width are left out by priority (tok/s, promotes and
    demotes first), unless ``wide``; ``#``, state (with the retry of an interrupted trial,
    ``FAIL → #7``) and the objective always stay. The device column lists every device a
    trial used.
    """
    from sweepmaster.cli.tables import TableColumn, cell, fitted_table
    from sweepmaster.runtime.events import TRIAL_STATISTICS

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
        *(column(headers[n], 1,
                 [format_value(t.params[n]) if n in t.params else "" for t in trials],
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
    for stat in TRIAL_STATISTICS:  # a statistic's column where some trial has it
        values = [getattr(t, stat.name) for t in trials]
        if stat.label is None or not any(values) or (stat.spill and not results.any_spilled):
            continue  # spill columns only for sweeps where some trial spilled
        columns.append(column(stat.label, stat.priority,
                              [_statistic_cell(stat.unit, v) for v in values], "right"))
    return fitted_table(out or console, columns, title, wide=wide)


def print_results(storage: str, name: str, wide: bool = False) -> None:
    """The sweep's trials, best first, what failed or is missing, and its workers."""
    from sweepmaster.cli.tables import print_wide
    from sweepmaster.sweep.results import load_results

    results = load_results(storage, name)
    if wide:
        print_wide(console, results_table(results, wide=True))
    else:
        console.print(results_table(results))
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
        params = ", ".join(f"{k}={format_value(v)}" for k, v in cell.params.items())
        why = (f"failed {cell.num_failed} time(s): {cell.reason}" if cell.num_failed
               else "never ran")
        console.print(f"[yellow]cell not finished:[/] {escape(params)} ({escape(why)})",
                      highlight=False)
    if results.status in ("failed", "incomplete"):
        console.print(f"[red]sweep {escape(name)} {results.status}:[/] "
                      f"{results.count('COMPLETE') + results.count('PRUNED')} trial(s) finished",
                      highlight=False)
    print_workers(storage, name, wide)


def print_workers(storage: str, name: str, wide: bool = False) -> None:
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
