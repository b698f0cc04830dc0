"""Saved-activation profile of each layer: what the swap/recompute planner decides over.

mu-TWO (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) plans from a profile of
every activation autograd saves: its bytes, the op that makes it, that op's time and its last
forward use. :func:`trace_layer` records them for one layer on one microbatch ``(b, T)`` with the
runtime's packing rule (:class:`~sweepmaster.runtime.training.swap.LayerPacker`: one activation
per distinct saved storage, in first-save order, parameters excluded) and dropout mode
(:class:`~sweepmaster.runtime.training.replay.RandomReplay`, whose full-minibatch masks count),
metering forward without grad, forward with grad and backward like
:mod:`~sweepmaster.runtime.planning.profile`. Op times are a roofline
(``max(FLOPs / rate, bytes / bandwidth)``) rescaled to add up to the layer's profiled forward.

:func:`profile_shards` traces the spec's own model, or the layers a :class:`TracedLayers` makes:
a fused array's stacked layers (``vmap`` over K members, inputs ``(K, b, ...)``), so that the
planner's bytes and seconds are the array's and its slots are those the array's passes save.

Shape legend: K members, b microbatch (blocks), B batch, T tokens per block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.planning.partition import _Costs, device_kind
from sweepmaster.runtime.planning.plans import JobPlan, LayerTooLargeError
from sweepmaster.runtime.planning.profile import (
    _UNLIMITED_BYTES,
    LayerProfile,
    ModelProfile,
    _best_seconds,
    _layer_key,
    _nbytes,
    build_host_model,
    device_flops_per_s,
)
from sweepmaster.runtime.training.layers import LayerStack, decompose
from sweepmaster.runtime.training.replay import JobRng, RandomReplay
from sweepmaster.runtime.training.swap import LayerEntry, LayerPacker
from sweepmaster.workload.models import causal_lm_loss
from sweepmaster.workload.spec import TrainSpec

__all__ = [
    "ActivationProfile", "LayerActivations", "ShardMemoryProfile", "TracedLayers",
    "measure_copy_bandwidth", "profile_shards", "trace_layer",
]

#: ``loss(output, ids)``: the scalar a last layer's backward starts from.
TraceLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ActivationSource = Literal["input", "created", "external"]
#: Measured host -> device copy bandwidths (bytes/s) per device name.
_BANDWIDTHS: dict[str, float] = {}


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
    row_dim: int = 0, loss: TraceLoss = causal_lm_loss,
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

    Returns:
        The profile and the layer's output without grad (the next layer's input).
    """
    rows = int(hidden.shape[row_dim])
    meter = VirtualMeter(_UNLIMITED_BYTES, "profile")
    torch_device = hidden.device
    cuda = torch_device.type == "cuda"
    index_cuda = torch_device.index if torch_device.index is not None else 0
    state = torch.cuda.get_rng_state(index_cuda) if cuda else torch.get_rng_state()
    rng = JobRng("cuda" if cuda else "cpu", state)
    mode: contextlib.AbstractContextManager[Any] = (
        fake_mode if fake_mode is not None else contextlib.nullcontext()
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer(x) if loss_ids is None else loss(layer(x), loss_ids)

    def replay() -> RandomReplay:
        return RandomReplay(rng, [], True, slice(0, rows), full_rows, False, meter)

    resident = [*layer.parameters(), *layer.buffers()]
    forked = torch.random.fork_rng(devices=[index_cuda] if cuda else [])
    with forked, rng.bound(torch_device), mode:
        with torch.no_grad():
            meter.reset_peak()
            with replay():
                output = forward(hidden)
            no_grad_peak = meter.peak_bytes
            if loss_ids is not None:
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


def measure_copy_bandwidth(device: Device, num_bytes: int = 8 << 20) -> float:
    """Host -> device copy bandwidth of a device (bytes/s), measured once per process.

    Copies of ``num_bytes`` (the size of a typical saved activation), best of 5: on a virtual
    device a fresh allocation and a copy (what a fetch does), on CUDA a pinned host -> device
    copy.
    """
    if device.name not in _BANDWIDTHS:
        torch_device = device.torch_device
        host = torch.ones(num_bytes // 4, pin_memory=torch_device.type == "cuda")
        seconds = _best_seconds(
            torch_device, lambda: torch.empty_like(host, device=torch_device).copy_(host), 5
        )
        _BANDWIDTHS[device.name] = num_bytes / seconds
    return _BANDWIDTHS[device.name]


@dataclass(frozen=True)
class ShardMemoryProfile:
    """One shard's layers on its microbatch, plus the bytes and seconds around them.

    Attributes:
        index: The shard index.
        last: Whether it is the last shard (its forward runs inside its backward task).
        num_microbatches: Microbatches per minibatch (M).
        layers: Its layers' profiles at its microbatch size.
        param_bytes: Parameters (and buffers) resident during its tasks.
        grad_bytes_after: For each layer position j, gradient bytes of the parameters that
            layers after j use (alive during j's backward in the first microbatch).
        grad_bytes: Gradient bytes of all its parameters (alive once a microbatch is done).
        update_peak_bytes: Peak of its backward task's optimizer phase (0 if it has none).
        forward_floor_bytes: Peak of its forward task's deferred clipped update (0 if none).
        loss_ids_bytes: Token ids its loss reads (last shard, index > 0), per microbatch (a
            fused array's: K members').
        between_s: Seconds of the job's tasks between its forward and its backward task.
        tail_layers: Its layers on the last, smaller microbatch (``B mod b`` rows), if any.
    """

    index: int
    last: bool
    num_microbatches: int
    layers: tuple[LayerActivations, ...]
    param_bytes: int
    grad_bytes_after: tuple[int, ...]
    grad_bytes: int
    update_peak_bytes: int
    forward_floor_bytes: int
    loss_ids_bytes: int
    between_s: float
    tail_layers: tuple[LayerActivations, ...] | None = None

    def microbatch_layers(self, mb: int) -> tuple[LayerActivations, ...]:
        """Its layers' profiles on microbatch ``mb`` (the last one may be smaller)."""
        if self.tail_layers is not None and mb == self.num_microbatches - 1:
            return self.tail_layers
        return self.layers


@dataclass(frozen=True)
class TracedLayers:
    """Layers :func:`profile_shards` traces in place of the spec's model (a fused array's).

    Attributes:
        build: ``build(fake_mode)``: the layers, each a module holding its tensors and taking
            ``(*lead, b, ...)``; made under ``fake_mode``, or with real host tensors when it is
            ``None`` (a pilot pass moves each layer to the device for its trace).
        lead: The dimensions before the rows of every layer's input, e.g. ``(K,)``.
        loss: ``loss(output, ids)``: the last layer's scalar loss, ids ``(*lead, b, T)``.
    """

    build: Callable[[FakeTensorMode | None], LayerStack]
    lead: tuple[int, ...] = ()
    loss: TraceLoss = causal_lm_loss


#: Traces measured on a device, per (device kind, minibatch rows, layer key): a pilot pass runs
#: once per kind of GPU and layer shape in a process.
_MEASURED: dict[tuple[object, ...], tuple[LayerActivations, torch.Size, torch.dtype]] = {}
_MEASURED_LOCK = threading.Lock()


def profile_shards(
    spec: TrainSpec, plan: JobPlan, profile: ModelProfile, device: Device | None = None,
    bytes_per_s: float | None = None, on_device: bool | None = None, *,
    layers: TracedLayers | None = None,
) -> tuple[ShardMemoryProfile, ...]:
    """Profile every shard of a plan for the swap/recompute planner (see the module doc).

    On a GPU the layers are traced by a pilot pass on the device (Hydra): each layer of a host
    model moves to the device for its trace, so the activations are those its kernels save;
    traces are cached per :func:`~sweepmaster.runtime.planning.partition.device_kind` and layer
    shape. Elsewhere the model is traced under ``FakeTensorMode`` (no memory, no data).

    ``device`` (default the host) gives the roofline's compute rate and, unless
    ``bytes_per_s``, its bandwidth. ``on_device``: trace on ``device`` with real tensors
    (``True``) or fake ones (``False``); ``None``: on the device when it is a GPU. ``layers``:
    trace these instead of ``spec``'s model (a fused array's stacked layers, whose ``profile``
    and ``plan`` are the stacked ones); ``profile`` gives the layers' seconds either way.

    Raises:
        ValueError: A shard's traced layers hold other parameter bytes than the plan's shard:
            ``spec`` (or ``layers``) is not what ``plan`` was made for, e.g. one LoRA member
            of a fused array whose stacked plan pads every adapter to the widest rank
            (plan it for :func:`~sweepmaster.runtime.training.fused_shards.stacked_spec`).
    """
    device = device if device is not None else Device("cpu")
    if bytes_per_s is None:
        bytes_per_s = measure_copy_bandwidth(device)
    measured = device.torch_device.type == "cuda" if on_device is None else on_device
    fake_mode = None if measured else FakeTensorMode(allow_non_fake_inputs=True)
    if layers is None:
        layers = TracedLayers(lambda mode: decompose(build_host_model(spec, mode)))
    stack = layers.build(fake_mode)
    stack.model.train()
    _check_param_bytes(stack, plan)
    tracer = _Tracer(stack, spec, profile, fake_mode, device_flops_per_s(device), bytes_per_s,
                     lead=layers.lead, loss=layers.loss)
    if measured:
        tracer.torch_device = device.torch_device
        tracer.cache_key = (device_kind(device), spec.batch_size)
    block_size = int(spec.train_data.shape[1])
    hidden_by_rows: dict[int, list[torch.Tensor]] = {}

    def shard_layers(start: int, stop: int, rows: int) -> tuple[LayerActivations, ...]:
        if rows not in hidden_by_rows:
            hidden_by_rows[rows] = [tracer.zeros((*layers.lead, rows, block_size), torch.int64)]
        hiddens = hidden_by_rows[rows]
        traced = []
        for index in range(start, stop):
            while len(hiddens) <= index:  # inputs of earlier layers, propagated without grad
                hiddens.append(tracer.trace(len(hiddens) - 1, hiddens)[1])
            layer, output = tracer.trace(index, hiddens)
            if len(hiddens) == index + 1 and index + 1 < len(tracer.stack):
                hiddens.append(output)
            traced.append(layer)
        return tuple(traced)

    shards = []
    for shard in plan.shards:
        rows = shard.microbatch_size
        shard_traces = shard_layers(shard.start, shard.stop, rows)
        tail_rows = spec.batch_size - (plan.num_microbatches(shard.index) - 1) * rows
        tail = None
        if tail_rows != rows:
            tail = shard_layers(shard.start, shard.stop, tail_rows)
            if [len(t.activations) for t in tail] != [
                    len(t.activations) for t in shard_traces]:
                tail = None  # saves differ with the rows: the full microbatch bounds it
        shard_profile = _shard_profile(spec, plan, profile, shard.index, shard_traces,
                                       math.prod(layers.lead))
        shards.append(dataclasses.replace(shard_profile, tail_layers=tail))
    return tuple(shards)


def _check_param_bytes(stack: LayerStack, plan: JobPlan) -> None:
    """Raise when a shard's layers hold other parameter bytes than the plan says (see above).

    The traced activations are those of these layers: traced from another spec, they are not
    what the job that runs ``plan`` saves (its swap volume would differ from the plan's).
    """
    for shard in plan.shards:
        tensors = [p for layer in stack.layers[shard.start : shard.stop]
                   for p in layer.parameters()]
        params: dict[int, tuple[torch.UntypedStorage, int]] = {}  # tied ones once
        for param in tensors:
            storage = param.untyped_storage()
            params.setdefault(id(storage), (storage, _nbytes(param)))
        num_bytes = sum(n for _, n in params.values())
        if num_bytes != shard.param_bytes:
            raise ValueError(
                f"shard {shard.index} ({shard.layer_names[0]}...) holds {num_bytes} parameter "
                f"bytes, its plan {shard.param_bytes}: the memory plan's spec is not the one "
                "its job plan was made for (a fused array's is stacked_spec of its members)"
            )


@dataclass
class _Tracer:
    """Traces a stack's layers, fake or for real on ``torch_device`` (then cached, per key)."""

    stack: LayerStack
    spec: TrainSpec
    profile: ModelProfile
    fake_mode: FakeTensorMode | None
    flops_per_s: float
    bytes_per_s: float
    torch_device: torch.device | None = None
    cache_key: tuple[object, ...] | None = None
    lead: tuple[int, ...] = ()
    loss: TraceLoss = causal_lm_loss
    memo: dict[tuple[object, ...], tuple[LayerActivations, torch.Size, torch.dtype]] = (
        dataclasses.field(default_factory=dict)
    )

    def zeros(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Zeros of ``shape``: fake, or on the host."""
        if self.fake_mode is None:
            return torch.zeros(shape, dtype=dtype)
        with torch.random.fork_rng(devices=[]), self.fake_mode:
            return torch.empty(shape, dtype=dtype)

    def trace(
        self, index: int, hiddens: list[torch.Tensor]
    ) -> tuple[LayerActivations, torch.Tensor]:
        """Trace layer ``index`` on ``hiddens[index]``; identical layers are traced once."""
        layer, hidden, name = self.stack.layers[index], hiddens[index], self.stack.names[index]
        is_last = index == len(self.stack) - 1
        key = _layer_key(layer, layer.parameters(), hidden, is_last)
        timing = self.profile.layer(index, int(hidden.shape[len(self.lead)]))
        memo = self.memo
        if self.cache_key is not None:
            key = (*self.cache_key, *key)
            memo = _MEASURED
        with _MEASURED_LOCK if memo is _MEASURED else contextlib.nullcontext():
            if key not in memo:
                loss_ids = self.zeros(tuple(hiddens[0].shape), torch.int64) if is_last else None
                memo[key] = self._trace_layer(layer, hidden, index, name, loss_ids, timing)
            traced, shape, dtype = memo[key]
        traced = dataclasses.replace(traced, index=index, name=name, forward_s=timing.forward_s,
                                     backward_s=timing.backward_s)
        return traced, self.zeros(shape, dtype)

    def _trace_layer(
        self, layer: nn.Module, hidden: torch.Tensor, index: int, name: str,
        loss_ids: torch.Tensor | None, timing: LayerProfile,
    ) -> tuple[LayerActivations, torch.Size, torch.dtype]:
        device = self.torch_device
        start_bytes = 0
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                start_bytes = torch.cuda.memory_allocated(device)
            if device is not None:
                layer.to(device)
                hidden = hidden.to(device)
                loss_ids = loss_ids.to(device) if loss_ids is not None else None
            traced, output = trace_layer(
                layer, hidden, index=index, name=name, full_rows=self.spec.batch_size,
                forward_s=timing.forward_s, backward_s=timing.backward_s, loss_ids=loss_ids,
                fake_mode=self.fake_mode, flops_per_s=self.flops_per_s,
                bytes_per_s=self.bytes_per_s, row_dim=len(self.lead), loss=self.loss,
            )
        except torch.OutOfMemoryError as error:
            if device is None or device.type != "cuda":
                raise
            peak = torch.cuda.max_memory_allocated(device) - start_bytes
            budget = int(torch.cuda.get_device_properties(device).total_memory)
            budget = int(budget * torch.cuda.get_per_process_memory_fraction(device))
            raise LayerTooLargeError(
                f"{name} (microbatch {int(hidden.shape[len(self.lead)])})", peak,
                budget - start_bytes,
                measured_on=f"{device} (pilot pass)",
            ) from error
        finally:
            if device is not None:
                layer.to("cpu")
        return traced, output.shape, output.dtype


def _shard_profile(
    spec: TrainSpec, plan: JobPlan, profile: ModelProfile, index: int,
    layers: tuple[LayerActivations, ...], num_members: int = 1,
) -> ShardMemoryProfile:
    shard = plan.shards[index]
    start, stop = shard.start, shard.stop
    costs = _Costs(profile, spec.optimizer)
    clip = spec.optimizer.grad_clip is not None and start > 0
    last = index == len(plan.shards) - 1
    deferred = costs.deferred_update_peak(start, stop)
    between = sum(
        (0.0 if later.index == len(plan.shards) - 1 else later.forward_s) + later.backward_s
        for later in plan.shards[index + 1 :]
    )
    block_size = int(spec.train_data.shape[1])
    return ShardMemoryProfile(
        index=index, last=last, num_microbatches=plan.num_microbatches(index), layers=layers,
        param_bytes=shard.param_bytes,
        grad_bytes_after=tuple(costs.grad_bytes(j + 1, stop) for j in range(start, stop)),
        grad_bytes=costs.grad_bytes(start, stop),
        update_peak_bytes=(deferred if last else 0) if clip else costs.update_peak(start, stop),
        forward_floor_bytes=deferred if clip and not last else 0,
        loss_ids_bytes=(num_members * shard.microbatch_size * block_size * 8
                        if last and index > 0 else 0),
        between_s=between,
    )
