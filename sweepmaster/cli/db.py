"""``sweepmaster db``: create, migrate and inspect sweepmaster's tables."""

from __future__ import annotations

import typer

from sweepmaster.cli.console import console, guarded
from sweepmaster.cli.options import DEFAULT_STORAGE, Command, DatabaseOption, Group

db_app = typer.Typer(cls=Group, help="Manage sweepmaster's tables in a storage database.",
                     no_args_is_help=True)


@db_app.command("upgrade", cls=Command)
def db_upgrade(storage: DatabaseOption = None) -> None:
    """Create or migrate sweepmaster's tables to the newest schema."""
    from sweepmaster.config.value_checks import check_storage_option
    from sweepmaster.store import create_store_engine, current_revision, upgrade_to_head

    guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE

    def run() -> None:
        from sweepmaster.store.engine import masked_text

        engine = create_store_engine(url)
        upgrade_to_head(engine)
        console.print(f"{masked_text(url)}: sweepmaster tables at revision "
                      f"{current_revision(engine)}",
                      markup=False)

    guarded(run)


@db_app.command("current", cls=Command)
def db_current(storage: DatabaseOption = None) -> None:
    """Print the schema revision of sweepmaster's tables (none before the first upgrade).

    Reads only: the database is never created or changed (a missing one is an error).
    """
    from sweepmaster.config.value_checks import check_storage_option
    from sweepmaster.store import current_revision
    from sweepmaster.store.engine import create_read_only_engine, masked_text

    guarded(lambda: check_storage_option(storage))
    url = storage or DEFAULT_STORAGE

    def show() -> None:
        engine = create_read_only_engine(url)
        try:
            revision = current_revision(engine)
        finally:
            engine.dispose()
        console.print(f"{masked_text(url)}: "
                      f"{revision or 'none (sweepmaster db upgrade creates the tables)'}",
                      markup=False)

    guarded(show)
