"""How the commands read: their shared options, and help that shows flags without a type."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption


def _without_flag_metavars(params: list[Any]) -> list[Any]:
    """``params`` with an empty metavar on every flag, so help shows no value after it.

    Typer's rich help gives every option its type (``--verbose  <bool>``), flags too, which
    reads as if a flag took a value.
    """
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    """A command whose help shows flags without a type (:func:`_without_flag_metavars`)."""

    def get_params(self, ctx: Any) -> list[Any]:  # a (vendored) click.Context
        """The command's parameters, flags without a metavar."""
        return _without_flag_metavars(super().get_params(ctx))


class Group(TyperGroup):
    """A group whose help, like a :class:`Command`'s, shows flags without a type."""

    def get_params(self, ctx: Any) -> list[Any]:  # a (vendored) click.Context
        """The group's parameters, flags without a metavar."""
        return _without_flag_metavars(super().get_params(ctx))



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
NTrialsOption = Annotated[int | None, typer.Option(
    "--n-trials", min=1, max=2**31 - 1, help="Finished trials wanted in total (default: "
    "study.n_trials, or the grid size).", show_default=False)]
SetOption = Annotated[list[str] | None, typer.Option(
    "--set", show_default=False,
    help="Override a setting of the file: --set data.dir=/data/wikitext-2 (repeatable; the "
    "value is read as YAML).")]


def sweep_file_argument(verb: str) -> Any:
    """The ``SWEEP_FILE`` argument of a command that reads a sweep.yaml to ``verb`` it.

    Example:
        >>> def plan(sweep_file: Annotated[Path, sweep_file_argument("plan")]) -> None: ...
    """
    return typer.Argument(help=f"The sweep.yaml to {verb}.", show_default=False)
