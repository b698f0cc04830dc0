"""``sweepmaster status``: the trials of the sweeps in a database, as tables, JSON or CSV."""

from __future__ import annotations

import enum
import sys
from typing import Annotated

import typer

from sweepmaster.cli.console import console, guarded
from sweepmaster.cli.options import DEFAULT_STORAGE, DatabaseOption
from sweepmaster.cli.results_tables import print_results


class StatusFormat(str, enum.Enum):
    """What ``status --format`` writes."""

    table = "table"
    json = "json"
    csv = "csv"


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
    from sweepmaster.config.value_checks import check_storage_option
    from sweepmaster.sweep.results import sweep_names

    guarded(lambda: check_storage_option(storage))
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
            print_results(url, name, wide)

    guarded(show)


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
