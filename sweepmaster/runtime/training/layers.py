"""Decompose a model into an ordered list of layers, the unit that shards are cut from.

Spilling (Hydra, Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) cuts a model into
contiguous shards of layers. A :class:`LayerStack` is that list: ``layers[0]`` takes the token ids
``(B, T)``, each layer takes the previous one's output, and the last returns logits ``(B, T, V)``;
composing them computes exactly ``lm_logits(model, input_ids)`` (same ops, same order, same
numbers). The layers share their parameters with ``model``, which keeps owning them (its
``state_dict`` is the job's result).

Supported models:

* HuggingFace GPT-2 (``GPT2LMHeadModel``): ``embed`` (``wte`` + ``wpe`` + dropout), ``block.i``
  for each transformer block, ``head`` (``ln_f`` + ``lm_head``). ``lm_head.weight`` is tied to
  ``wte.weight``: the same ``nn.Parameter`` appears in the first and the last layer, and the
  runtime gives it one update per step after both gradient contributions.
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LayerStack", "UnsupportedModelError", "decompose"]


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


class GPT2Embedding(nn.Module):
    """GPT-2's input layer: token plus position embeddings, then dropout. ``(B, T) -> (B, T, C)``.

    Args:
        transformer: The ``GPT2Model`` whose ``wte``, ``wpe`` and ``drop`` are used.
    """

    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.wte = transformer.wte
        self.wpe = transformer.wpe
        self.drop = transformer.drop

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Embed the ids like ``GPT2Model.forward``."""
        inputs_embeds_BTC = self.wte(input_ids_BT)
        position_ids_1T = torch.arange(
            inputs_embeds_BTC.shape[1], device=inputs_embeds_BTC.device
        ).unsqueeze(0)
        hidden_BTC = inputs_embeds_BTC + self.wpe(position_ids_1T)
        return self.drop(hidden_BTC)


class GPT2BlockLayer(nn.Module):
    """One GPT-2 transformer block with the causal mask ``GPT2Model`` would give it.

    Args:
        block: The ``GPT2Block``.
        config: The model config (attention implementation, for the mask).
    """

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden_BTC: torch.Tensor) -> torch.Tensor:
        """Run the block: ``(B, T, C) -> (B, T, C)``."""
        from transformers.masking_utils import create_causal_mask

        position_ids_1T = torch.arange(hidden_BTC.shape[1], device=hidden_BTC.device).unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_BTC,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids_1T,
        )
        return self.block(
            hidden_BTC,
            None,
            causal_mask,
            None,
            encoder_attention_mask=None,
            use_cache=False,
            position_ids=position_ids_1T,
        )


class GPT2Head(nn.Module):
    """GPT-2's output layer: final layer norm and the (tied) LM head. ``(B, T, C) -> (B, T, V)``.

    Args:
        model: The ``GPT2LMHeadModel``.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.ln_f = model.transformer.ln_f
        self.lm_head = model.lm_head

    def forward(self, hidden_BTC: torch.Tensor) -> torch.Tensor:
        """Normalize and project to the vocabulary."""
        return self.lm_head(self.ln_f(hidden_BTC))


def decompose(model: nn.Module | Sequence[nn.Module]) -> LayerStack:
    """Decompose a model into its ordered layers (see the module doc for what is supported).

    Args:
        model: A ``GPT2LMHeadModel``, an ``nn.Sequential``, a module with ``spill_layers()``, or
            a list / ``nn.ModuleList`` of layer modules.

    Returns:
        The layer stack; its layers share parameters with ``model``.

    Raises:
        UnsupportedModelError: Any other model (the message says how to supply layers), or an
            empty list of layers.
    """
    if isinstance(model, (list, tuple, nn.ModuleList)):
        layers = tuple(model)
        owner: nn.Module = model if isinstance(model, nn.ModuleList) else nn.ModuleList(layers)
        return _stack(owner, layers, [f"{i}:{type(m).__name__}" for i, m in enumerate(layers)])
    if _is_gpt2_lm(model):
        gpt2: Any = model
        transformer = gpt2.transformer
        gpt2_layers: list[nn.Module] = [GPT2Embedding(transformer)]
        gpt2_layers += [GPT2BlockLayer(block, gpt2.config) for block in transformer.h]
        gpt2_layers.append(GPT2Head(gpt2))
        names = ["embed", *(f"block.{i}" for i in range(len(transformer.h))), "head"]
        return _stack(gpt2, tuple(gpt2_layers), names)
    spill_layers = getattr(model, "spill_layers", None)
    if callable(spill_layers) and isinstance(model, nn.Module):
        layers = tuple(spill_layers())
        return _stack(model, layers, [f"{i}:{type(m).__name__}" for i, m in enumerate(layers)])
    if isinstance(model, nn.Sequential):
        named = list(model.named_children())
        return _stack(model, tuple(m for _, m in named), [name for name, _ in named])
    raise UnsupportedModelError(
        f"cannot split a {type(model).__name__} into layers for spilling: use a HuggingFace "
        "GPT2LMHeadModel, an nn.Sequential of layers (input ids -> ... -> logits), or give the "
        "model a spill_layers() method returning its layers in forward order"
    )


def _is_gpt2_lm(model: object) -> bool:
    from transformers import GPT2LMHeadModel

    return isinstance(model, GPT2LMHeadModel)


def _stack(owner: nn.Module, layers: tuple[nn.Module, ...], names: Sequence[str]) -> LayerStack:
    if not layers:
        raise UnsupportedModelError(f"{type(owner).__name__} has no layers to spill")
    for layer in layers:
        if not isinstance(layer, nn.Module):
            raise UnsupportedModelError(
                f"layers must be nn.Module instances, got {type(layer).__name__}"
            )
    return LayerStack(model=owner, layers=layers, names=tuple(names))
