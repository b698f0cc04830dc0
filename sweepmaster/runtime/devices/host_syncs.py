"""Counting host syncs: the calls that make the host wait for a GPU, counted on any device.

On CUDA a training step should queue its work and let the host run ahead; every
``.item()``, ``.tolist()``, ``bool(tensor)``, data-dependent shape (``nonzero``,
``masked_select``) or blocking device -> host copy makes the host wait until the GPU has
caught up (``torch.cuda.set_sync_debug_mode("error")`` turns most of them into errors). On the
CPU nothing waits, so :class:`HostSyncCounter` counts the calls themselves: the ops that would
force a sync on CUDA, seen by a ``TorchFunctionMode`` (``tolist``, ``numpy``: methods that
read a CPU tensor's memory without dispatching an op) and a ``TorchDispatchMode`` (every
other one), and the blocking waits for device -> host copies the runtime reports
(:func:`note_host_wait`). A step of the trainer runs at most one such sync: where it reports
its results. Reads of tensors that live on the host on a GPU too are no sync and are not
counted: those :func:`host_resident` names (host copies of results, after their one wait) and
``torch.optim``'s step counters (kept on the host unless ``capturable``).

Example:
    >>> x = torch.ones(3)
    >>> with HostSyncCounter() as counter:
    ...     _ = (x * 2).sum().item()
    ...     _ = bool((x > 0).all())
    >>> counter.total, sorted(counter.counts)
    (2, ['aten._local_scalar_dense.default'])
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "host_resident", "note_host_wait"]

#: ATen ops whose result the host must read (a scalar, a data-dependent shape, a bool).
_SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default",
    "aten.is_nonzero.default",
    "aten.nonzero.default",
    "aten.nonzero.out",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten.allclose.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
})
#: Tensor methods that read a CPU tensor's memory without dispatching an ATen op.
_SYNC_METHODS = frozenset({"tolist", "numpy", "__array__"})

_ACTIVE: list[HostSyncCounter] = []
_ACTIVE_LOCK = threading.Lock()
#: Tensors in host memory on any device (see :func:`host_resident`).
_HOST: dict[int, weakref.ref[torch.Tensor]] = {}


def host_resident(tensor: torch.Tensor) -> torch.Tensor:
    """Name ``tensor`` as host memory on any device (reading it is no sync); returns it."""
    key = id(tensor)
    _HOST[key] = weakref.ref(tensor, lambda _: _HOST.pop(key, None))
    return tensor


def _reads_host(args: Any) -> bool:
    """Whether a call reads a host-resident tensor (or ``torch.optim``'s step counter)."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return False
    ref = _HOST.get(id(first))
    if ref is not None and ref() is first:
        return True
    if first.dim() != 0:
        return False
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:  # torch.optim's _get_value(step): a host tensor, not capturable
        if "torch/optim/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def note_host_wait(what: str) -> None:
    """Report a blocking wait of the host for a device -> host copy (``what`` names it).

    Counted by every :class:`HostSyncCounter` entered on the calling thread.
    """
    thread = threading.get_ident()
    with _ACTIVE_LOCK:
        counters = [c for c in _ACTIVE if c.thread == thread]
    for counter in counters:
        counter.counts[f"wait:{what}"] += 1


class _Methods(TorchFunctionMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _SYNC_METHODS and not _reads_host(args):
            self.counts[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if (name in _SYNC_OPS and not _reads_host(args)) or _blocking_to_host(name, args, kwargs):
            self.counts[name] += 1
        return func(*args, **kwargs)


def _blocking_to_host(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an op is a blocking copy from a GPU (or other accelerator) to the host."""
    if name == "aten.copy_.default":
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and dst.device.type == "cpu" and src.device.type not in ("cpu", "meta")
    if name == "aten._to_copy.default":
        src = args[0]
        device = kwargs.get("device")
        return (device is not None and torch.device(device).type == "cpu"
                and src.device.type not in ("cpu", "meta")
                and not kwargs.get("non_blocking", False))
    return False


class HostSyncCounter:
    """Counts, on the entering thread, the calls that would make the host wait for a GPU.

    Entered around a training step (see the module doc). Not reentrant.

    Attributes:
        counts: Calls by name (an ATen op, ``Tensor.<method>``, or ``wait:<what>`` from
            :func:`note_host_wait`).
        thread: The thread that entered it.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.thread = 0
        self._methods = _Methods(self.counts)
        self._ops = _Ops(self.counts)

    @property
    def total(self) -> int:
        """Host syncs counted so far."""
        return sum(self.counts.values())

    def __enter__(self) -> HostSyncCounter:
        self.thread = threading.get_ident()
        self._methods.__enter__()
        self._ops.__enter__()
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *args: Any) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.remove(self)
        self._ops.__exit__(*args)
        self._methods.__exit__(*args)
