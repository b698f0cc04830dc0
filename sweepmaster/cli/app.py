"""The ``sweepmaster`` command line (Typer + rich).

Every error a user can cause prints one line, ``error: <what>``, and exits with code 2; Ctrl-C
during ``launch`` marks the running trial FAIL (it runs again on relaunch) and exits with 130,
SIGTERM likewise with 143.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Annotated

import typer

from sweepmaster.cli import dashboard, db, launch, plan, status, validate, worker
from sweepmaster.cli.console import ProcessMode
from sweepmaster.cli.options import Command, Group

app = typer.Typer(
    cls=Group,
    name="sweepmaster",
    help="Hyperparameter sweeps of many oversized models on few devices, kept in Optuna.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring paragraphs reflow to the terminal's width
)

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
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")  # not a line per retry of the hub
    os.environ.setdefault("DATASETS_VERBOSITY", "error")


for command in (launch.launch, worker.worker, plan.plan, status.status, validate.validate):
    app.command(cls=Command)(command)
app.command("dashboard", cls=Command)(dashboard.dashboard_command)
app.add_typer(db.db_app, name="db")


def main() -> None:
    """Entry point of the ``sweepmaster`` command and ``python -m sweepmaster``."""
    ProcessMode.whole_process = True
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
    main()
