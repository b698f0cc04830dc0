"""Stop a sweep on SIGTERM as on Ctrl-C, and let a stopping sweep finish its stop.

Schedulers (Slurm, Kubernetes) and ``docker stop`` end a process with SIGTERM, then SIGKILL
after a grace period. While a sweep runs (:func:`stop_on_signals`, around
:func:`~sweepmaster.sweep.run.run_sweep`), SIGTERM raises :class:`Terminated`, a
``KeyboardInterrupt``: the sweep stops as on Ctrl-C (its running trials are marked FAIL,
interrupted, and resume from their checkpoints on relaunch). Once it is stopping, a second
SIGINT or SIGTERM is ignored (it would interrupt the stop itself, half-way through marking the
trials, with an ``Exception ignored ... KeyboardInterrupt`` traceback); SIGKILL still ends it,
and the next launch then fails its trials as stale and resumes them.

Example:
    >>> with stop_on_signals():  # doctest: +SKIP
    ...     run()  # SIGTERM raises Terminated here
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "ignore_signals", "interrupt_reason", "stop_on_signals"]

_STOPS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as on Ctrl-C (a ``KeyboardInterrupt``, so handled the same)."""

    def __str__(self) -> str:
        return "SIGTERM"


def interrupt_reason(exc: BaseException | None = None) -> str:
    """Why a stopped trial failed: ``"interrupted (Ctrl-C)"`` or ``"terminated (SIGTERM)"``."""
    return "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated`; after one stop, ignore more.

    SIGINT raises ``KeyboardInterrupt`` as usual. Once either has been raised, later SIGINT and
    SIGTERM are ignored until the block ends, so the stop (marking trials, closing the
    database) completes. The previous handlers are restored on exit. Outside the main thread
    (where Python cannot set handlers) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            return
        stopping.set()
        if signum == signal.SIGTERM:
            raise Terminated()
        raise KeyboardInterrupt()

    previous = {number: signal.signal(number, handle) for number in _STOPS}
    try:
        yield
    except KeyboardInterrupt:
        stopping.set()  # a Ctrl-C raised before this handler ran (e.g. in C code)
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def ignore_signals() -> None:
    """Ignore SIGINT and SIGTERM from now on: the process is stopping and says so itself.

    Called by the CLI after a stop, so that a second Ctrl-C while the interpreter shuts down
    (joining threads) prints no traceback. Main thread only; elsewhere a no-op.
    """
    if threading.current_thread() is threading.main_thread():
        for number in _STOPS:
            signal.signal(number, signal.SIG_IGN)
