"""Model configs from plain mappings, without importing torch.

Example:
    >>> model_config_from_mapping({"n_layer": 2, "n_embd": 32, "n_head": 2}, 50257).n_layer
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sweepmaster.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["model_config_from_mapping"]


def model_config_from_mapping(
    mapping: Mapping[str, Any], vocab_size: int | None = None
) -> PretrainedConfig:
    """Build a HuggingFace model config from a plain mapping (e.g. the ``model`` of sweep.yaml).

    Args:
        mapping: Config attributes, e.g. ``{"model_type": "gpt2", "n_layer": 2}``; the key
            ``model_type`` (default ``"gpt2"``) picks the config class, the rest are passed to
            ``AutoConfig.for_model``.
        vocab_size: Vocabulary size to use when ``mapping`` has no ``vocab_size`` (typically
            ``len(tokenizer)``); ``None`` keeps the config class default.

    Returns:
        The config, e.g. a ``GPT2Config``.

    Raises:
        ConfigError: ``model_type`` is not a known HuggingFace model type.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as transformers_logging

    kwargs = dict(mapping)
    model_type = kwargs.pop("model_type", "gpt2")
    if vocab_size is not None:
        kwargs.setdefault("vocab_size", vocab_size)
    verbosity = transformers_logging.get_verbosity()
    # transformers logs what it finds odd (token ids past the vocabulary); sweepmaster's own
    # checks (sweepmaster.config.preflight) turn such problems into errors instead
    transformers_logging.set_verbosity_error()
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as err:
        raise ConfigError(
            "<mapping>",
            "model_type",
            f"a HuggingFace model type such as 'gpt2', got {model_type!r}",
        ) from err
    finally:
        transformers_logging.set_verbosity(verbosity)
