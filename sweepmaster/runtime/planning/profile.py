"""Per-layer profile of a job: time, parameter / gradient / activation bytes, peak working bytes.

The partitioner (:mod:`~sweepmaster.runtime.planning.partition`) cuts shards from these numbers.
Every layer of the :class:`~sweepmaster.runtime.training.layers.LayerStack` runs alone on one
microbatch ``(b, T)`` (the last one with the loss): forward without grad (a forward shard task),
forward with grad and backward (a backward shard task's recompute), while a
:class:`~sweepmaster.runtime.devices.meter.VirtualMeter` counts the storage bytes of each phase.

Memory comes from a pass under ``FakeTensorMode`` (shapes and dtypes, no data: the kernels, so the
bytes, of a real pass; GPT-2 XL profiles in about a second anywhere), with the attention kernel
and optimizer path the target device takes (CUDA's fused attention,
:mod:`~sweepmaster.runtime.planning.attention`; foreach optimizer steps). Time comes from FLOPs
(``torch.utils.flop_counter``) at the device's calibrated rate
(:mod:`~sweepmaster.runtime.planning.timing`) or, with ``measure=True``, from a real pass of each
layer on the device. The plain footprint (whole model and batch, one step) is a fake forward and
backward plus the optimizer's state and step transient, analytically (a fake optimizer step
cannot run: it reads the step counter). Frozen parameters (a LoRA base) are held
with their layers but get no gradient and no optimizer state.

Shape legend: b microbatch (blocks), B batch, T tokens per block.

Example:
    >>> profile = profile_model(spec, microbatch_size=2)  # doctest: +SKIP
    >>> [layer.name for layer in profile.layers]  # doctest: +SKIP
    ['embed', 'block.0', 'block.1', 'head']
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.planning.attention import attention_kernel
from sweepmaster.runtime.planning.json_records import record_from_json, record_to_json
from sweepmaster.runtime.planning.timing import (
    _FlopCount,
    _on_device,
    _synchronize,
    device_flops_per_s,
)
from sweepmaster.runtime.training.layers import LayerStack, decompose
from sweepmaster.runtime.training.optimizers import optimizer_entry
from sweepmaster.runtime.training.plain import HOST_RNG_LOCK
from sweepmaster.workload.adapters import apply_adapter
from sweepmaster.workload.architecture import architecture_key
from sweepmaster.workload.causal_lm import build_model, causal_lm_loss, lm_logits, torch_dtype
from sweepmaster.workload.spec import OptimizerSpec, TrainSpec

__all__ = [
    "LayerProfile", "ModelProfile", "build_fake_model", "build_host_model",
    "estimate_plain_bytes", "foreach_by_default", "optimizer_state_bytes", "optimizer_step_bytes",
    "plain_footprint_bytes", "profile_model",
]

#: A meter budget no profile reaches.
_UNLIMITED_BYTES = 1 << 62
#: Estimated profiles made in this process, per (architecture key, microbatch, device name): a
#: profile of fake tensors timed at a device's calibrated rate depends on nothing else.
_PROFILES: dict[tuple[str, int, str], ModelProfile] = {}
_PROFILES_LOCK = threading.Lock()


@dataclass(frozen=True)
class LayerProfile:
    """One layer on one microbatch ``(b, T)``; bytes exclude parameters unless named so.

    Attributes:
        name: The layer name (``LayerStack.names``).
        param_names: Names of the trainable parameters it uses (tied ones in every such layer).
        input_bytes: Its input (bytes; int64 ids for the first layer), ``output_bytes`` its
            output (the logits for the last layer).
        forward_peak_bytes: Peak bytes a forward without grad creates (output included).
        saved_bytes: Bytes a forward with grad leaves alive: output plus what autograd saved.
        train_forward_peak_bytes: Peak bytes a forward with grad creates.
        backward_peak_bytes: Peak bytes alive during its backward, counted from the start of the
            forward: saved activations, fresh parameter gradients, the input's gradient.
        forward_s: Seconds of a forward (with grad), ``backward_s`` of a backward.
        frozen_param_names: Names of the frozen parameters it uses (e.g. a LoRA base).
    """

    name: str
    param_names: tuple[str, ...]
    input_bytes: int
    output_bytes: int
    forward_peak_bytes: int
    saved_bytes: int
    train_forward_peak_bytes: int
    backward_peak_bytes: int
    forward_s: float
    backward_s: float
    frozen_param_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelProfile:
    """Every layer of a job, plus what plain training of the whole model needs.

    Attributes:
        layers: One profile per layer, in order, at ``microbatch_size`` blocks.
        unit_layers: The same at 1 block; :meth:`layer` interpolates between the two.
        param_bytes: Bytes of each trainable parameter by name (tied parameters once).
        microbatch_size: b, the largest blocks per layer pass the plan may use.
        batch_size: B, the blocks per optimizer step.
        block_size: T, tokens per block.
        plain_activation_peak_bytes: Peak bytes of a plain forward and backward of the whole
            batch above the parameters (activations, gradients; no optimizer state).
        source: ``"estimated"`` (FLOP-based times) or ``"measured"`` (timed on a device).
        frozen_param_bytes: Bytes of each frozen parameter by name (tied parameters once).
        foreach_optimizer: Whether the optimizer steps take torch's multi-tensor (foreach)
            path on the device profiled for (:func:`foreach_by_default`: CUDA), which changes
            its scratch (:func:`optimizer_step_bytes`).
    """

    layers: tuple[LayerProfile, ...]
    unit_layers: tuple[LayerProfile, ...]
    param_bytes: dict[str, int]
    microbatch_size: int
    batch_size: int
    block_size: int
    plain_activation_peak_bytes: int
    source: str
    frozen_param_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    foreach_optimizer: bool = False

    @property
    def total_param_bytes(self) -> int:
        """Bytes of all parameters, trainable and frozen (tied ones once)."""
        return sum(self.param_bytes.values()) + sum(self.frozen_param_bytes.values())

    def layer(self, index: int, rows: int) -> LayerProfile:
        """Layer ``index`` on ``rows`` blocks: bytes and seconds linear in the rows.

        Exact for a transformer layer (every activation has a batch dimension, apart from a few
        batch-independent ones such as position ids, which the 1-block profile carries).
        """
        big, unit = self.layers[index], self.unit_layers[index]
        if rows == self.microbatch_size:
            return big
        if rows == 1 or self.microbatch_size == 1:
            return unit
        fraction = (rows - 1) / (self.microbatch_size - 1)
        values: dict[str, Any] = {}
        for name, value in asdict(big).items():
            low = getattr(unit, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                values[name] = value
            elif isinstance(value, int):
                values[name] = math.ceil(low + (value - low) * fraction)
            else:
                values[name] = low + (value - low) * fraction
        return LayerProfile(**values)

    def to_json(self) -> str:
        """Serialize to a JSON string (see :meth:`from_json`)."""
        return record_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Inverse of :meth:`to_json` (:func:`~.json_records.record_from_json`)."""
        return record_from_json(cls, text)


def optimizer_state_bytes(param_bytes: int, spec: OptimizerSpec) -> int:
    """Bytes of optimizer state a parameter of ``param_bytes`` bytes gets.

    One parameter's size per state tensor of the optimizer's entry in the table
    (:mod:`~sweepmaster.runtime.training.optimizers`): AdamW ``exp_avg`` and ``exp_avg_sq``
    (2x), SGD a momentum buffer (1x) when ``momentum > 0`` (else nothing), Lion ``exp_avg``
    (1x). AdamW's step counter is a 0-dim host tensor on every device (``torch.optim.AdamW``
    without ``capturable``), never promoted, so it is not counted.
    """
    return optimizer_entry(spec.name).state_bytes(param_bytes, spec)


def foreach_by_default(device_type: str) -> bool:
    """Whether ``torch.optim.AdamW`` / ``SGD`` step by their foreach path on ``device_type``.

    torch's default choice (``torch.optim.optimizer._default_to_fused_or_foreach``): foreach
    where its kernels are supported (CUDA), the per-parameter for-loop elsewhere (the CPU).
    """
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return device_type in _get_foreach_kernels_supported_devices()


def optimizer_step_bytes(param_bytes: Iterable[int], foreach: bool,
                         optimizer: OptimizerSpec | None = None) -> int:
    """Scratch bytes an optimizer step allocates above parameters, gradients and state.

    Measured with the meter (``tests/sweep/test_plan.py``): the foreach path makes one temporary
    per parameter at once (AdamW's ``_foreach_sqrt`` of ``exp_avg_sq``, SGD's gradients plus weight
    decay), one copy of them all; the for-loop path makes two temporaries of one parameter at a
    time (the square root and its quotient), two of the largest.

    Args:
        param_bytes: Bytes of each parameter the step updates.
        foreach: Whether it takes the foreach path (:func:`foreach_by_default`).
        optimizer: The optimizer, whose entry in the table says its scratch (Lion's fused
            step: one temporary per parameter at once); ``None``: AdamW's or SGD's.

    Returns:
        The bytes (0 for no parameters).
    """
    return optimizer_entry("adamw" if optimizer is None else optimizer.name).step_scratch(
        list(param_bytes), foreach)


def build_fake_model(spec: TrainSpec, fake_mode: FakeTensorMode) -> nn.Module:
    """Build the job's model under ``fake_mode``: real shapes and dtypes, no memory.

    Raises:
        ValueError: The model source cannot be built without data.
    """
    return build_host_model(spec, fake_mode)


def build_host_model(spec: TrainSpec, fake_mode: FakeTensorMode | None = None) -> nn.Module:
    """Build the job's model on the host: randomly initialized, or fake under ``fake_mode``.

    A path / hub name is built from its config (no weights are read). The host's generator is
    forked, so jobs drawing from it are not disturbed.

    Raises:
        ValueError: The model source cannot be built without data.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    mode: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext() if fake_mode is None else fake_mode
    )

    source: Any = spec.model
    if isinstance(source, (str, os.PathLike)):
        source = AutoConfig.from_pretrained(str(source), local_files_only=os.path.isdir(source))
    dtype = torch_dtype(spec.dtype)
    with forked_host_rng():
        with mode:
            if isinstance(source, PretrainedConfig):  # a copy: from_config writes into it
                model = AutoModelForCausalLM.from_config(copy.deepcopy(source))
            else:
                model = source()
        # A LoRA adapter is built real, then faked: PEFT moves its new layers with ``.to()``,
        # which would swap fake parameters, and FakeTensorMode refuses that (as it refuses
        # ``model.to(dtype)``).
        model = apply_adapter(model, spec.peft)
        if fake_mode is not None:
            for module in model.modules():
                for name, param in module.named_parameters(recurse=False):
                    if not isinstance(param, FakeTensor):
                        fake = nn.Parameter(fake_mode.from_tensor(param.detach()),
                                            param.requires_grad)
                        setattr(module, name, fake)
        with mode:
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(dtype)
    return model


def plain_footprint_bytes(
    param_bytes: dict[str, int], activation_peak_bytes: int, optimizer: OptimizerSpec,
    frozen_bytes: int = 0, foreach: bool = False,
) -> int:
    """Peak bytes of plain training on one device (PyTorch's usual accounting).

    ``frozen + params + optimizer state + max(activation_peak_bytes, gradients + the step's
    scratch)``, with ``param_bytes`` the bytes of each trainable parameter,
    ``activation_peak_bytes`` the peak of a forward and backward above the parameters and the
    scratch :func:`optimizer_step_bytes` (``foreach``: its multi-tensor path).
    """
    trainable = sum(param_bytes.values())
    state = sum(optimizer_state_bytes(n, optimizer) for n in param_bytes.values())
    step = optimizer_step_bytes(param_bytes.values(), foreach, optimizer)
    return frozen_bytes + trainable + state + max(activation_peak_bytes, trainable + step)


def estimate_plain_bytes(spec: TrainSpec, device_type: str = "cpu") -> int:
    """Peak bytes of ``train_plain(spec)`` on one device, from one fake step (no allocation).

    Cheaper than :func:`profile_model` (one pass, no decomposition into layers). The pass takes
    the attention kernel and the optimizer path of ``device_type``
    (:func:`~sweepmaster.runtime.planning.attention.attention_kernel`,
    :func:`foreach_by_default`).

    Raises:
        Exception: Whatever building the model under ``FakeTensorMode`` raises.
    """
    model, fake_mode, param_bytes, frozen_bytes = _fake_model(spec)
    peak = _plain_activation_peak(model, fake_mode, spec, device_type)
    return plain_footprint_bytes(param_bytes, peak, spec.optimizer, sum(frozen_bytes.values()),
                                 foreach_by_default(device_type))


def _fake_model(
    spec: TrainSpec,
) -> tuple[nn.Module, FakeTensorMode, dict[str, int], dict[str, int]]:
    """The job's model in training mode under a new fake mode, with its parameters' bytes.

    The bytes are by name, trainable and frozen apart (tied parameters once).
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(spec, fake_mode)
    model.train()
    named = list(model.named_parameters())
    trainable = {name: _nbytes(p) for name, p in named if p.requires_grad}
    return model, fake_mode, trainable, {n: _nbytes(p) for n, p in named if not p.requires_grad}


def profile_model(
    spec: TrainSpec, microbatch_size: int | None = None, *, measure: bool = False,
    device: Device | None = None,
) -> ModelProfile:
    """Profile every layer of a job's model on one microbatch (see the module doc).

    Args:
        spec: The job (model, dtype, block size ``T`` from ``train_data``, batch size).
        microbatch_size: b; default ``spec.batch_size``.
        measure: Time each layer with a real pass on ``device`` (needs the model to fit in host
            memory and one layer to fit the device); else times come from FLOPs, and the
            profile is made once per process for each architecture key, ``b`` and device
            name (later calls return the same object: treat it as read-only).
        device: Where times are measured or calibrated; default the host CPU.

    Raises:
        ValueError: ``microbatch_size`` is not in ``[1, batch_size]``.
        UnsupportedModelError: The model cannot be decomposed into layers.
    """
    batch_size = spec.batch_size
    microbatch_size = microbatch_size or batch_size
    if not 1 <= microbatch_size <= batch_size:
        raise ValueError(f"microbatch_size must be in [1, {batch_size}], got {microbatch_size}")
    block_size = int(spec.train_data.shape[1])
    device = device if device is not None else Device("cpu")
    key = None if measure else _profile_key(spec, microbatch_size, device)
    if key is not None:
        with _PROFILES_LOCK:
            cached = _PROFILES.get(key)
        if cached is not None:
            return cached
    model, fake_mode, param_bytes, frozen_param_bytes = _fake_model(spec)
    stack = decompose(model)
    names = stack.parameter_names()
    rate = device_flops_per_s(device) if not measure else 0.0
    device_type = device.torch_device.type
    with forked_host_rng(), fake_mode, attention_kernel(device_type):
        input_ids_bT = torch.zeros((microbatch_size, block_size), dtype=torch.int64)
        layers = _profile_layers(stack, input_ids_bT, names, rate)
        unit_layers = layers
        if microbatch_size > 1:
            unit_layers = _profile_layers(stack, input_ids_bT[:1], names, rate)
    plain_peak = _plain_activation_peak(model, fake_mode, spec, device_type)
    if measure:  # seconds of the real pass; 1 block: proportional
        times = _measure_times(spec, microbatch_size, device)
        layers, unit_layers = (
            [
                dataclasses.replace(layer, forward_s=fwd / rows, backward_s=bwd / rows)
                for layer, (fwd, bwd) in zip(profiles, times, strict=True)
            ]
            for profiles, rows in ((layers, 1), (unit_layers, microbatch_size))
        )
    profile = ModelProfile(
        layers=tuple(layers), unit_layers=tuple(unit_layers), param_bytes=param_bytes,
        microbatch_size=microbatch_size, batch_size=batch_size, block_size=block_size,
        plain_activation_peak_bytes=plain_peak, source="measured" if measure else "estimated",
        frozen_param_bytes=frozen_param_bytes,
        foreach_optimizer=foreach_by_default(device_type),
    )
    if key is not None:
        with _PROFILES_LOCK:
            profile = _PROFILES.setdefault(key, profile)
    return profile


def _profile_key(
    spec: TrainSpec, microbatch_size: int, device: Device
) -> tuple[str, int, str] | None:
    """Where an estimated profile of ``spec`` is kept in this process.

    ``None`` for a model without a stable identity (a factory without an architecture key): it
    is profiled every time.
    """
    try:
        return architecture_key(spec), microbatch_size, device.name
    except ValueError:
        return None


def _profile_layers(
    stack: LayerStack, input_ids_bT: torch.Tensor, names: dict[int, str], rate: float
) -> list[LayerProfile]:
    """Profile each layer alone; structurally identical layers (e.g. blocks) are run once."""
    meter = VirtualMeter(_UNLIMITED_BYTES, "profile")
    profiles = []
    hidden: torch.Tensor = input_ids_bT
    last = len(stack) - 1
    memo: dict[tuple[object, ...], tuple[LayerProfile, torch.Size, torch.dtype]] = {}
    for index, layer in enumerate(stack.layers):
        params = stack.layer_parameters(index)
        key = _layer_key(layer, params, hidden, index == last)
        if key not in memo:
            flops, output = _profile_layer(layer, hidden, input_ids_bT, index == last, meter)
            profile = dataclasses.replace(flops, forward_s=flops.forward_s / rate if rate else 0.0,
                                          backward_s=flops.backward_s / rate if rate else 0.0)
            memo[key] = (profile, output.shape, output.dtype)
            next_hidden = output
        else:
            profile, shape, dtype = memo[key]
            next_hidden = torch.empty(shape, dtype=dtype)
        frozen = dict.fromkeys(names[id(p)] for p in layer.parameters() if not p.requires_grad)
        profiles.append(dataclasses.replace(
            profile, name=stack.names[index], param_names=tuple(names[id(p)] for p in params),
            frozen_param_names=tuple(frozen)))
        hidden = next_hidden
    return profiles


def _layer_key(
    layer: nn.Module, params: Iterable[torch.Tensor], hidden: torch.Tensor, is_last: bool
) -> tuple[object, ...]:
    """What makes two layers' profiles equal: structure, parameter shapes, input, loss."""
    shapes = tuple((p.shape, p.dtype) for p in params)
    return (type(layer).__qualname__, repr(layer), shapes, hidden.shape, hidden.dtype, is_last)


def _profile_layer(
    layer: nn.Module, hidden: torch.Tensor, input_ids_bT: torch.Tensor, is_last: bool,
    meter: VirtualMeter,
) -> tuple[LayerProfile, torch.Tensor]:
    """Bytes (and FLOPs, in the seconds fields) of one layer; also its no-grad output."""
    forward = _loss_forward(layer, input_ids_bT) if is_last else layer
    with torch.no_grad():
        base = meter.live_bytes
        meter.reset_peak()
        with meter.metering():
            output = forward(hidden)
        forward_peak = meter.peak_bytes - base
        if is_last:
            output = layer(hidden)
    x = hidden.detach().requires_grad_(hidden.is_floating_point())
    base = meter.live_bytes
    meter.reset_peak()
    with meter.metering(), _FlopCount() as forward_flops:
        train_output = forward(x)
    saved = meter.live_bytes - base
    train_forward_peak = meter.peak_bytes - base
    grad_output = None if is_last else torch.ones_like(train_output)
    with meter.metering(), _FlopCount() as backward_flops:
        if train_output.requires_grad:  # else a frozen first layer: it has no backward
            train_output.backward(grad_output)
    backward_peak = meter.peak_bytes - base
    del train_output, x
    for param in layer.parameters():
        param.grad = None
    profile = LayerProfile(
        name="", param_names=(), input_bytes=_nbytes(hidden), output_bytes=_nbytes(output),
        forward_peak_bytes=forward_peak, saved_bytes=saved,
        train_forward_peak_bytes=train_forward_peak, backward_peak_bytes=backward_peak,
        forward_s=float(forward_flops.total), backward_s=float(backward_flops.total),
    )
    return profile, output.detach()


def _plain_activation_peak(model: nn.Module, fake_mode: FakeTensorMode, spec: TrainSpec,
                           device_type: str) -> int:
    """Peak bytes of a fake forward and backward of a whole batch, above the parameters."""
    meter = VirtualMeter(_UNLIMITED_BYTES, "profile")
    with forked_host_rng(), fake_mode, attention_kernel(device_type):
        input_ids_BT = torch.zeros((spec.batch_size, spec.train_data.shape[1]), dtype=torch.int64)
        with meter.metering():
            loss = causal_lm_loss(lm_logits(model, input_ids_BT), input_ids_BT)
            loss.backward()
    del loss
    for param in model.parameters():
        param.grad = None
    return meter.peak_bytes


def _loss_forward(layer: nn.Module, input_ids_bT: torch.Tensor) -> Callable[..., torch.Tensor]:
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(layer(hidden), input_ids_bT)

    return forward


def _measure_times(spec: TrainSpec, rows: int, device: Device) -> list[tuple[float, float]]:
    """Wall seconds of forward (with grad) and backward of each layer, really run on device."""
    torch_device = device.torch_device
    with forked_host_rng():
        model = build_model(spec.model, spec.dtype, spec.peft)
        model.train()
        stack = decompose(model)
        input_ids_bT = spec.train_data[:rows].to(torch_device)
        hidden: torch.Tensor = input_ids_bT
        last = len(stack) - 1
        times = []
        for index, layer in enumerate(stack.layers):
            with _on_device(layer.parameters(), torch_device):
                forward = _loss_forward(layer, input_ids_bT) if index == last else layer
                x = hidden.detach().requires_grad_(hidden.is_floating_point())
                _synchronize(torch_device)
                start = time.perf_counter()
                output = forward(x)
                _synchronize(torch_device)
                middle = time.perf_counter()
                if output.requires_grad:  # else a frozen first layer: no backward
                    output.backward(None if index == last else torch.ones_like(output))
                _synchronize(torch_device)
                times.append((middle - start, time.perf_counter() - middle))
                if index < last:
                    with torch.no_grad():
                        hidden = layer(hidden)
    return times


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def forked_host_rng() -> Iterator[None]:
    """Fork the CPU generator for a profile, holding the lock jobs on the CPU draw under.

    Restoring the generator afterwards would rewind the stream of a CPU job drawing meanwhile.
    """
    with HOST_RNG_LOCK, torch.random.fork_rng(devices=[]):
        yield
