"""Storage URLs for SQLite and PostgreSQL, as fixtures; ``storage_url`` runs a test on both.

The PostgreSQL server is ``SMTEST_POSTGRES_URL`` (default: ``postgres@127.0.0.1:5432/test``);
tests that need it are marked ``postgres`` and skip when no server answers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import sqlalchemy.exc

__all__ = [
    "POSTGRES_URL", "STORAGES", "postgres_url", "sqlite_url", "storage_url", "store_engine",
]

POSTGRES_URL = os.environ.get(
    "SMTEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
#: The storages a storage test runs on: ``storage_url``'s parameters.
STORAGES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """URL of a fresh SQLite database file in the test's temporary directory."""
    return f"sqlite:///{tmp_path / 'sweepmaster.db'}"


@pytest.fixture(scope="session")
def _postgres_admin() -> Iterator[sa.Engine]:
    """An engine on the test server, or a skip when there is none (or no driver)."""
    try:
        engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except (ImportError, sqlalchemy.exc.DBAPIError) as err:
        shown = sa.make_url(POSTGRES_URL).render_as_string(hide_password=True)
        pytest.skip(f"no PostgreSQL server at {shown}: {type(err).__name__}")
    yield engine
    engine.dispose()


@pytest.fixture
def postgres_url(_postgres_admin: sa.Engine) -> Iterator[str]:
    """URL of a fresh, empty schema on the test PostgreSQL server, dropped after the test.

    The schema is made the connection's ``search_path`` through the URL, so Optuna's tables and
    sweepmaster's land there; tests may run concurrently against one server.
    """
    schema = f"sm_test_{uuid.uuid4().hex[:12]}"
    with _postgres_admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = sa.make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with _postgres_admin.begin() as connection:
        connection.execute(sa.text("SET LOCAL lock_timeout = '10s'"))
        connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


@pytest.fixture(params=STORAGES)
def storage_url(request: pytest.FixtureRequest) -> str:
    """The same test on a SQLite file and on a PostgreSQL schema (skipped without a server)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture
def store_engine(storage_url: str) -> Iterator[sa.Engine]:
    """An engine on a fresh database at head (``storage_url``: each storage); disposed after."""
    from sweepmaster.store import create_store_engine, upgrade_to_head

    upgrade_to_head(storage_url)
    engine = create_store_engine(storage_url)
    yield engine
    engine.dispose()
