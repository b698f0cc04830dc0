"""Decompose a model into an ordered list of layers, the unit that shards are cut from.

Spilling (Hydra, Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) cuts a model into
contiguous shards of layers. A :class:`LayerStack` is that list: ``layers[0]`` takes the token ids
``(B, T)``, each layer takes the previous one's output, and the last returns logits ``(B, T, V)``;
composing them computes exactly ``lm_logits(model, input_ids)`` (same ops, same order, same
numbers). The layers share their parameters with ``model``, which keeps owning them (its
``state_dict`` is the job's result).

Supported models:

* HuggingFace decoder-only causal LMs of the families in
  :data:`~sweepmaster.workload.families.FAMILIES` (GPT-2, Llama, Mistral, Qwen2, GPT-NeoX /
  Pythia, OPT), split by one table of attribute paths: ``embed`` (:class:`Embedding`: token
  embedding, learned positions, dropout), ``block.i`` for each decoder layer
  (:class:`DecoderLayer`: the layer with its position ids, causal mask and rotary
  ``position_embeddings``), ``head`` (:class:`Head`: final norm and LM head). A tied LM head
  (GPT-2, OPT; any family with ``tie_word_embeddings``) shares its ``nn.Parameter`` with the
  token embedding: it appears in the first and the last layer, and the runtime gives it one
  update per step after both gradient contributions.
* ``nn.Sequential``: its children.
* Any module with a ``spill_layers()`` method returning the layer modules.
* A list (or ``nn.ModuleList``) of modules passed to :func:`decompose` directly.

Shape legend: B batch (blocks), T tokens per block, C hidden size, V vocabulary size.

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> stack = decompose(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2)))
    >>> stack.names
    ('embed', 'block.0', 'block.1', 'head')
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sweepmaster.workload.families import FAMILIES, Family, supported_model_types

__all__ = [
    "DecoderLayer", "Embedding", "Head", "LayerStack", "UnsupportedModelError", "decompose",
    "mask_pass",
]


class UnsupportedModelError(TypeError):
    """The model cannot be decomposed into layers; the message says how to supply them."""


@dataclass(frozen=True)
class LayerStack:
    """A model as an ordered list of layers.

    Attributes:
        model: The module that owns the parameters (its ``state_dict`` is the result).
        layers: The layers, in forward order.
        names: One name per layer, e.g. ``"embed"``, ``"block.3"``, ``"head"``.
    """

    model: nn.Module
    layers: tuple[nn.Module, ...]
    names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.layers)

    def parameter_names(self) -> dict[int, str]:
        """``id(parameter) -> name`` in ``model.named_parameters()`` (tied ones named once)."""
        return {id(p): name for name, p in self.model.named_parameters()}

    def layer_parameters(self, index: int) -> list[nn.Parameter]:
        """The trainable parameters layer ``index`` uses, each once, in registration order."""
        seen: set[int] = set()
        params = []
        for param in self.layers[index].parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        return params

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Compose every layer: ``logits_BTV`` (equal to ``lm_logits(model, input_ids_BT)``)."""
        hidden = input_ids_BT
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class Embedding(nn.Module):
    """A causal LM's input layer: tokens, learned positions, dropout. ``(B, T) -> (B, T, C)``.

    Runs the family's embedding modules in the order its ``*Model.forward`` does: tokens,
    ``project_in``, plus the learned position embedding of positions ``0 .. T - 1``, dropout.

    Args:
        model: The causal LM.
        family: Where its modules live.
    """

    def __init__(self, model: nn.Module, family: Family) -> None:
        super().__init__()
        self.tokens = _module(model, family.tokens)
        positions = _optional(model, family.positions)
        assert positions is None or isinstance(positions, nn.Embedding), family.positions
        self.positions = positions
        self.project_in = _optional(model, family.project_in)
        self.drop = _optional(model, family.dropout)

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Embed the ids like the family's ``*Model.forward``."""
        hidden_BTC = self.tokens(input_ids_BT)
        if self.project_in is not None:
            hidden_BTC = self.project_in(hidden_BTC)
        if self.positions is not None:
            position_ids_1T = _position_ids(hidden_BTC)
            offset = getattr(self.positions, "offset", 0)  # OPT's learned positions start at 2
            if offset:
                position_ids_1T = position_ids_1T + offset
            hidden_BTC = hidden_BTC + nn.Embedding.forward(self.positions, position_ids_1T)
        if self.drop is not None:
            hidden_BTC = self.drop(hidden_BTC)
        return hidden_BTC


class DecoderLayer(nn.Module):
    """One decoder layer with the causal mask, position ids and rotary embeddings it is given.

    The layer input is the hidden state alone (a shard boundary holds one tensor), so the
    layer derives from it what the family's ``*Model.forward`` computes once per forward and
    passes to every layer: position ids ``0 .. T - 1`` ``(1, T)``, the causal mask of the
    model's attention implementation (``None`` where SDPA's ``is_causal`` does it; a sliding
    window where the family's config asks for one) and, for rotary families,
    ``position_embeddings`` (cos, sin ``(1, T, rotary dim)``) from the model's own rotary
    module. Same inputs, same numbers. Every ``DecoderLayer`` shares that module, so its
    inverse-frequency buffers (``head_dim / 2`` floats) are promoted with every shard. The mask
    is built without data-dependent checks (no host sync on a GPU), once per pass of the layers
    (:func:`mask_pass`; the trainer's shard passes run in one); where SDPA's ``is_causal`` does
    it (no mask), that is decided once per input shape.

    Args:
        layer: The family's decoder layer (``GPT2Block``, ``LlamaDecoderLayer``, ...).
        config: The model config (attention implementation and window, for the mask).
        rotary: The model's rotary embedding module, or ``None``.
        sliding: Give the layer a sliding-window causal mask instead of a causal one.
    """

    def __init__(
        self, layer: nn.Module, config: Any, rotary: nn.Module | None, sliding: bool
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.sliding = sliding
        #: (sliding, B, T, dtype, device) of inputs whose mask SDPA's ``is_causal`` does
        self._skips: set[tuple[Any, ...]] = set()

    def forward(self, hidden_BTC: torch.Tensor) -> torch.Tensor:
        """Run the layer: ``(B, T, C) -> (B, T, C)``."""
        from transformers import masking_utils

        make_mask = (masking_utils.create_sliding_window_causal_mask if self.sliding
                     else masking_utils.create_causal_mask)
        position_ids_1T = _position_ids(hidden_BTC)
        key = (self.sliding, *hidden_BTC.shape[:2], hidden_BTC.dtype, hidden_BTC.device)
        masks = _pass_masks(hidden_BTC)
        mask = None
        if key not in self._skips:  # SDPA's is_causal: decided by shapes alone, once
            if masks is not None and (id(self.config), key) in masks:
                mask = masks[id(self.config), key]
            elif _skips_causal_mask(make_mask, self.config, hidden_BTC):
                self._skips.add(key)
            else:
                mask = _causal_mask(make_mask, self.config, hidden_BTC)
                if mask is None:
                    self._skips.add(key)
                elif masks is not None:
                    masks[id(self.config), key] = mask
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "position_ids": position_ids_1T,
            "use_cache": False,
        }
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden_BTC, position_ids_1T)
        out = self.layer(hidden_BTC, **kwargs)
        return out[0] if isinstance(out, tuple) else out


#: The causal masks of the pass the calling thread runs (:func:`mask_pass`), else ``None``.
_PASS = threading.local()


@contextlib.contextmanager
def mask_pass() -> Iterator[None]:
    """One pass over layers: each :class:`DecoderLayer` mask is built once in it, then dropped.

    A mask depends on the layer input's shape, dtype and device alone (and the config), so the
    layers of a pass share it instead of each building it (fake and ``vmap``-batched inputs
    build their own). Nested passes share the outer one's masks.
    """
    if getattr(_PASS, "masks", None) is not None:
        yield
        return
    _PASS.masks = {}
    try:
        yield
    finally:
        _PASS.masks = None


def _pass_masks(hidden_BTC: torch.Tensor) -> dict[tuple[Any, ...], Any] | None:
    """The masks of the calling thread's pass, where ``hidden_BTC``'s mask may be shared."""
    from torch._subclasses.fake_tensor import FakeTensor

    masks: dict[tuple[Any, ...], Any] | None = getattr(_PASS, "masks", None)
    if masks is None or isinstance(hidden_BTC, FakeTensor):
        return None
    if torch._C._functorch.is_batchedtensor(hidden_BTC):
        return None
    return masks


def _skips_causal_mask(make_mask: Any, config: Any, hidden_BTC: torch.Tensor) -> bool:
    """Whether ``make_mask`` leaves the causal mask to SDPA's ``is_causal`` (returns ``None``).

    Decided on a real host tensor ``(B, T, 1)`` outside any fake mode: under ``FakeTensorMode``
    (the memory profile's dry run) transformers always builds the mask, so the dry run would
    save a mask tensor the real pass does not.
    """
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    if not isinstance(hidden_BTC, FakeTensor):
        return False  # a real pass: make_mask decides itself
    with unset_fake_temporarily():
        batch, tokens = int(hidden_BTC.shape[0]), int(hidden_BTC.shape[1])
        probe_BT1 = torch.empty((batch, tokens, 1), dtype=hidden_BTC.dtype)
        return _causal_mask(make_mask, config, probe_BT1) is None


def _causal_mask(make_mask: Any, config: Any, hidden_BTC: torch.Tensor) -> Any:
    """``make_mask`` without a KV cache or padding, whichever name transformers gives it.

    No position ids: a layer's are ``0 .. T - 1`` (one sequence per row), so the mask is
    what the family's forward builds, without transformers' packed-sequence check on them
    (``(packed[:, -1] == 0).all()``: a host sync per layer on a GPU). transformers 5
    renamed the argument ``past_key_values`` to ``cache``.
    """
    return make_mask(config=config, inputs_embeds=hidden_BTC, attention_mask=None,
                     position_ids=None, **{_cache_argument(make_mask): None})


@functools.cache
def _cache_argument(make_mask: Any) -> str:
    """The name of ``make_mask``'s KV-cache argument."""
    return "cache" if "cache" in inspect.signature(make_mask).parameters else "past_key_values"


class Head(nn.Module):
    """A causal LM's output layer: final norm, projection, LM head. ``(B, T, C) -> (B, T, V)``.

    Args:
        model: The causal LM.
        family: Where its modules live.
    """

    def __init__(self, model: nn.Module, family: Family) -> None:
        super().__init__()
        self.norm = _optional(model, family.norm)
        self.project_out = _optional(model, family.project_out)
        self.lm_head = _module(model, family.head)

    def forward(self, hidden_BTC: torch.Tensor) -> torch.Tensor:
        """Normalize and project to the vocabulary."""
        if self.norm is not None:
            hidden_BTC = self.norm(hidden_BTC)
        if self.project_out is not None:
            hidden_BTC = self.project_out(hidden_BTC)
        return self.lm_head(hidden_BTC)


def decompose(model: nn.Module | Sequence[nn.Module]) -> LayerStack:
    """Decompose a model into its ordered layers (see the module doc for what is supported).

    Args:
        model: A HuggingFace causal LM of a family in
            :data:`~sweepmaster.workload.families.FAMILIES`, an ``nn.Sequential``, a module with
            ``spill_layers()``, or a list / ``nn.ModuleList`` of layer modules.

    Returns:
        The layer stack; its layers share parameters with ``model``.

    Raises:
        UnsupportedModelError: Any other model (the message names the supported model types
            and how to supply layers), a model whose forward drops layers at random (OPT's
            ``layerdrop``), or an empty list of layers.
    """
    if isinstance(model, (list, tuple, nn.ModuleList)):
        layers = tuple(model)
        owner: nn.Module = model if isinstance(model, nn.ModuleList) else nn.ModuleList(layers)
        return _stack(owner, layers, [f"{i}:{type(m).__name__}" for i, m in enumerate(layers)])
    family = _family(model)
    if family is not None:
        assert isinstance(model, nn.Module)
        return _split_causal_lm(model, family)
    spill_layers = getattr(model, "spill_layers", None)
    if callable(spill_layers) and isinstance(model, nn.Module):
        layers = tuple(spill_layers())
        return _stack(model, layers, [f"{i}:{type(m).__name__}" for i, m in enumerate(layers)])
    if isinstance(model, nn.Sequential):
        named = list(model.named_children())
        return _stack(model, tuple(m for _, m in named), [name for name, _ in named])
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    what = f"a {model_type!r} model" if isinstance(model_type, str) else "it"
    raise UnsupportedModelError(
        f"cannot split a {type(model).__name__} into layers for spilling: {what} is not a "
        f"supported causal LM family ({', '.join(supported_model_types())}); use one of "
        "those, an nn.Sequential of layers (input ids -> ... -> logits), or give the model a "
        "spill_layers() method returning its layers in forward order"
    )


def _family(model: object) -> Family | None:
    """The family of a HuggingFace causal LM whose modules are where its table row says."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    family = FAMILIES.get(model.config.model_type)
    if family is None or any(_find(model, path) is None for path in (family.tokens,
                                                                        family.layers,
                                                                        family.head)):
        return None  # e.g. the bare GPT2Model, which has no LM head
    return family


def _split_causal_lm(model: nn.Module, family: Family) -> LayerStack:
    config: Any = model.config
    if getattr(config, "layerdrop", 0.0):
        raise UnsupportedModelError(
            f"cannot split a {type(model).__name__} with layerdrop={config.layerdrop} into "
            "layers: its forward skips layers at random; set layerdrop to 0"
        )
    rotary = _optional(model, family.rotary)
    layer_types = getattr(config, "layer_types", None)
    decoder_layers = list(_module(model, family.layers).children())
    layers: list[nn.Module] = [Embedding(model, family)]
    for index, layer in enumerate(decoder_layers):
        if layer_types is not None:
            sliding = layer_types[index] == "sliding_attention"
        else:
            sliding = family.sliding_window and getattr(config, "sliding_window", None) is not None
        layers.append(DecoderLayer(layer, config, rotary, sliding))
    layers.append(Head(model, family))
    names = ["embed", *(f"block.{i}" for i in range(len(decoder_layers))), "head"]
    return _stack(model, tuple(layers), names)


def _find(model: nn.Module, path: str) -> Any:
    found: Any = model
    for name in path.split("."):
        found = getattr(found, name, None)
    return found


def _module(model: nn.Module, path: str) -> nn.Module:
    found = _find(model, path)
    assert isinstance(found, nn.Module), f"{type(model).__name__}.{path} is not a module"
    return found


def _optional(model: nn.Module, path: str | None) -> nn.Module | None:
    """The module at ``path``, or ``None`` where there is none (OPT's optional projections)."""
    return None if path is None or _find(model, path) is None else _module(model, path)


def _position_ids(hidden: torch.Tensor) -> torch.Tensor:
    """Positions ``0 .. T - 1`` of a ``(B, T, ...)`` tensor, as ``(1, T)`` int64 ids."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _stack(owner: nn.Module, layers: tuple[nn.Module, ...], names: Sequence[str]) -> LayerStack:
    if not layers:
        raise UnsupportedModelError(f"{type(owner).__name__} has no layers to spill")
    for layer in layers:
        if not isinstance(layer, nn.Module):
            raise UnsupportedModelError(
                f"layers must be nn.Module instances, got {type(layer).__name__}"
            )
    return LayerStack(model=owner, layers=layers, names=tuple(names))
