"""Members of fused arrays: how each is built, padded, seeded and kept track of.

What :class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob` (a fused array: one
stacked shard when it fits its device, else spilled) and its stacked layers
(:mod:`~sweepmaster.runtime.training.fused_shards`) know about the K members they stack (HFTA,
Wang et al. MLSys 2021; mu-TWO, Purandare et al. MLSys 2023; multi-LoRA over one base: mLoRA /
ASPEN, VLDB 2025):

* **building**: :func:`build_member` builds a member exactly as plain training does (seeded init,
  its dropout generator continuing that stream), from a base built once for members of one
  source, dtype and seed (:class:`SharedBases`); :func:`load_member` continues it from a
  checkpoint and gives its data order; :func:`meta_template` is the parameterless module the
  vmapped forward runs (ties intact);
* **LoRA padding**: adapters of ranks ``r_k`` are zero-padded to the largest rank R
  (:func:`padded_adapter`, :func:`zero_pad`, :func:`unpad`), each member scaled by its own
  ``alpha / r`` (:func:`lora_scale`, :func:`lora_scaling`);
* **dropout per member**: :class:`DropoutReplay` records where the forward draws dropout
  (:class:`NoiseSite`) and replays noise drawn from each member's generator
  (:func:`member_noise`), ``F.scaled_dot_product_attention``'s dropout included (as ATen's math
  attention); :class:`SeededOpDetector` finds any other random op, which refuses to fuse;
* **bookkeeping**: :class:`MemberRun` keeps what ``train_plain`` keeps locally per trial
  (metrics, throughput window, start, step and evaluation events, pruning, training seconds,
  resume, its error, its result), for a single job's one trial and a fused array's K members
  alike; :data:`MemberEndHook` hears a member leave, :data:`RefillHook` offers members to join.

Shape legend: K members, B batch, T tokens per block, R the largest LoRA rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PretrainedConfig

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.execution.events import (
    EvalEvent,
    StartEvent,
    StepEvent,
    TrainCallbacks,
)
from sweepmaster.runtime.training.checkpoint import (
    TrainingState,
    job_key,
    load_latest,
    restore_rng,
)
from sweepmaster.runtime.training.plain import (
    _THROUGHPUT_WINDOW_STEPS,
    HOST_RNG_LOCK,
    minibatch_indices,
)
from sweepmaster.workload.architecture import model_config
from sweepmaster.workload.models import build_base, build_model, finish_model, save_weights
from sweepmaster.workload.spec import LoraSpec, MetricPoint, TrainResult, TrainSpec

__all__ = [
    "DropoutReplay",
    "Member",
    "MemberEndHook",
    "MemberRun",
    "MemberSource",
    "NoiseSite",
    "RefillHook",
    "SeededOpDetector",
    "SharedBases",
    "build_member",
    "load_member",
    "lora_layers",
    "lora_scale",
    "lora_scaling",
    "marking_adapter_dropout",
    "member_noise",
    "meta_template",
    "padded_adapter",
    "same_tensors",
    "tied_aliases",
    "unpad",
    "zero_pad",
]


@dataclass
class Member:
    """A member's own data order, dropout generator and step count, as it was built."""

    spec: TrainSpec
    batches: Iterator[tuple[int, Tensor]]
    generator: torch.Generator
    step: int = 0  # optimizer steps done, earlier runs' included
    #: Trainable parameter name -> the member's own shape (a LoRA adapter before padding).
    shapes: dict[str, torch.Size] = field(default_factory=dict)


@dataclass(frozen=True)
class NoiseSite:
    """One dropout draw of a member's forward: what ``torch.dropout`` draws there."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    p: float
    #: A LoRA adapter's dropout: each member draws it with its own ``peft.dropout``.
    adapter: bool = False


class MemberSource(Protocol):
    """Where a leaving member's weights come from (a fused array)."""

    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s weights by name, unstacked (CPU)."""
        ...

    def member_module(self, index: int) -> nn.Module:
        """Member ``index`` as a module of its own (to save in its model's format)."""
        ...


@dataclass(eq=False)
class MemberRun:
    """Bookkeeping of one trial trained by a job (what ``train_plain`` keeps locally).

    One implementation for every K: a single job
    (:class:`~sweepmaster.runtime.training.spill.SpilledJob`, K = 1) keeps its trial in one, a
    fused array (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`) one per
    member; :class:`~sweepmaster.runtime.training.chain.ShardChain` drives them over its
    ``runs``. A callback that raises, a non-finite loss or a failed checkpoint sets
    :attr:`error`: a fused array's member fails alone, a single job raises it
    (:attr:`~sweepmaster.runtime.training.bookkeeping.TrialBookkeeping.members_fail_alone`).
    """

    index: int
    spec: TrainSpec
    callbacks: TrainCallbacks
    metrics: list[MetricPoint] = field(default_factory=list)
    window: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=_THROUGHPUT_WINDOW_STEPS)
    )
    pruned: bool = False
    error: Exception | None = None
    result: TrainResult | None = None
    step: int = 0  # optimizer steps done (earlier runs' included)
    key: str = ""  # job_key of the member when it has a state_dir
    num_parameters: int = 0  # its trainable parameters (unpadded), for ``on_start``
    earlier_s: float = 0.0  # training seconds of earlier runs (resumed)
    started: float | None = None  # perf_counter when it started (or joined) this run
    save_s_before: float = 0.0  # the job's checkpoint-writing seconds before it started

    @property
    def eval_data(self) -> Tensor | None:
        """The member's evaluation blocks ``(M, T)``, at most ``eval_max_blocks``; or None."""
        data = self.spec.eval_data
        if data is not None and self.spec.eval_max_blocks is not None:
            data = data[: self.spec.eval_max_blocks]
        return data

    def latest_state(self, device_type: str) -> TrainingState | None:
        """The newest intact checkpoint of the member's job in its ``state_dir``, if any.

        Sets :attr:`key` (:func:`~sweepmaster.runtime.training.checkpoint.job_key`; empty
        without a ``state_dir``).

        Raises:
            As :func:`~sweepmaster.runtime.training.checkpoint.load_latest`.
        """
        self.key = job_key(self.spec) if self.spec.state_dir is not None else ""
        return load_latest(self.spec.state_dir, self.key, device_type) if self.key else None

    def resume(self, state: TrainingState) -> None:
        """Continue the bookkeeping of ``state``: its step, metrics and training seconds."""
        self.step, self.earlier_s, self.metrics = state.step, state.elapsed_s, list(state.metrics)

    def call(self, method: Callable[[Any], Any], event: Any) -> Any:
        """A callback of this member; what it raises is kept in :attr:`error`."""
        if self.error is not None:
            return None
        try:
            return method(event)
        except Exception as exc:
            self.error = exc
            return None

    def begin(self, device_name: str, save_s: float) -> None:
        """Start (or join) this run on ``device_name``: ``on_start`` with its step.

        ``save_s``: the job's checkpoint-writing seconds so far (not this member's training).
        """
        self.started, self.save_s_before = time.perf_counter(), save_s
        self.call(self.callbacks.on_start, StartEvent(
            self.spec.name, self.spec.total_steps, device_name, self.num_parameters,
            resumed_from_step=self.step))

    def seconds(self, save_s: float) -> float:
        """Training seconds: earlier runs' and this one's, less checkpoint writes.

        ``save_s``: the job's checkpoint-writing seconds so far (seconds, as
        :meth:`begin`'s).
        """
        if self.started is None:
            return self.earlier_s
        saving = save_s - self.save_s_before
        return self.earlier_s + time.perf_counter() - self.started - saving

    def eval_due(self, step: int) -> bool:
        """Whether the member evaluates after ``step`` (0, its last, and every ``eval_every``)."""
        every = self.spec.eval_every
        return (
            self.error is None
            and self.spec.eval_data is not None
            and (step in (0, self.spec.total_steps) or (every is not None and step % every == 0))
        )

    def settles(self, step: int) -> bool:
        """Whether the member ends or writes a checkpoint after its ``step``.

        Its weights must then be whole: deferred clipped updates are applied first
        (:func:`~sweepmaster.runtime.training.tasks.after_step_phase`).
        """
        every = self.spec.checkpoint_every if self.key else None
        return self.error is None and (
            step == self.spec.total_steps or (every is not None and step % every == 0))

    def record_eval(self, step: int, eval_loss: float) -> None:
        """Record an evaluation (loss in nats per token) and hear whether the member is pruned."""
        eval_perplexity = math.exp(eval_loss) if eval_loss < 700 else math.inf
        self.metrics.append(MetricPoint(step, "eval_loss", eval_loss))
        self.metrics.append(MetricPoint(step, "eval_perplexity", eval_perplexity))
        event = EvalEvent(self.spec.name, step, self.spec.total_steps, eval_loss, eval_perplexity)
        self.pruned = bool(self.call(self.callbacks.on_eval, event))

    def record_step(
        self, step: int, loss: float, lr: float, epoch: int, seconds: float, device: Device
    ) -> None:
        """Record a step (loss in nats per token, ``seconds`` of the step) and tell the callback.

        A non-finite loss fails the member (``FloatingPointError``, as ``train_plain`` raises).
        """
        if self.error is not None:
            return
        if not math.isfinite(loss):
            self.error = FloatingPointError(
                f"job {self.spec.name!r}: non-finite train loss {loss} at step {step}"
            )
            return
        self.window.append((seconds, self.spec.tokens_per_step))
        tokens_per_s = sum(n for _, n in self.window) / max(sum(s for s, _ in self.window), 1e-9)
        self.metrics += [
            MetricPoint(step, "train_loss", loss),
            MetricPoint(step, "lr", lr),
            MetricPoint(step, "tokens_per_s", tokens_per_s),
        ]
        total = self.spec.total_steps
        self.call(
            self.callbacks.on_step,
            StepEvent(self.spec.name, step, total, epoch, loss, lr, tokens_per_s, device.name),
        )

    def finish(self, array: MemberSource, index: int, seconds: float) -> None:
        """Build the member's :class:`TrainResult` from member ``index`` of ``array``.

        Its weights are saved to ``checkpoint_dir`` unless it was pruned; ``seconds``: its
        training seconds (:meth:`seconds`). The job sets the result's device and counters.

        Raises:
            OSError: The weights could not be saved.
        """
        checkpoint_path = None
        if self.spec.checkpoint_dir is not None and not self.pruned:
            checkpoint_path = save_weights(array.member_module(index), self.spec.checkpoint_dir)
        metric = self.spec.metric if self.spec.eval_data is not None else "train_loss"
        values = [point.value for point in self.metrics if point.name == metric]
        self.result = TrainResult(
            objective=values[-1] if values else math.nan,
            metrics=self.metrics,
            state_dict=array.member_state_dict(index),
            steps=self.step,
            tokens=self.step * self.spec.tokens_per_step,
            train_seconds=seconds,
            pruned=self.pruned,
            checkpoint_path=checkpoint_path,
        )


#: Called when a member leaves its fused array: ``(index, result, error)``, one of the last two
#: ``None``; the index is in the array's ``specs``, then in joining order
#: (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`).
MemberEndHook = Callable[[int, TrainResult | None, Exception | None], None]

#: Asked at a step boundary where a fused array has free slots (members left it):
#: ``(free slots, the array's steps so far)`` -> at most that many new members to join it, each
#: its spec and progress receiver
#: (:meth:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob.join`).
RefillHook = Callable[[int, int], Sequence[tuple[TrainSpec, TrainCallbacks | None]]]


# ---------------------------------------------------------------- building members


def meta_template(spec: TrainSpec, peft: LoraSpec | None = None) -> nn.Module:
    """A parameterless module of the members' class, built on the meta device (ties intact).

    Args:
        spec: A member.
        peft: The adapter to build it with instead of ``spec.peft`` (see :func:`padded_adapter`).
    """
    config = model_config(spec)
    with HOST_RNG_LOCK:
        host_state = torch.get_rng_state()
        try:
            with torch.device("meta"):
                template = build_model(config if config is not None else spec.model, spec.dtype,
                                       peft if peft is not None else spec.peft)
        finally:
            torch.set_rng_state(host_state)
    return template


def padded_adapter(specs: Sequence[TrainSpec]) -> LoraSpec | None:
    """The template's adapter: the members' largest rank R, a dropout site if any drops."""
    adapters = [spec.peft for spec in specs if spec.peft is not None]
    if not adapters:
        return None
    return dataclasses.replace(adapters[0], r=max(a.r for a in adapters),
                               dropout=max(a.dropout for a in adapters))


def zero_pad(tensor: Tensor, shape: torch.Size) -> Tensor:
    """``tensor`` in the leading corner of zeros of ``shape`` (itself when it has the shape)."""
    if tensor.shape == shape:
        return tensor
    padded = tensor.new_zeros(shape)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return padded


def unpad(tensor: Tensor, shape: torch.Size) -> Tensor:
    """The leading corner of ``tensor`` of ``shape`` (a view; :func:`zero_pad` undone)."""
    return tensor[tuple(slice(0, n) for n in shape)]


def lora_layers(template: nn.Module) -> list[Any]:
    """The PEFT LoRA layers (``LoraLayer``: a ``scaling`` per adapter) of ``template``."""
    from peft.tuners.lora import LoraLayer

    return [module for module in template.modules() if isinstance(module, LoraLayer)]


@contextlib.contextmanager
def lora_scaling(layers: Sequence[Any], scaling: Tensor) -> Iterator[None]:
    """Run the layers with ``scaling`` (a member's ``alpha / r``, batched under vmap)."""
    saved = [layer.scaling for layer in layers]
    try:
        for layer, scales in zip(layers, saved, strict=True):
            layer.scaling = dict.fromkeys(scales, scaling)
        yield
    finally:
        for layer, scales in zip(layers, saved, strict=True):
            layer.scaling = scales


@contextlib.contextmanager
def marking_adapter_dropout(layers: Sequence[Any],
                             recorder: DropoutReplay) -> Iterator[None]:
    """Mark the dropout sites ``recorder`` records inside the layers' adapter dropouts."""

    def enter(*_: Any) -> None:
        recorder.in_adapter = True

    def leave(*_: Any) -> None:
        recorder.in_adapter = False

    handles = []
    for layer in layers:
        for dropout in layer.lora_dropout.values():
            handles += [dropout.register_forward_pre_hook(enter),
                        dropout.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def load_member(
    spec: TrainSpec, state: TrainingState | None, torch_device: torch.device,
    bases: SharedBases,
) -> tuple[Member, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Build a member as alone (:func:`build_member` from ``bases``), continued from ``state``.

    Returns:
        Its bookkeeping, then its trainable parameters (unpadded), buffers and frozen
        parameters by name (CPU, detached; shared with ``bases`` unless ``state`` is given).
    """
    model, generator = build_member(spec, torch_device, bases, own_base=state is not None)
    step = 0
    if state is not None:
        model.load_state_dict(state.model)
        restore_rng(state.rng, torch_device, generator)
        step = state.step
    named = dict(model.named_parameters())
    trainable = {name: p.detach() for name, p in named.items() if p.requires_grad}
    base = {name: p.detach() for name, p in named.items() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    num_blocks = int(spec.train_data.shape[0])
    batches = minibatch_indices(num_blocks, spec.batch_size, spec.seed, start_step=step)
    shapes = {name: p.shape for name, p in trainable.items()}
    return Member(spec, batches, generator, step, shapes), trainable, buffers, base


def member_noise(site: NoiseSite, spec: TrainSpec, generator: torch.Generator,
                  device: torch.device, out: Tensor | None = None) -> Tensor:
    """One member's dropout noise at ``site`` (``site.shape``): keep-mask / (1 - p), or ones.

    ``p`` is the site's, or at a LoRA adapter's site the member's own ``peft.dropout``; with
    ``p = 0`` nothing is drawn (PEFT's ``nn.Identity``) and the noise is ones. Drawn into
    ``out`` when given (of ``site``'s shape and strides, on ``device``): a tensor of the same
    strides draws the same numbers.
    """
    p = site.p
    if site.adapter:
        assert spec.peft is not None
        p = spec.peft.dropout
    noise = out if out is not None else torch.empty_strided(site.shape, site.stride,
                                                            dtype=site.dtype, device=device)
    if p == 0:
        return noise.fill_(1)
    return noise.bernoulli_(1 - p, generator=generator).div_(1 - p)


def lora_scale(spec: TrainSpec) -> float:
    """A member's LoRA scaling ``alpha / r`` (1 without an adapter)."""
    return spec.peft.alpha / spec.peft.r if spec.peft is not None else 1.0


class SharedBases:
    """The base members share, built once: the base model and the host RNG state its init left.

    Members with one base (model source, dtype and seed) draw the same base init from the same
    seeded stream and differ only in what follows it (an adapter's init). So
    :func:`build_member` builds the base for the first of them, keeps it with the host
    generator's state after its init, and gives every member a copy of it whose tensors share
    the base's storage (no init, no copy of the weights), finished from that state with the
    member's own adapter: each member equals, bit for bit, the member built alone, and so does
    its dropout stream (which continues the same generator). One base is kept, the first built
    (a fused array holds one); a member of another base gets a base built for it alone. Not
    thread-safe; the host RNG lock guards the builds.
    """

    def __init__(self) -> None:
        self._kept: tuple[tuple[str, str, int], nn.Module, Tensor, object] | None = None

    def base(self, spec: TrainSpec) -> tuple[nn.Module, Tensor, bool]:
        """``spec``'s base (built now unless kept) and the host RNG state after its init.

        The caller holds ``HOST_RNG_LOCK``; the host generator is left seeded and drawn from.

        Returns:
            The base, the host generator's state after its init, and whether the base is kept
            (others share it: copy it before changing it; else it is the caller's alone).

        Raises:
            As :func:`~sweepmaster.workload.models.build_base`.
        """
        key = (_source_key(spec.model), spec.dtype, spec.seed)
        if self._kept is not None and self._kept[0] == key:
            return self._kept[1], self._kept[2], True
        torch.random.default_generator.manual_seed(spec.seed)
        base = build_base(spec.model, spec.dtype)
        rng_state = torch.get_rng_state()
        if self._kept is not None:
            return base, rng_state, False
        self._kept = (key, base, rng_state, spec.model)  # the source too: its id stays unique
        return base, rng_state, True

    def shares(self, tensors: dict[str, Tensor]) -> bool:
        """Whether ``tensors`` (at least one) are all in the kept base's memory (CPU)."""
        if self._kept is None or not tensors:
            return False
        pointers = {p.data_ptr() for p in self._kept[1].parameters() if p.device.type == "cpu"}
        return all(t.device.type == "cpu" and t.data_ptr() in pointers for t in tensors.values())

    def clear(self) -> None:
        """Forget the kept base (its memory is freed unless members still share it)."""
        self._kept = None


def _source_key(source: Any) -> str:
    """What identifies a model source's base: a config's fields, a directory, a factory."""
    if isinstance(source, PretrainedConfig):
        return "config:" + json.dumps(source.to_dict(), sort_keys=True, default=str)
    if isinstance(source, (str, os.PathLike)):
        return "path:" + os.fspath(source)
    return f"factory:{id(source)}"


def build_member(
    spec: TrainSpec, torch_device: torch.device, bases: SharedBases | None = None,
    *, own_base: bool = False,
) -> tuple[nn.Module, torch.Generator]:
    """Build a member like plain training does; return it (CPU) and its dropout generator.

    The CPU generator is seeded and drawn from exactly as in ``train_plain``; the member's
    generator continues that stream (CPU) or is its device's generator seeded with ``seed``.
    The process's CPU generator state is restored. With ``bases``, the base kept there is not
    built again for a member of the same source, dtype and seed (:class:`SharedBases`): the
    member's base then shares its tensors, which nothing may write in place.

    Args:
        spec: The member.
        torch_device: Where it trains (its dropout generator's device).
        bases: Where the shared base is kept; ``None``: build alone.
        own_base: Give the member its own copy of the base's tensors (for a member whose
            weights are overwritten next, e.g. from a checkpoint).

    Raises:
        As :func:`~sweepmaster.workload.models.build_model`.
    """
    bases = bases if bases is not None else SharedBases()
    with HOST_RNG_LOCK:
        host_state = torch.get_rng_state()
        try:
            base, rng_state, kept = bases.base(spec)
            torch.set_rng_state(rng_state)
            if kept:
                base = _copy_model(base, share=not own_base)
            model = finish_model(base, spec.dtype, spec.peft)
            generator = torch.Generator()
            generator.set_state(torch.get_rng_state())
        finally:
            torch.set_rng_state(host_state)
    if torch_device.type != "cpu":
        generator = torch.Generator(device=torch_device).manual_seed(spec.seed)
    return model, generator


def _copy_model(model: nn.Module, share: bool) -> nn.Module:
    """A copy of ``model``'s modules: its parameters and buffers shared (``share``) or copied.

    Shared parameters are new ``nn.Parameter`` objects over the same tensors (freezing or
    casting the copy leaves ``model`` as it is); ties within ``model`` stay ties.
    """
    memo: dict[int, Any] = {}
    if share:
        for param in model.parameters():
            memo[id(param)] = nn.Parameter(param.data, requires_grad=param.requires_grad)
        for buffer in model.buffers():
            memo[id(buffer)] = buffer
    return copy.deepcopy(model, memo)


def same_tensors(frozen: dict[str, Tensor], base: dict[str, Tensor]) -> bool:
    """Whether ``base``'s tensors equal ``frozen``'s (tensors over the same memory do, at once)."""
    return all(t.is_set_to(frozen[name]) or torch.equal(frozen[name], t.to(frozen[name].device))
               for name, t in base.items())


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Name -> the name ``named_parameters`` / ``named_buffers`` keeps for tied tensors."""
    aliases: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            canonical = first.setdefault(id(tensor), name)
            if canonical != name:
                aliases[name] = canonical
    return aliases


# ---------------------------------------------------------------- per-member dropout


_SDPA_ARGS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


class DropoutReplay(TorchFunctionMode):
    """Dropout from pre-drawn noise: records draw sites (``noises=None``) or replays them.

    Intercepts ``F.dropout`` (what ``nn.Dropout`` calls) in training with ``0 < p < 1`` and
    ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (computed as ATen's math path,
    which is what the CPU runs with dropout). Recording draws nothing.
    """

    def __init__(self, noises: list[Tensor] | None) -> None:
        super().__init__()
        self.sites: list[NoiseSite] = []
        self._noises = noises
        self._next = 0
        self.in_adapter = False  # recording: inside a LoRA adapter's dropout

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args, strict=False), **kwargs)
            x, p = bound["input"], float(bound.get("p", 0.5))
            if bound.get("training", True) and 0 < p < 1:
                noise = self._noise(x, p)
                return x.mul_(noise) if bound.get("inplace", False) else x * noise
        elif func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args, strict=False), **kwargs)
            if bound.get("dropout_p", 0.0) > 0:
                return _math_attention(self._noise, **bound)
        return func(*args, **kwargs)

    def _noise(self, x: Tensor, p: float) -> Tensor:
        if self._noises is None:
            reference = torch.empty_like(x)  # the strides torch.dropout's noise gets
            self.sites.append(NoiseSite(tuple(x.shape), reference.stride(), x.dtype, p,
                                         adapter=self.in_adapter))
            return torch.ones((), dtype=x.dtype, device=x.device)
        if self._next >= len(self._noises) or self._noises[self._next].shape != x.shape:
            raise RuntimeError("the forward's dropout calls differ from the probe's")
        self._next += 1
        return self._noises[self._next - 1]


def _math_attention(
    noise: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` as ATen's math path, dropout noise from ``noise``."""
    length, source_length = query.shape[-2], key.shape[-2]
    scale_factor = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    root = math.sqrt(abs(scale_factor))
    if enable_gqa:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    attn = (query * math.copysign(root, scale_factor)) @ (key.transpose(-2, -1) * root)
    if is_causal:
        attn_mask = torch.ones(length, source_length, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=attn.dtype).masked_fill(
                ~attn_mask, -math.inf
            )
        attn = attn + attn_mask
    masked_rows = (attn == -math.inf).all(dim=-1, keepdim=True)
    attn = torch.softmax(attn, dim=-1).masked_fill(masked_rows, 0.0)  # ATen's _safe_softmax
    return (attn * noise(attn, dropout_p)) @ value


class SeededOpDetector(TorchDispatchMode):
    """Collects the random (``nondeterministic_seeded``) aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Attention kernels are tagged seeded for their dropout, which DropoutReplay takes
        # over whenever it is non-zero.
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded and "scaled_dot_product" not in str(func):
            self.ops.add(str(func))
        return func(*args, **(kwargs or {}))
