"""The causal LM families sweepmaster can split into layers, as one table of attribute paths.

A HuggingFace decoder-only causal LM is token embeddings (plus learned positions or rotary
embeddings), a list of decoder layers, a final norm and an LM head; the families differ only in
where those modules live. :data:`FAMILIES` maps each supported ``config.model_type`` to those
paths; :func:`sweepmaster.runtime.training.layers.decompose` reads it to cut a model into layers,
and :mod:`sweepmaster.config.preflight` refuses any other model type before a sweep runs. The table
also holds what the model class would reveal only when built (its linear layers, the config field
naming its activation, :data:`ACTIVATIONS`), so a sweep is checked without building a model; the
tests compare it with the installed transformers. This module does not import torch.

Example:
    >>> FAMILIES["llama"].layers
    'model.layers'
    >>> "gpt_neox" in supported_model_types()
    True
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["ACTIVATIONS", "FAMILIES", "Family", "supported_model_types"]


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
        model_class: The transformers ``*ForCausalLM`` class of the family.
        activation: The config field naming the activation (a key of :data:`ACTIVATIONS`).
        layer_linears: The linear layers (``nn.Linear``, HF ``Conv1D``) of one decoder layer,
            as paths from it; with ``head`` (and ``project_in`` / ``project_out`` when the
            config makes them) these are the modules a LoRA adapter can target.
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
    model_class: str = ""
    activation: str = "hidden_act"
    layer_linears: tuple[str, ...] = ()


#: The activation names transformers' model classes accept (``transformers.activations.ACT2FN``).
ACTIVATIONS = (
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python",
    "gelu_python_tanh", "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear",
    "mish", "prelu", "quick_gelu", "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus",
    "swish", "tanh", "xielu",
)

_LLAMA = Family(tokens="model.embed_tokens", layers="model.layers", rotary="model.rotary_emb",
                norm="model.norm", padded_tokens=True, model_class="LlamaForCausalLM",
                layer_linears=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                               "mlp.down_proj"))

#: ``config.model_type`` -> where that family's modules live in its ``*ForCausalLM``.
FAMILIES: dict[str, Family] = {
    "gpt2": Family(tokens="transformer.wte", positions="transformer.wpe",
                   dropout="transformer.drop", layers="transformer.h", norm="transformer.ln_f",
                   model_class="GPT2LMHeadModel", activation="activation_function",
                   layer_linears=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
    "llama": _LLAMA,
    "mistral": replace(_LLAMA, sliding_window=True, model_class="MistralForCausalLM"),
    "qwen2": replace(_LLAMA, model_class="Qwen2ForCausalLM"),
    "gpt_neox": Family(tokens="gpt_neox.embed_in", dropout="gpt_neox.emb_dropout",
                       rotary="gpt_neox.rotary_emb", layers="gpt_neox.layers",
                       norm="gpt_neox.final_layer_norm", model_class="GPTNeoXForCausalLM",
                       layer_linears=("attention.query_key_value", "attention.dense",
                                      "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")),
    "opt": Family(tokens="model.decoder.embed_tokens", positions="model.decoder.embed_positions",
                  project_in="model.decoder.project_in", layers="model.decoder.layers",
                  norm="model.decoder.final_layer_norm",
                  project_out="model.decoder.project_out", padded_tokens=True,
                  model_class="OPTForCausalLM", activation="activation_function",
                  layer_linears=("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                                 "self_attn.out_proj", "fc1", "fc2")),
}


def supported_model_types() -> tuple[str, ...]:
    """The ``model_type`` values of the supported families, sorted."""
    return tuple(sorted(FAMILIES))
