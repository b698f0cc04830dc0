"""Bring a database's sweepmaster tables up to the newest Alembic revision.

The Alembic environment lives in the repository's top-level ``migrations/`` directory, which the
wheel installs as the package ``sweepmaster.migrations``. :func:`migrations_dir` finds it as that
package first and, for a source checkout, next to the ``sweepmaster`` package.

Before writing anything, :func:`upgrade_to_head` checks that Optuna's tables in the same database
(if any) are at the schema the installed Optuna uses, so sweepmaster never adds its tables to a
database its sweeps could not run on.

Upgrades are serialized between processes (the database's
:func:`~sweepmaster.store.locks.schema_lock`, then ``BEGIN IMMEDIATE`` on SQLite, a
transaction-scoped advisory lock on PostgreSQL) and run in one transaction, so concurrent
launches on one database are safe and an interrupted upgrade leaves nothing half-applied.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import optuna
import sqlalchemy.exc
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

from sweepmaster.errors import StorageError
from sweepmaster.store.engine import create_store_engine, first_line, masked_url
from sweepmaster.store.locks import schema_lock
from sweepmaster.store.models import ALEMBIC_VERSION_TABLE

__all__ = [
    "check_optuna_schema",
    "current_revision",
    "head_revision",
    "lock_for_migration",
    "migrations_dir",
    "upgrade_to_head",
]

# Key of the PostgreSQL advisory lock held while migrating (an arbitrary 63-bit constant).
_PG_MIGRATION_LOCK_KEY = 0x5357_4550_4D41_5354  # "SWEPMAST"


def migrations_dir() -> Path:
    """Locate the Alembic environment of sweepmaster's tables.

    Returns:
        The directory holding ``env.py`` and ``versions/``: ``migrations/`` of the source
        checkout this module was imported from, when it is one (a project directory with
        ``pyproject.toml``), else the installed package ``sweepmaster.migrations``.
    """
    root = Path(__file__).resolve().parents[2]
    checkout = root / "migrations"
    if (checkout / "env.py").is_file() and (root / "pyproject.toml").is_file():
        return checkout
    spec = importlib.util.find_spec("sweepmaster.migrations")
    assert spec is not None and spec.submodule_search_locations, "no Alembic environment"
    return Path(next(iter(spec.submodule_search_locations)))


def _alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """Return the newest revision of sweepmaster's migrations.

    Returns:
        The head revision identifier, e.g. ``"0001"``.
    """
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    assert head is not None, "sweepmaster's migrations have no head revision"
    return head


def current_revision(engine: Engine) -> str | None:
    """Return the sweepmaster revision a database is at.

    Args:
        engine: An engine from :func:`~sweepmaster.store.engine.create_store_engine`.

    Returns:
        The revision recorded in ``sweepmaster_alembic_version``, or ``None`` when sweepmaster's
        tables were never created there.
    """
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"version_table": ALEMBIC_VERSION_TABLE}
        )
        return context.get_current_revision()


@functools.cache
def _optuna_revisions() -> tuple[str, frozenset[str]]:
    """The head and every revision of the installed Optuna's own Alembic migrations."""
    from optuna.storages import _rdb

    script = ScriptDirectory(str(Path(_rdb.__file__).parent / "alembic"))
    head = script.get_current_head()
    assert head is not None, "Optuna's migrations have no head revision"
    return head, frozenset(r.revision for r in script.walk_revisions())


def check_optuna_schema(engine: Engine) -> None:
    """Check, reading only, that Optuna's tables (if any) are at the installed Optuna's schema.

    This is the check Optuna's ``RDBStorage`` makes when it opens a storage, done first so that
    nothing is written to a database the sweep could not use. A database without Optuna's
    ``alembic_version`` table passes (Optuna creates its tables there).

    Args:
        engine: An engine from :func:`~sweepmaster.store.engine.create_store_engine`.

    Raises:
        StorageError: Optuna's tables are at an older revision (run ``optuna storage
            upgrade``), at a revision this Optuna does not know (a newer Optuna, or another
            application's ``alembic_version`` table), or cannot be read.
    """
    shown = masked_url(engine.url)
    try:
        with engine.connect() as connection:
            if not inspect(connection).has_table("alembic_version"):
                return
            revision = MigrationContext.configure(connection).get_current_revision()
    except sqlalchemy.exc.DBAPIError as err:
        raise StorageError(f"cannot read storage {shown}: {first_line(err)}") from err
    head, known = _optuna_revisions()
    if revision is None or revision == head:
        return
    if revision in known:
        raise StorageError(
            f"Optuna's tables in {shown} are at revision {revision!r}, older than optuna "
            f"{optuna.__version__} uses ({head!r}); upgrade them with "
            f"`optuna storage upgrade --storage URL`"
        )
    raise StorageError(
        f"Optuna's tables in {shown} are at revision {revision!r}, unknown to optuna "
        f"{optuna.__version__} (written by a newer Optuna, or not an Optuna database)"
    )


def lock_for_migration(connection: Connection) -> None:
    """Begin a transaction on ``connection`` that holds the database's migration lock.

    On SQLite this is ``BEGIN IMMEDIATE`` (after turning foreign keys off, which batch
    migrations need); on PostgreSQL a transaction-scoped advisory lock. A second process
    upgrading the same database waits here, then finds it at head.

    Args:
        connection: A connection with no transaction begun yet.
    """
    dialect = connection.dialect.name
    if dialect == "sqlite":
        # Batch migrations recreate tables; with foreign keys on, dropping the old copy would
        # cascade. The pragma is a no-op inside a transaction, so it goes first.
        connection.exec_driver_sql("PRAGMA foreign_keys = OFF")
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    elif dialect == "postgresql":
        lock = text("SELECT pg_advisory_xact_lock(:key)")
        connection.execute(lock, {"key": _PG_MIGRATION_LOCK_KEY})


def upgrade_to_head(url_or_engine: str | Engine) -> None:
    """Create or upgrade sweepmaster's tables to the newest revision (``alembic upgrade head``).

    Idempotent: a database already at head is left as it is. Only ``sm_*`` tables and
    ``sweepmaster_alembic_version`` are touched; Optuna's tables and its ``alembic_version`` in
    the same database are not.

    Example:
        >>> upgrade_to_head("sqlite:///sweepmaster.db")  # doctest: +SKIP

    Args:
        url_or_engine: A storage URL, or an engine from
            :func:`~sweepmaster.store.engine.create_store_engine`.

    Raises:
        StorageError: The database is unreachable (see
            :func:`~sweepmaster.store.engine.create_store_engine`), is at a revision this
            version of sweepmaster does not know (written by a newer sweepmaster), holds
            Optuna tables this Optuna cannot use (:func:`check_optuna_schema`), or the upgrade
            failed in the database.
    """
    if isinstance(url_or_engine, str):
        engine = create_store_engine(url_or_engine)
        try:
            upgrade_to_head(engine)
        finally:
            engine.dispose()
        return

    engine = url_or_engine
    with schema_lock(engine):
        _upgrade_to_head(engine)


def _upgrade_to_head(engine: Engine) -> None:
    shown = masked_url(engine.url)
    check_optuna_schema(engine)
    try:
        with engine.connect() as connection:
            try:
                lock_for_migration(connection)
                command.upgrade(_alembic_config(connection), "head")
                connection.commit()
            finally:
                if connection.dialect.name == "sqlite":
                    connection.rollback()  # no-op after the commit; ends a failed upgrade
                    connection.exec_driver_sql("PRAGMA foreign_keys = ON")
                    connection.commit()
    except CommandError as err:
        raise StorageError(
            f"cannot upgrade storage {shown}: {err} (was it created by a newer sweepmaster?)"
        ) from err
    except sqlalchemy.exc.DBAPIError as err:
        raise StorageError(f"cannot upgrade storage {shown}: {first_line(err)}") from err
