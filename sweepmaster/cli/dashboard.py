"""``sweepmaster dashboard``: serve the web dashboard."""

from __future__ import annotations

import typer

from sweepmaster.cli.console import console, guarded
from sweepmaster.cli.options import (
    DEFAULT_STORAGE,
    DatabaseOption,
    HostOption,
    PortOption,
    TokenOption,
)


def dashboard_command(
    storage: DatabaseOption = None,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8080,
    token: TokenOption = None,
) -> None:
    """Serve the web dashboard (read-only): live trials, learning curves, devices."""
    from sweepmaster.config.value_checks import check_storage_option
    from sweepmaster.dashboard import serve

    guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE
    try:
        guarded(lambda: serve(url, host, port, token,
                               on_ready=lambda u: console.print(f"dashboard: {u}",
                                                                markup=False)))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
