"""The terminal the commands write to, how a user error is shown, and numbers for people."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from sweepmaster.errors import SweepmasterError

console = Console()
err_console = Console(stderr=True)


class ProcessMode:
    """How the command line runs in this process."""

    #: Whether this process runs one command and exits (:func:`~sweepmaster.cli.app.main`),
    #: rather than calling the app in-process (tests, ``CliRunner``).
    whole_process = False


T = TypeVar("T")


def guarded(fn: Callable[[], T]) -> T:
    """Run ``fn``; a user error becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except SweepmasterError as exc:  # the message may quote user text: no markup in it
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                          soft_wrap=True)
        raise typer.Exit(2) from None


def format_value(value: Any) -> str:
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



def counted(number: int, noun: str) -> str:
    """``"1 shard"``, ``"3 shards"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
