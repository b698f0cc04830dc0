"""Shard profiles for the swap/recompute planner: every layer of a plan's shards, traced.

:func:`profile_shards` traces (:func:`~sweepmaster.runtime.planning.memtrace.trace_layer`) the
layers of each shard of a :class:`~sweepmaster.runtime.planning.plans.JobPlan` on the shard's
microbatch, and adds what the planner needs around them (:class:`ShardMemoryProfile`: resident
parameters, gradients, update peaks, the seconds between a shard's forward and backward tasks).
It traces the spec's own model, or the layers a :class:`TracedLayers` makes: a fused array's
stacked layers (``vmap`` over K members, inputs ``(K, b, ...)``), so that the planner's bytes and
seconds are the array's and its slots are those the array's passes save.

Shape legend: K members, b microbatch (blocks), B batch, T tokens per block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.planning.memtrace import LayerActivations, TraceLoss, trace_layer
from sweepmaster.runtime.planning.partition import device_kind
from sweepmaster.runtime.planning.plans import JobPlan, LayerTooLargeError
from sweepmaster.runtime.planning.profile import (
    _UNLIMITED_BYTES,
    LayerProfile,
    ModelProfile,
    _layer_key,
    _nbytes,
    build_host_model,
)
from sweepmaster.runtime.planning.shard_costs import _Costs
from sweepmaster.runtime.planning.timing import device_flops_per_s, measure_copy_bandwidth
from sweepmaster.runtime.training.layers import LayerStack, decompose
from sweepmaster.workload.causal_lm import causal_lm_loss
from sweepmaster.workload.spec import TrainSpec

__all__ = ["ShardMemoryProfile", "TracedLayers", "profile_shards"]


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
        with self.fake_mode:  # draws nothing: no generator to fork
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
        meter = VirtualMeter(_UNLIMITED_BYTES, "pilot pass")  # its own: no device statistics
        start_bytes = 0
        try:
            if device is not None and device.type == "cuda":
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
                meter=meter,
            )
        except torch.OutOfMemoryError as error:
            if device is None or device.type != "cuda":
                raise
            peak = meter.peak_bytes + _nbytes(hidden)
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
