"""The causal LM families sweepmaster can split into layers, as one table of attribute paths.

A HuggingFace decoder-only causal LM is token embeddings (plus learned positions or rotary
embeddings), a list of decoder layers, a final norm and an LM head; the families differ only in
where those modules live. :data:`FAMILIES` maps each supported ``config.model_type`` to those
paths; :func:`sweepmaster.runtime.training.layers.decompose` reads it to cut a model into layers,
and :mod:`sweepmaster.preflight` refuses any other model type before a sweep runs. This module does
not import torch.

Example:
    >>> FAMILIES["llama"].layers
    'model.layers'
    >>> "gpt_neox" in supported_model_types()
    True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family", "supported_model_types"]


@dataclass(frozen=True)
class Family:
    """Where a family's modules live, as dotted attribute paths from the causal LM.

    Attributes:
        tokens: Token embedding (``nn.Embedding``), ``(B, T) -> (B, T, E)``.
        layers: The ``nn.ModuleList`` of decoder layers, each ``(B, T, C) -> (B, T, C)``.
        head: The LM head, ``(B, T, C) -> (B, T, V)`` (may share its weight with ``tokens``).
        positions: Learned position embedding, added to the token embedding (an
            ``nn.Embedding``; its ``offset`` attribute, if any, is added to the position ids).
        project_in: Projection of the token embedding to the hidden size (optional module).
        dropout: Dropout of the summed embeddings.
        rotary: Rotary embedding module: ``(hidden, position_ids) -> (cos, sin)``, handed to
            every decoder layer as ``position_embeddings``.
        norm: Final norm after the last decoder layer (optional module).
        project_out: Projection of the hidden state back to the embedding size (optional).
        sliding_window: The family's mask is a sliding-window causal mask when the config sets
            ``sliding_window`` (Mistral); otherwise per ``config.layer_types`` when it has them
            (``"sliding_attention"``), else a causal mask.
        padded_tokens: The token embedding takes ``padding_idx=config.pad_token_id`` (the
            padding row gets no gradient).
    """

    tokens: str
    layers: str
    head: str = "lm_head"
    positions: str | None = None
    project_in: str | None = None
    dropout: str | None = None
    rotary: str | None = None
    norm: str | None = None
    project_out: str | None = None
    sliding_window: bool = False
    padded_tokens: bool = False


_LLAMA = Family(tokens="model.embed_tokens", layers="model.layers", rotary="model.rotary_emb",
                norm="model.norm", padded_tokens=True)

#: ``config.model_type`` -> where that family's modules live in its ``*ForCausalLM``.
FAMILIES: dict[str, Family] = {
    "gpt2": Family(tokens="transformer.wte", positions="transformer.wpe",
                   dropout="transformer.drop", layers="transformer.h", norm="transformer.ln_f"),
    "llama": _LLAMA,
    "mistral": Family(tokens="model.embed_tokens", layers="model.layers",
                      rotary="model.rotary_emb", norm="model.norm", sliding_window=True,
                      padded_tokens=True),
    "qwen2": _LLAMA,
    "gpt_neox": Family(tokens="gpt_neox.embed_in", dropout="gpt_neox.emb_dropout",
                       rotary="gpt_neox.rotary_emb", layers="gpt_neox.layers",
                       norm="gpt_neox.final_layer_norm"),
    "opt": Family(tokens="model.decoder.embed_tokens", positions="model.decoder.embed_positions",
                  project_in="model.decoder.project_in", layers="model.decoder.layers",
                  norm="model.decoder.final_layer_norm",
                  project_out="model.decoder.project_out", padded_tokens=True),
}


def supported_model_types() -> tuple[str, ...]:
    """The ``model_type`` values of the supported families, sorted."""
    return tuple(sorted(FAMILIES))
