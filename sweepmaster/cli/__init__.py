"""The ``sweepmaster`` command line (Typer + rich): one module per command.

Every error a user can cause prints one line, ``error: <what>``, and exits with code 2.
"""

from __future__ import annotations

from sweepmaster.cli.app import app, main

__all__ = ["app", "main"]
