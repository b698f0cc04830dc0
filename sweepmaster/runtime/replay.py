"""A job's own dropout stream, recorded and replayed per random op (exact recompute).

Spilled training runs a shard's forward more than once (the forward task, the recompute of the
backward task, one pass per microbatch) and must draw the same dropout masks as plain training's
single full-batch pass (DESIGN, "Exactness"). :class:`JobRng` is the job's own generator;
:class:`RandomReplay` is the dispatch mode that records its state before every random op of a
shard's first pass and replays it for the other passes (see :mod:`~sweepmaster.runtime.spill`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sweepmaster.runtime.meter import VirtualMeter

__all__ = ["JobRng", "RandomReplay"]


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
        """On CUDA, install the job's state in the device's default generator for a task."""
        if self.device_type == "cpu":
            yield
            return
        index = torch_device.index if torch_device.index is not None else 0
        generator = torch.cuda.default_generators[index]
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
    ) -> None:
        super().__init__()
        self.meter = meter
        self.rng = rng
        self.tape = tape
        self.record = record
        self.rows = rows
        self.full_rows = full_rows
        self.restore = restore
        self.site = 0
        self._start: torch.Tensor | None = None

    def __enter__(self) -> RandomReplay:
        self._start = self.rng.get_state()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
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
        if torch.Tag.nondeterministic_seeded not in func.tags:
            out = func(*args, **kwargs)
            if self.meter is not None:
                self.meter.account(args, kwargs, out)
            return out
        if self.record:
            self.tape.append(self.rng.get_state())
        else:
            self.rng.set_state(self.tape[self.site])
        self.site += 1
        if self.rows.stop - self.rows.start == self.full_rows:
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

