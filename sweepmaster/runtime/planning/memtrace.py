"""Saved-activation trace of one layer: what the swap/recompute planner decides over.

mu-TWO (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) plans from a profile of
every activation autograd saves: its bytes, the op that makes it, that op's time and its last
forward use. :func:`trace_layer` records them for one layer on one microbatch ``(b, T)`` with the
runtime's packing rule (:class:`~sweepmaster.runtime.training.swap.LayerPacker`: one activation
per distinct saved storage, in first-save order, parameters excluded) and dropout mode
(:class:`~sweepmaster.runtime.training.replay.RandomReplay`, whose full-minibatch masks count),
metering forward without grad, forward with grad and backward like
:mod:`~sweepmaster.runtime.planning.profile`. Op times are a roofline
(``max(FLOPs / rate, bytes / bandwidth)``) rescaled to add up to the layer's profiled forward.
:mod:`~sweepmaster.runtime.planning.memprofile` traces every layer of a job's shards with it.

A trace runs while other jobs train on the same device, so it touches nothing they use: its
dropout stream is a generator of its own (:func:`trace_rng`; never the global CPU generator or a
device's default one that a job's dropout replay has bound), its bytes are counted by its own
meter (never by resetting the device's peak statistics).

Shape legend: K members, b microbatch (blocks), B batch, T tokens per block.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.planning.profile import _UNLIMITED_BYTES, _nbytes
from sweepmaster.runtime.training.replay import JobRng, RandomReplay
from sweepmaster.runtime.training.swap import LayerEntry, LayerPacker
from sweepmaster.workload.causal_lm import causal_lm_loss

__all__ = ["ActivationProfile", "LayerActivations", "trace_layer", "trace_rng"]

#: ``loss(output, ids)``: the scalar a last layer's backward starts from.
TraceLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ActivationSource = Literal["input", "created", "external"]


@dataclass(frozen=True)
class ActivationProfile:
    """One saved activation (one storage) of one layer pass on one microbatch.

    Attributes:
        index: Position in first-save order within the layer (the runtime's slot index).
        num_bytes: Bytes of its storage.
        source: ``"input"`` (the layer's input), ``"created"`` by the layer's ops, or
            ``"external"`` (made before the layer, e.g. the token ids a loss saves).
        op: The aten op that made it (``""`` unless created), ``forward_s`` that op's seconds.
        created_s: When it is made, seconds from the layer's forward start, like ``last_use_s``
            (its last forward use ends) and ``saved_s`` (autograd saves it: it may offload).
    """

    index: int
    num_bytes: int
    source: ActivationSource
    op: str
    forward_s: float
    created_s: float
    last_use_s: float
    saved_s: float = 0.0


@dataclass(frozen=True)
class LayerActivations:
    """Bytes and seconds of one layer on one microbatch, as the planner sees them.

    Peaks are bytes above the layer's input (and, for the backward, above its saved activations
    and output gradient): what the layer adds to what is already live.

    Attributes:
        index: Layer index in the model's layer stack, ``name`` its name.
        rows: Blocks per microbatch (b).
        activations: Its saved activations, in slot order.
        input_bytes: Its input, ``output_bytes`` its output (the loss, for the last layer).
        forward_s: Seconds of its forward, ``backward_s`` of its backward.
        forward_peak_bytes: Peak of a forward without grad (dropout masks of the whole minibatch
            included).
        grad_forward_peak_bytes: Peak of a forward with grad, saved activations kept.
        backward_peak_bytes: Peak of its backward above the saved activations and the output
            gradient (parameter gradients and the input gradient included).
        swappable: Whether every byte its graph holds is in an activation (else it can only be
            recomputed).
    """

    index: int
    name: str
    rows: int
    activations: tuple[ActivationProfile, ...]
    input_bytes: int
    output_bytes: int
    forward_s: float
    backward_s: float
    forward_peak_bytes: int
    grad_forward_peak_bytes: int
    backward_peak_bytes: int
    swappable: bool

    @property
    def saved_bytes(self) -> int:
        """Bytes of all its saved activations."""
        return sum(a.num_bytes for a in self.activations)


def trace_layer(
    layer: nn.Module, hidden: torch.Tensor, *, index: int, name: str, full_rows: int,
    forward_s: float, backward_s: float, loss_ids: torch.Tensor | None,
    fake_mode: FakeTensorMode | None, flops_per_s: float, bytes_per_s: float,
    row_dim: int = 0, loss: TraceLoss = causal_lm_loss, meter: VirtualMeter | None = None,
) -> tuple[LayerActivations, torch.Tensor]:
    """Profile one layer on a fake microbatch, or on a real one on a device (see the module doc).

    Args:
        layer: The layer (fake parameters, or real ones on the device it is profiled on).
        hidden: Its input, ``(b, ...)`` (a stacked layer's ``(K, b, ...)``), fake or on the
            layer's device.
        index: Its index in the layer stack.
        name: Its name.
        full_rows: B, the minibatch the dropout masks are drawn for.
        forward_s: Seconds of its forward (from the model profile), to rescale op times.
        backward_s: Seconds of its backward.
        loss_ids: Token ids ``(b, T)`` (``(K, b, T)``) when the layer ends with the loss, else
            ``None``.
        fake_mode: The fake mode the model was built under; ``None`` for real tensors (a
            pilot pass on ``hidden``'s device, whose kernels then decide what is saved).
        flops_per_s: Compute rate of the roofline (FLOP/s).
        bytes_per_s: Memory bandwidth of the roofline (bytes/s).
        row_dim: The dimension of ``hidden`` that holds the rows (1 for a stacked layer).
        loss: The loss of a layer that ends with it (a stacked layer: the members' sum).
        meter: Counts the trace's bytes (default a new unlimited one); the caller reads its
            peak when the trace runs out of device memory.

    Returns:
        The profile and the layer's output without grad (the next layer's input).
    """
    rows = int(hidden.shape[row_dim])
    meter = meter if meter is not None else VirtualMeter(_UNLIMITED_BYTES, "profile")
    torch_device = hidden.device
    rng = trace_rng(torch_device)
    mode: contextlib.AbstractContextManager[Any] = (
        fake_mode if fake_mode is not None else contextlib.nullcontext()
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer(x) if loss_ids is None else loss(layer(x), loss_ids)

    def replay() -> RandomReplay:
        return RandomReplay(rng, [], True, slice(0, rows), full_rows, False, meter)

    resident = [*layer.parameters(), *layer.buffers()]
    with rng.bound(torch_device), mode:
        with torch.no_grad():
            meter.reset_peak()
            with replay():
                output = forward(hidden)
            no_grad_peak = meter.peak_bytes
            if loss_ids is not None:
                with replay():
                    output = layer(hidden)
        x = hidden.detach()
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        x_in = LayerEntry.apply(x, anchor) if x.is_floating_point() else x
        packer = LayerPacker(resident, x)
        tracer = _OpTracer(x, flops_per_s, bytes_per_s)
        saved_at: list[int] = []  # ops run before each slot's first save
        pack = packer.pack

        def pack_and_note(tensor: torch.Tensor) -> Any:
            handle = pack(tensor)
            saved_at.extend([len(tracer.ops)] * (len(packer.slots) - len(saved_at)))
            return handle

        packer.pack = pack_and_note  # type: ignore[method-assign]
        base = meter.live_bytes
        meter.reset_peak()
        with replay(), tracer, packer.hooks():
            out = forward(x_in)
        grad_peak = meter.peak_bytes - base
        output_bytes = _nbytes(out)
        edge = torch.autograd.graph.get_gradient_edge(out) if out.requires_grad else None
        grad_out = torch.ones_like(out) if loss_ids is None else torch.ones(
            (), dtype=out.dtype, device=out.device)
        del out
        held = meter.live_bytes - base
        uses = {slot.index: tracer.uses(slot) for slot in packer.slots}  # while storages live
        created = {index for index, (producer, _) in uses.items() if producer >= 0}
        created_bytes = sum(s.num_bytes for s in packer.slots if s.index in created)
        meter.reset_peak()
        start = meter.live_bytes
        with meter.metering():
            if edge is not None:
                torch.autograd.backward(edge, grad_out)  # type: ignore[arg-type]
        backward_peak = meter.peak_bytes - start
        del edge, grad_out, x_in
        for param in layer.parameters():
            param.grad = None
    times = tracer.op_seconds(forward_s)
    activations = []
    for slot in packer.slots:
        source: ActivationSource = "input" if slot.source == "input" else "external"
        producer, last_op = uses[slot.index]
        op, made, op_s = "", 0.0, 0.0
        if producer >= 0:
            source = "created"
            op, made, op_s = tracer.ops[producer][0], sum(times[: producer + 1]), times[producer]
        last_use = max(sum(times[: last_op + 1]), made)
        saved = max(sum(times[: saved_at[slot.index]]), made)
        activations.append(ActivationProfile(
            index=slot.index, num_bytes=slot.num_bytes, source=source, op=op, forward_s=op_s,
            created_s=made, last_use_s=last_use, saved_s=saved))
    profile = LayerActivations(
        index=index, name=name, rows=rows, activations=tuple(activations),
        input_bytes=_nbytes(hidden), output_bytes=output_bytes, forward_s=forward_s,
        backward_s=backward_s, forward_peak_bytes=no_grad_peak, grad_forward_peak_bytes=grad_peak,
        backward_peak_bytes=backward_peak, swappable=held <= created_bytes,
    )
    return profile, output.detach()


def trace_rng(torch_device: torch.device) -> JobRng:
    """A dropout stream of the trace's own, seeded 0: never a running job's, never the global.

    A trace runs while other jobs train on the device (from the thread that plans, or between
    their tasks), so it must not read, draw from or restore the streams they draw from. On the
    CPU every random op of the trace gets this generator as its argument
    (:class:`~sweepmaster.runtime.training.replay.RandomReplay`); on CUDA, where fused kernels
    draw from the device's default generator, :meth:`JobRng.bound` installs it there under the
    device's RNG lock, which a job's task holds while its own stream is bound, so the trace
    runs between tasks and puts back what it found.
    """
    if torch_device.type == "cuda":
        generator = torch.Generator(device=torch_device)
        return JobRng("cuda", generator.manual_seed(0).get_state())
    return JobRng("cpu", torch.Generator().manual_seed(0).get_state())


class _OpTracer(TorchDispatchMode):
    """Records each op of a forward: name, roofline seconds, which storages it makes and reads."""

    def __init__(self, layer_input: torch.Tensor, flops_per_s: float, bytes_per_s: float) -> None:
        super().__init__()
        self.flops_per_s = flops_per_s
        self.bytes_per_s = bytes_per_s
        self.ops: list[tuple[str, float]] = []  # (name, roofline seconds)
        # id(storage) -> (weakref, producing op, last reading op); -1 = before the layer
        self._storages: dict[int, tuple[weakref.ref[Any], int, int]] = {}
        self._note(layer_input.untyped_storage(), -1, reading=False)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = len(self.ops)
        inputs = list(_tensors((args, tuple(kwargs.values()))))
        outputs = list(_tensors(out))
        moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        seconds = moved / self.bytes_per_s
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            flops = count(*args, **kwargs, out_val=out)
            seconds = max(seconds, float(flops) / self.flops_per_s)
        self.ops.append((str(func.overloadpacket.__name__), seconds))
        seen = {id(t.untyped_storage()) for t in inputs}
        for tensor in inputs:
            self._note(tensor.untyped_storage(), op, reading=True)
        for tensor in outputs:
            if id(tensor.untyped_storage()) not in seen:
                self._note(tensor.untyped_storage(), op, reading=False)
        return out

    def _note(self, storage: torch.UntypedStorage, op: int, reading: bool) -> None:
        key = id(storage)
        entry = self._storages.get(key)
        if entry is not None and entry[0]() is storage:
            if reading:
                self._storages[key] = (entry[0], entry[1], op)
            return
        if not reading:
            self._storages[key] = (weakref.ref(storage), op, op)

    def uses(self, slot: Any) -> tuple[int, int]:
        """``(producing op, last reading op)`` of a live slot's storage; -1 when not seen."""
        storage = slot.storage()
        entry = self._storages.get(id(storage)) if storage is not None else None
        if entry is None or entry[0]() is not storage:
            return -1, -1
        return entry[1], entry[2]

    def op_seconds(self, total_s: float) -> list[float]:
        """Each op's seconds, rescaled to add up to ``total_s`` (the layer's forward)."""
        raw = sum(seconds for _, seconds in self.ops)
        scale = total_s / raw if raw > 0 else 0.0
        return [seconds * scale for _, seconds in self.ops]


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
