"""``sweepmaster worker``: join a sweep launched elsewhere."""

from __future__ import annotations

from typing import Annotated

import typer

from sweepmaster.cli.console import guarded
from sweepmaster.cli.launch import train
from sweepmaster.cli.options import DeviceMemoryOption, DevicesOption, NTrialsOption


def worker(
    storage: Annotated[str, typer.Option(
        "--storage", envvar="SWEEPMASTER_STORAGE", show_default=False,
        help="SQLAlchemy URL of the sweep's database, e.g. "
        "postgresql+psycopg://user@dbhost:5432/sweeps.")],
    sweep: Annotated[str, typer.Option("--sweep", help="Name of the sweep to join.",
                                       show_default=False)],
    devices: DevicesOption = None,
    device_memory: DeviceMemoryOption = None,
    n_trials: NTrialsOption = None,
) -> None:
    """Join a sweep that was launched elsewhere: train its trials here until it is done.

    The sweep's configuration is read from the database (its data and tokenizer paths must
    exist on this host); Optuna hands out the trials, so several workers on several hosts
    share one sweep and no grid cell runs twice. `status` and the dashboard show every worker.
    """
    from sweepmaster.config.preflight import check_environment
    from sweepmaster.config.value_checks import check_storage_option
    from sweepmaster.sweep.workers import load_joined_config

    guarded(check_environment)
    guarded(lambda: check_storage_option(storage))
    config = guarded(lambda: load_joined_config(storage, sweep))
    config = guarded(lambda: config.with_resources(devices, device_memory))
    train(config, storage, n_trials, devices, device_memory, None)
