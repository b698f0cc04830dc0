"""Shared fixtures: data directories, storage URLs for SQLite and PostgreSQL, the ``cuda`` skip.

Data: WikiText-2 and the GPT-2 tokenizer come from ``../shared/data`` (the full WikiText-2) when
that directory exists, else from the slice shipped in ``examples/data/``; see
:mod:`data_paths`. Set ``SMTEST_SHARED_DATA`` to another directory (or to one that
does not exist, to use the shipped slice).

The HuggingFace hub is never asked: ``HF_HUB_OFFLINE`` is set for every test (a test that
needs hub ids lays out a cache of its own, :mod:`hub_cache`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import sqlalchemy.exc
from data_paths import TOKENIZER_DIR, WIKITEXT_DIR

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub reads it

POSTGRES_URL = os.environ.get(
    "SMTEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(autouse=True)
def _skip_cuda_without_gpu(request: pytest.FixtureRequest) -> None:
    """Skip tests marked ``cuda`` when no CUDA device is available."""
    if request.node.get_closest_marker("cuda") is None:
        return
    import torch  # only tests that need a GPU pay for importing torch here

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    """A WikiText-2 directory (``wiki.{train,valid,test}.tokens``): shared, else shipped."""
    return WIKITEXT_DIR


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The GPT-2 tokenizer directory: shared, else shipped."""
    return TOKENIZER_DIR


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


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def storage_url(request: pytest.FixtureRequest) -> str:
    """The same test on a SQLite file and on a PostgreSQL schema (skipped without a server)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tiny models: faster, and much faster on a busy machine.

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def counted_plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count the real ``plan_job`` calls made through ``cached_plan`` (profiling runs)."""
    from sweepmaster.runtime.planning import partition

    calls: list[str] = []
    real = partition.plan_job

    def counting(spec, device, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(device.name)
        return real(spec, device, **kwargs)

    monkeypatch.setattr(partition, "plan_job", counting)
    return calls


@pytest.fixture
def late_copy_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy threads that the OS deschedules right after each copy (a loaded machine, forced).

    Every work item of a ``concurrent.futures`` thread pool pauses 50 ms after its future
    completes, before the thread drops the item: whatever the item still references stays
    alive while the waiter goes on, as on a busy 2-core machine.
    """
    import concurrent.futures.thread
    import time

    run = concurrent.futures.thread._WorkItem.run

    def run_then_pause(self) -> None:  # type: ignore[no-untyped-def]
        run(self)
        time.sleep(0.05)

    monkeypatch.setattr(concurrent.futures.thread._WorkItem, "run", run_then_pause)
