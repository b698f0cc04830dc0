"""``sweepmaster launch``: run a sweep (or resume it) as one worker."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from sweepmaster.cli.console import console, err_console, guarded
from sweepmaster.cli.options import (
    DeviceMemoryOption,
    DevicesOption,
    HostOption,
    NTrialsOption,
    PortOption,
    SetOption,
    StorageOption,
    TokenOption,
    sweep_file_argument,
)
from sweepmaster.cli.plan_tables import job_line
from sweepmaster.cli.results_tables import print_results
from sweepmaster.errors import ConfigError


def launch(
    sweep_file: Annotated[Path, sweep_file_argument("run")],
    storage: StorageOption = None,
    n_trials: NTrialsOption = None,
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
    from sweepmaster.config.schema import load_sweep_config
    from sweepmaster.config.value_checks import check_storage_option

    guarded(check_environment)
    guarded(lambda: check_storage_option(storage))
    from sweepmaster.dashboard.server import TOKEN_ENV, resolve_token

    if dashboard:  # a bad token is refused before anything runs; a generated one is kept
        token = guarded(lambda: resolve_token(host, token))
    else:  # the dashboard's options do nothing without it
        guarded(lambda: _check_no_dashboard_options(host, port, token, TOKEN_ENV))
    config = guarded(lambda: load_sweep_config(sweep_file, overrides or ()))
    config = guarded(lambda: config.with_resources(devices, device_memory))
    train(config, storage or config.storage, n_trials, devices, device_memory,
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


def train(config: Any, url: str, n_trials: int | None, devices: str | None,
           device_memory: str | None, dashboard: tuple[str, int, str | None] | None) -> None:
    """Train a sweep's trials as one worker (``launch`` and ``worker``), then print them."""
    from transformers.utils import logging as transformers_logging

    from sweepmaster.config.preflight import check_sweep
    from sweepmaster.sweep.run import run_sweep

    transformers_logging.disable_progress_bar()  # ours are enough
    guarded(lambda: check_sweep(config, launching=True))  # before anything is written
    from sweepmaster.study import check_storage_writable

    guarded(lambda: check_storage_writable(url))
    job_lines = guarded(lambda: _check_jobs_fit(config, url, devices, device_memory))
    server = None
    if dashboard is not None:
        server = guarded(lambda: _start_dashboard(url, *dashboard))
    from sweepmaster.cli.launch_progress import LaunchDisplay

    display = LaunchDisplay(console)
    for line in job_lines:
        display.message(line)
    try:
        try:
            outcome = guarded(lambda: run_sweep(config, storage=url, n_trials=n_trials,
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
        guarded(lambda: print_results(url, config.name))
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




def _check_jobs_fit(config: Any, url: str, devices: str | None,
                    device_memory: str | None) -> list[str]:
    """Open the devices and plan the sweep's jobs; one line per job on metered devices.

    ``devices`` / ``device_memory`` are the command line's (already in ``config``), so that
    errors name the option rather than the file.

    Raises:
        DeviceError: A device is missing, or a job has a layer that fits no device (the host
            CPU's free memory included).
    """
    from sweepmaster.sweep.plan import open_devices, plan_sweep

    sweep_plan = plan_sweep(config, devices=devices, device_memory=device_memory, storage=url)
    if all(device.meter is None for device in open_devices(config, devices, device_memory)):
        return []  # the host CPU trains every job plain
    return [job_line(job) for job in sweep_plan.jobs]




def _start_dashboard(url: str, host: str, port: int, token: str | None) -> Any:
    """Bring the database to head, then serve the dashboard from a background thread."""
    from sweepmaster.dashboard import start_in_background
    from sweepmaster.store import create_store_engine, upgrade_to_head

    upgrade_to_head(create_store_engine(url))
    handle = start_in_background(url, host, port, token)
    console.print(f"dashboard: {handle.login_url}", markup=False)
    return handle
