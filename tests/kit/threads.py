"""Thread fixtures (one intra-op thread for tiny models, copy threads a busy machine delays)
and threads started together."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

__all__ = ["late_copy_thread", "one_thread", "start_and_join"]


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


def start_and_join(threads: list[threading.Thread], timeout_s: float | None = None) -> None:
    """Start every thread, then wait for each (at most ``timeout_s`` seconds for each)."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
