"""A job's own dropout stream, recorded and replayed per random op (exact recompute).

Spilled training runs a shard's forward more than once (the forward task, the recompute of the
backward task, one pass per microbatch) and must draw the same dropout masks as plain training's
single full-batch pass (``tests/runtime/training/test_conformance.py``). :class:`JobRng` is the
job's own generator;
:class:`RandomReplay` is the dispatch mode that records its state before every random op of a
shard's first pass and replays it for the other passes (see
:mod:`~sweepmaster.runtime.training.spill`).

Attention dropout under microbatches: a fused scaled-dot-product attention kernel (CUDA's
flash, memory-efficient or cuDNN kernels) draws its dropout mask inside the kernel, from the
generator's Philox seed and offset and the *batch index* of each row, so a microbatch cannot take
its rows of the full minibatch's mask from a smaller launch, and the kernel's backward draws the
mask again from the same state. :class:`FullBatchAttention` (entered by :class:`RandomReplay`
where :func:`pads_attention` says it must) therefore runs such an attention call on the full
minibatch: the microbatch's query, key and value are zero-padded to ``full_rows`` rows at their
place, the kernel runs with the replayed RNG state (drawing exactly plain training's masks, and
advancing the generator by plain's amount), and the microbatch's rows of the output are kept.
Autograd differentiates through the padding, so the backward is the kernel's own backward on
the full minibatch: the masks match there too. The cost is one full-minibatch attention per
microbatch; on the CPU the math kernel's dropout is an ordinary ``bernoulli_`` /
``native_dropout`` that :class:`RandomReplay` replays per row more cheaply, so padding is only
the default on other devices.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.planning.attention import AttentionMode

__all__ = ["FullBatchAttention", "JobRng", "RandomReplay", "pads_attention", "replays_by_state"]


def replays_by_state(device_type: str, rows: slice, full_rows: int, metered: bool) -> bool:
    """Whether a pass replays dropout by generator state alone, with no dispatch mode.

    Args:
        device_type: The type of the job's stream (``"cpu"``: drawn through a ``generator``
            argument each op must be given, so ops are intercepted).
        rows: The pass's rows of the minibatch (a microbatch draws full-minibatch masks per op).
        full_rows: Rows of the minibatch.
        metered: Whether the pass also meters a virtual device (in the same mode).

    Returns:
        ``True`` for a full-minibatch, unmetered pass of a device's stream.
    """
    return device_type != "cpu" and not metered and rows.stop - rows.start == full_rows


def pads_attention(device_type: str, rows: slice, full_rows: int, force: bool | None) -> bool:
    """Whether a shard pass over ``rows`` of ``full_rows`` runs attention on the full minibatch.

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... : where the pass runs.
        rows: The microbatch's rows of the minibatch.
        full_rows: Rows of the minibatch.
        force: ``True`` / ``False`` to decide regardless of the device; ``None``: pad on every
            device but the CPU (whose attention dropout :class:`RandomReplay` replays per row).

    Returns:
        ``False`` for a full-minibatch pass (nothing to pad), else as ``force`` says.
    """
    if rows.stop - rows.start == full_rows:
        return False
    return device_type != "cpu" if force is None else force


class FullBatchAttention(AttentionMode):
    """Run ``F.scaled_dot_product_attention`` with dropout over the whole minibatch.

    See the module doc. Calls without dropout, or whose query is not ``(b, ..., T, D)`` with
    ``b`` the microbatch's rows, pass through unchanged.

    Args:
        replay: The :class:`RandomReplay` of the pass; its :attr:`RandomReplay.padded` is set
            while the padded kernel runs, so its random ops draw at full size.
    """

    def __init__(self, replay: RandomReplay) -> None:
        super().__init__()
        self.replay = replay

    def attention(self, bound: dict[str, Any]) -> Any:
        """Run the call over the full minibatch where it drops out; its rows of the output."""
        rows = self.replay.rows
        num_rows = rows.stop - rows.start
        query = bound["query"]
        if bound.get("dropout_p", 0.0) == 0.0 or query.dim() < 3 or query.shape[0] != num_rows:
            return F.scaled_dot_product_attention(**bound)
        full_rows = self.replay.full_rows
        for name in ("query", "key", "value"):
            bound[name] = _pad_rows(bound[name], rows, full_rows, zeros=True)
        mask = bound.get("attn_mask")
        if mask is not None and mask.dim() == query.dim() and mask.shape[0] == num_rows > 1:
            bound["attn_mask"] = _pad_rows(mask, rows, full_rows, zeros=False)
        self.replay.padded = True
        try:
            out = F.scaled_dot_product_attention(**bound)
        finally:
            self.replay.padded = False
        return out[rows]


#: Whether an op overload draws random numbers (``nondeterministic_seeded``), by op: read once.
_SEEDED: dict[Any, bool] = {}


def _no_dropout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a seeded op is an attention kernel called with ``dropout_p == 0`` (no draw)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            if argument.name in kwargs:
                return bool(kwargs[argument.name] == 0.0)
            if index < len(args):
                return bool(args[index] == 0.0)
            return argument.default_value == 0.0
    return False


def _pad_rows(tensor: torch.Tensor, rows: slice, full_rows: int, zeros: bool) -> torch.Tensor:
    """``tensor`` (``rows`` of a minibatch) at its place among ``full_rows`` rows (dim 0).

    The other rows are zeros (query, key, value: a finite softmax) or copies of the first row (a
    mask, so that no row is masked entirely).
    """
    parts = []
    for num in (rows.start, full_rows - rows.stop):
        if num:
            shape = (num, *tensor.shape[1:])
            parts.append(tensor.new_zeros(shape) if zeros else tensor[:1].expand(shape))
    before = parts[:1] if rows.start else []
    after = parts[-1:] if full_rows - rows.stop else []
    return torch.cat([*before, tensor, *after])


#: Per CUDA device index: held while a stream is bound as the device's default generator, so
#: that two streams (a job's task, a memory-plan trace) are never bound there at once.
_CUDA_RNG_LOCKS: dict[int, threading.RLock] = {}
_CUDA_RNG_LOCKS_LOCK = threading.Lock()


def _cuda_rng_lock(index: int) -> threading.RLock:
    with _CUDA_RNG_LOCKS_LOCK:
        return _CUDA_RNG_LOCKS.setdefault(index, threading.RLock())


class JobRng:
    """A job's own dropout stream: a CPU generator, or a CUDA state swapped in per task."""

    def __init__(self, device_type: str, state: torch.Tensor) -> None:
        self.device_type = device_type
        self.generator: torch.Generator | None = None
        if device_type == "cpu":
            self.generator = torch.Generator()
            self.generator.set_state(state)
        self._state = state

    @contextlib.contextmanager
    def bound(self, torch_device: torch.device) -> Iterator[None]:
        """On CUDA, install the job's state in the device's default generator for a task.

        The device's RNG lock is held meanwhile: another stream (a memory-plan trace on another
        thread) waits until the task ends rather than swapping the generator under it.
        """
        if self.device_type == "cpu":
            yield
            return
        index = torch_device.index if torch_device.index is not None else 0
        generator = torch.cuda.default_generators[index]
        with _cuda_rng_lock(index):
            previous = generator.get_state()
            generator.set_state(self._state)
            self.generator = generator
            try:
                yield
            finally:
                self._state = generator.get_state()
                generator.set_state(previous)
                self.generator = None

    def saved_state(self) -> torch.Tensor:
        """The stream's state between tasks (outside :meth:`bound`), for a checkpoint."""
        if self.device_type == "cpu":
            assert self.generator is not None
            return self.generator.get_state()
        return self._state

    def load_state(self, state: torch.Tensor) -> None:
        """Continue the stream from ``state`` (between tasks, outside :meth:`bound`)."""
        if self.device_type == "cpu":
            assert self.generator is not None
            self.generator.set_state(state)
        self._state = state

    def get_state(self) -> torch.Tensor:
        """The generator's state now (inside :meth:`bound` on CUDA)."""
        assert self.generator is not None
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Set the generator's state (inside :meth:`bound` on CUDA)."""
        assert self.generator is not None
        self.generator.set_state(state)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the random op ``func`` drawing from this stream.

        Raises:
            RuntimeError: A CPU random op without a ``generator`` argument.
        """
        if self.device_type == "cpu":
            if not any(a.name == "generator" for a in func._schema.arguments):
                raise RuntimeError(f"random op {func} has no generator argument to replay")
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


class RandomReplay(TorchDispatchMode):
    """Record or replay the job's RNG state before each random op of one shard pass.

    ``record``: append the state before each random op to ``tape`` and run the op (advancing the
    job's stream like plain's pass). Otherwise set the state from ``tape`` before each op. For a
    microbatch (``rows`` of ``full_rows``), the op is run on the full-minibatch shape and the rows
    are kept; when replaying a CPU ``bernoulli_``, only the leading rows up to ``rows.stop`` are
    drawn (element k of a CPU draw depends only on the generator state and k). ``restore``: put
    the job's stream back as it was when the pass began (recompute).

    It also does the virtual device's metering (``meter``), so each op pays for one Python mode.

    Where :func:`pads_attention` says so (``pad_attention``: ``None`` decides by the device of the
    job's stream), attention calls with dropout run on the full minibatch
    (:class:`FullBatchAttention`): that is how attention dropout inside a fused kernel is replayed
    per microbatch.

    No Python mode on the GPU's hot path (:func:`replays_by_state`): for a full-minibatch pass of
    a stream that is not the CPU's (random ops draw from the device's default generator, which
    :meth:`JobRng.bound` set to the job's stream) and without a meter to feed, nothing is
    intercepted. The tape then holds generator states at the pass's start, at each read of
    :attr:`site` (a layer's start, see :mod:`~sweepmaster.runtime.training.layerpass`) and at its
    end, and a replay from a site sets that state once: the same ops on the same shapes draw the
    same numbers from it.
    """

    def __init__(
        self,
        rng: JobRng,
        tape: list[torch.Tensor],
        record: bool,
        rows: slice,
        full_rows: int,
        restore: bool,
        meter: VirtualMeter | None = None,
        pad_attention: bool | None = None,
    ) -> None:
        super().__init__()
        self.meter = meter
        self.rng = rng
        self.tape = tape
        self.record = record
        self.rows = rows
        self.full_rows = full_rows
        self.restore = restore
        self._site = 0
        self.padded = False  # a padded attention kernel runs: draw at full size
        self.by_state = replays_by_state(rng.device_type, rows, full_rows, meter is not None)
        self._start: torch.Tensor | None = None
        self._attention: FullBatchAttention | None = None
        if pads_attention(rng.device_type, rows, full_rows, pad_attention):
            self._attention = FullBatchAttention(self)

    @property
    def site(self) -> int:
        """Random ops of the pass so far; where a replay of the rest starts (a tape index).

        Replaying by state (:attr:`by_state`), reading it in a recording pass records the
        generator's state now.
        """
        if self.by_state and self.record and self._entered:
            self.tape.append(self.rng.get_state())
            return len(self.tape) - 1
        return self._site

    @site.setter
    def site(self, value: int) -> None:
        self._site = value

    _entered = False

    def __enter__(self) -> RandomReplay:
        self._start = self.rng.get_state()
        if self.by_state:
            if self.record:
                self.tape.append(self._start)  # site 0
            else:
                self.rng.set_state(self.tape[self._site])
            self._entered = True
            return self
        if self._attention is not None:
            self._attention.__enter__()
        try:
            return super().__enter__()  # type: ignore[no-any-return]
        except BaseException:
            if self._attention is not None:
                self._attention.__exit__(None, None, None)
            raise

    def __exit__(self, *args: Any) -> None:
        if self.by_state:
            self._entered = False
        else:
            super().__exit__(*args)
            if self._attention is not None:
                self._attention.__exit__(*args)
        if self.record:
            self.tape.append(self.rng.get_state())  # the state after the pass
        elif self.restore:
            assert self._start is not None
            self.rng.set_state(self._start)
        else:
            self.rng.set_state(self.tape[-1])

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        seeded = _SEEDED.get(func)
        if seeded is None:
            seeded = _SEEDED[func] = torch.Tag.nondeterministic_seeded in func.tags
        if not seeded or _no_dropout(func, args, kwargs):
            out = func(*args, **kwargs)
            if self.meter is not None:
                self.meter.account(args, kwargs, out)
            return out
        if self.record:
            self.tape.append(self.rng.get_state())
        else:
            self.rng.set_state(self.tape[self._site])
        self._site += 1
        if self.padded or self.rows.stop - self.rows.start == self.full_rows:
            out = self.rng.call(func, args, kwargs)
            if self.meter is not None:
                self.meter.account(args, kwargs, out)
            return out
        return self._full_batch_rows(func, args, kwargs)

    def _full_batch_rows(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rows = self.rows
        target = args[0]
        if target.shape[0] != rows.stop - rows.start or not target.is_contiguous():
            raise RuntimeError(f"cannot replay {func} per microbatch: rows are not dim 0")
        if func is torch.ops.aten.bernoulli_.float:
            prefix = not self.record and target.device.type == "cpu"
            drawn = rows.stop if prefix else self.full_rows
            shape = (drawn, *target.shape[1:])
            full = torch.empty(shape, dtype=target.dtype, device=target.device)
            self._track(full)
            self.rng.call(func, (full, *args[1:]), kwargs)
            target.copy_(full[rows])
            return target
        if func is torch.ops.aten.native_dropout.default:
            full_input = target.new_zeros((self.full_rows, *target.shape[1:]))
            self._track(full_input)
            full_input[rows] = target
            output, mask = self.rng.call(func, (full_input, *args[1:]), kwargs)
            outputs = output[rows].clone(), mask[rows].clone()
            for tensor in outputs:
                self._track(tensor)
            return outputs
        raise ValueError(
            f"random op {func} cannot be replayed per microbatch; train this model with "
            "microbatch_size equal to batch_size"
        )

    def _track(self, tensor: torch.Tensor) -> None:
        if self.meter is not None:
            self.meter.track(tensor)
