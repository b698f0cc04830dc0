"""The ``sweepmaster`` command line (Typer + rich): one module per command.

Every error a user can cause prints one line, ``error: <what>``, and exits with code 2. The app
is imported on first use (:mod:`sweepmaster.lazy_exports`), so a command module imports no
other command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.cli.app import app, main

__getattr__, __dir__, __all__ = lazy_exports(globals())
