"""Members of fused arrays: how each is built and padded.

What :class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob` (a fused array: one
stacked shard when it fits its device, else spilled) and its stacked layers
(:mod:`~sweepmaster.runtime.training.fused_shards`) know about building the K members they stack
(HFTA, Wang et al. MLSys 2021; mu-TWO, Purandare et al. MLSys 2023; multi-LoRA over one base:
mLoRA / ASPEN, VLDB 2025):

* **building**: :func:`build_member` builds a member exactly as plain training does (seeded init,
  its dropout generator continuing that stream), from a base built once for members of one
  source, dtype and seed (:class:`SharedBases`); :func:`load_member` continues it from a
  checkpoint and gives its data order; :func:`meta_template` is the parameterless module the
  vmapped forward runs (ties intact);
* **LoRA padding**: adapters of ranks ``r_k`` are zero-padded to the largest rank R
  (:func:`padded_adapter`, :func:`zero_pad`, :func:`unpad`), each member scaled by its own
  ``alpha / r`` (:func:`lora_scale`, :func:`lora_scaling`).

Each member's dropout is :mod:`~sweepmaster.runtime.training.member_dropout`'s; the records of
its trial (metrics, events, result) are :mod:`~sweepmaster.runtime.training.member_runs`'.

Shape legend: K members, B batch, T tokens per block, R the largest LoRA rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from sweepmaster.runtime.training.plain import isolated_host_rng, minibatch_indices
from sweepmaster.runtime.training.training_state import TrainingState, restore_rng
from sweepmaster.workload.architecture import model_config
from sweepmaster.workload.causal_lm import build_base, build_model, finish_model
from sweepmaster.workload.spec import LoraSpec, TrainSpec

__all__ = [
    "Member",
    "SharedBases",
    "build_member",
    "load_member",
    "lora_layers",
    "lora_scale",
    "lora_scaling",
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



def meta_template(spec: TrainSpec, peft: LoraSpec | None = None) -> nn.Module:
    """A parameterless module of the members' class, built on the meta device (ties intact).

    Args:
        spec: A member.
        peft: The adapter to build it with instead of ``spec.peft`` (see :func:`padded_adapter`).
    """
    config = model_config(spec)
    with isolated_host_rng(), torch.device("meta"):
        return build_model(config if config is not None else spec.model, spec.dtype,
                           peft if peft is not None else spec.peft)


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
            As :func:`~sweepmaster.workload.causal_lm.build_base`.
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
        As :func:`~sweepmaster.workload.causal_lm.build_model`.
    """
    bases = bases if bases is not None else SharedBases()
    with isolated_host_rng():
        base, rng_state, kept = bases.base(spec)
        torch.set_rng_state(rng_state)
        if kept:
            base = _copy_model(base, share=not own_base)
        model = finish_model(base, spec.dtype, spec.peft)
        generator = torch.Generator()
        generator.set_state(torch.get_rng_state())
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

