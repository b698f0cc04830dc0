"""Model and data checks of each configuration a trial can get, each distinct setting once.

The model config's values (sizes, layers, probabilities, epsilons, the activation and the LoRA
targets of its family), that it builds (on the meta device, when launching), and that the data
tokenize into enough blocks: run by :func:`~sweepmaster.config.preflight.check_sweep` for every
configuration it looks at.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sweepmaster.config.file_checks import expected_model_type
from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.search_space import did_you_mean
from sweepmaster.errors import ConfigError, DataError
from sweepmaster.workload.families import ACTIVATIONS, FAMILIES, Family
from sweepmaster.workload.text import cached_tokenizer

__all__ = ["TrialChecker", "linear_module_names"]


#: Model config attributes that are counts or sizes: each must be at least 1 when set.
_SIZE_FIELD = re.compile(
    r"^(n_(layer|embd|head|positions|inner|ctx|kv_heads?)|num_(hidden_layers|attention_heads|"
    r"key_value_heads|layers|heads)|(hidden|intermediate|vocab|head|ffn|kv)_(size|dim|channels)|"
    r"d_(model|ff|kv)|max_position_embeddings|head_dim)$")

#: Model config attributes that count layers: each must be at most :data:`_MAX_LAYERS`.
_LAYERS_FIELD = re.compile(r"^(n_layer|num_hidden_layers|num_layers)$")
#: Most layers a model may have: one module each is built (on the meta device) before a launch.
_MAX_LAYERS = 10_000
#: Largest size of any other size field.
_MAX_SIZE = 2**31 - 1

#: Model config attributes that are dropout probabilities: each must be in [0, 1) when set (a
#: dropout of 1 zeroes every activation it applies to).
_PROBABILITY_FIELD = re.compile(r"((^|_)(dropout|pdrop)|^layerdrop)$")

#: Model config attributes that are a normalization's epsilon: each must be > 0 (0 divides by
#: zero on a constant input; a negative one takes the square root of a negative number).
_EPSILON_FIELD = re.compile(r"(^|_)(eps|epsilon)$")

#: Model config attributes that are a standard deviation: each must be >= 0.
_DEVIATION_FIELD = re.compile(r"^initializer_range$")



class TrialChecker:
    """Model and data checks of trial configs, each distinct setting checked once."""

    def __init__(self, config: SweepConfig, build: bool = False) -> None:
        self.source = config.source
        self.build = build
        self._done: dict[str, ConfigError | None] = {}

    def check(self, trial: SweepConfig) -> None:
        """Check ``trial``'s model and data, reusing the result of a setting already checked.

        Raises:
            ConfigError: The model or the data of ``trial`` cannot train.
        """
        tokenizer = cached_tokenizer(trial.tokenizer_snapshot().path)
        model_key = "model:" + trial.model.model_dump_json() + str(trial.data.tokenizer)
        self._once(model_key, functools.partial(_check_model_values, trial, len(tokenizer)))
        if self.build:
            self._once("build:" + model_key,
                       functools.partial(_check_model_builds, trial, len(tokenizer)))
        data = trial.data
        if data.dataset is not None:
            self._once(f"dataset:{data.model_dump_json()}:{trial.train.batch_size}",
                       functools.partial(_check_dataset, trial, tokenizer))
            return
        for split in ("train", "valid"):
            files, key, limit, limit_key = _split_files(trial, split)
            if not files:
                continue
            blocks = trial.train.batch_size if split == "train" else 1
            data_key = f"{split}:{files}:{data.tokenizer}:{limit}:{data.block_size}:{blocks}"
            self._once(data_key, functools.partial(
                _check_data_text, trial, tokenizer, files, key, limit, limit_key, blocks))

    def _once(self, key: str, check: Callable[[], None]) -> None:
        if key not in self._done:
            try:
                check()
                self._done[key] = None
            except ConfigError as err:
                self._done[key] = err
        error = self._done[key]
        if error is not None:
            raise error


def _check_model_values(trial: SweepConfig, vocab_size: int) -> None:
    model = trial.model
    if model.config is not None:
        from sweepmaster.workload.configs import model_config_from_mapping

        hf_config = model_config_from_mapping(model.config, vocab_size)
        where = "model.config."
    else:
        assert model.pretrained is not None
        from transformers import AutoConfig

        snapshot = trial.pretrained_snapshot()
        assert snapshot is not None
        try:
            hf_config = AutoConfig.from_pretrained(snapshot.path, local_files_only=True,
                                                   trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigError(trial.source, "model.pretrained", "a model directory with a "
                              f"loadable config.json, got {model.pretrained}: {detail}") from None
        where = f"model.pretrained ({model.pretrained}'s config.json) "
    _check_family(trial, hf_config.model_type, where)
    fields = hf_config.to_dict()
    for name, value in fields.items():
        if _SIZE_FIELD.match(name) and isinstance(value, int) and not isinstance(value, bool) \
                and value < 1:
            raise _model_error(trial, where, name, f"expected an integer >= 1, got {value}")
        limit = _MAX_LAYERS if _LAYERS_FIELD.match(name) else _MAX_SIZE
        if _SIZE_FIELD.match(name) and isinstance(value, int) and value > limit:
            why = "the deepest models have a few hundred layers" if limit == _MAX_LAYERS \
                else "a size past 2**31 fits no device"
            raise _model_error(trial, where, name, f"expected an integer <= {limit} ({why}), "
                               f"got {value}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if not math.isfinite(value):
            raise _model_error(trial, where, name, f"expected a finite number, got {value}")
        if _PROBABILITY_FIELD.search(name) and not 0 <= value <= 1:
            raise _model_error(trial, where, name, f"expected a probability in [0, 1], got "
                               f"{value}")
        if _PROBABILITY_FIELD.search(name) and value == 1:
            raise _model_error(trial, where, name, "expected a probability in [0, 1) (a "
                               f"dropout of 1 zeroes every activation), got {value}")
        if _EPSILON_FIELD.search(name) and not value > 0:
            raise _model_error(trial, where, name, "expected a number > 0 (a normalization's "
                               f"epsilon; it trains NaN otherwise), got {value}")
        if _DEVIATION_FIELD.search(name) and not value >= 0:
            raise _model_error(trial, where, name, "expected a number >= 0 (the standard "
                               f"deviation of the initial weights), got {value}")
    attribute_map = getattr(hf_config, "attribute_map", {})
    width_name = attribute_map.get("hidden_size", "hidden_size")
    heads_name = attribute_map.get("num_attention_heads", "num_attention_heads")
    width, heads = fields.get(width_name), fields.get(heads_name)
    explicit_head_dim = fields.get("head_dim") is not None and (
        model.config is None or "head_dim" in model.config)
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 \
            and not explicit_head_dim and width % heads:
        raise _model_error(trial, where, heads_name, f"expected a divisor of {width_name} "
                           f"({width}): each head gets an equal share of the width, got {heads}")
    kv_heads = fields.get("num_key_value_heads")
    if isinstance(kv_heads, int) and isinstance(heads, int) and kv_heads > 0 and heads % kv_heads:
        raise _model_error(trial, where, "num_key_value_heads",
                           f"expected a divisor of {heads_name} ({heads}), got {kv_heads}")
    vocab_name = attribute_map.get("vocab_size", "vocab_size")
    vocab = fields.get(vocab_name)
    if isinstance(vocab, int) and vocab < vocab_size:
        raise _model_error(trial, where, vocab_name, f"expected at least the {vocab_size} tokens "
                           f"of the tokenizer {trial.data.tokenizer}, got {vocab}")
    family = FAMILIES[hf_config.model_type]
    activation = getattr(hf_config, family.activation, None)
    if activation not in ACTIVATIONS:
        raise _model_error(trial, where, family.activation, "expected an activation "
                           f"transformers knows ({', '.join(ACTIVATIONS)}), got {activation!r}"
                           f"{did_you_mean(activation, ACTIVATIONS)}")
    rope = fields.get("rope_parameters")
    if isinstance(rope, Mapping) and family.rotary is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kinds = ("default", *sorted(ROPE_INIT_FUNCTIONS))
        if rope.get("rope_type", "default") not in kinds:
            raise _model_error(trial, where, "rope_parameters.rope_type", "expected a RoPE type "
                               f"transformers knows ({', '.join(kinds)}), got "
                               f"{rope.get('rope_type')!r}"
                               f"{did_you_mean(rope.get('rope_type'), kinds)}")
    if model.peft is not None and model.peft.target_modules is not None:
        _check_targets(trial, model.peft.target_modules, family, hf_config)


def _check_family(trial: SweepConfig, model_type: str, where: str) -> None:
    """The runtime splits every model into layers: only the families it knows how to split."""
    if model_type not in FAMILIES:
        raise _model_error(trial, where, "model_type", expected_model_type(model_type))


def linear_module_names(family: Family, config: Any) -> list[str]:
    """The dotted names of a model's linear layers (the modules LoRA can adapt), from the table.

    Args:
        family: The model's family.
        config: The model's ``PretrainedConfig``.

    Returns:
        The names ``model.named_modules()`` gives the model's ``nn.Linear`` and HF ``Conv1D``
        layers, e.g. ``transformer.h.0.attn.c_attn``; OPT's ``project_in`` and ``project_out``
        when ``word_embed_proj_dim`` differs from ``hidden_size``.
    """
    names = [f"{family.layers}.{index}.{path}" for index in range(config.num_hidden_layers)
             for path in family.layer_linears]
    projected = getattr(config, "word_embed_proj_dim", None) not in (None, config.hidden_size)
    names += [path for path in (family.project_in, family.project_out)
              if path is not None and projected]
    return [*names, family.head]


def _check_targets(trial: SweepConfig, targets: Sequence[str], family: Family,
                   config: Any) -> None:
    """``model.peft.target_modules`` match a linear layer as PEFT matches: whole name or end."""
    names = linear_module_names(family, config)
    if not any(name == target or name.endswith(f".{target}")
               for target in targets for name in names):
        leaves = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in names}))
        raise ConfigError(trial.source, "model.peft.target_modules", "names of modules of "
                          f"{family.model_class} to adapt (its linear layers: {leaves}), got "
                          f"{list(targets)}")


def _check_model_builds(trial: SweepConfig, vocab_size: int) -> None:
    """Build the model on the meta device (no memory): what only its constructor checks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from sweepmaster.workload.configs import model_config_from_mapping

    model = trial.model
    key = "model.config" if model.config is not None else "model.pretrained"
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        if model.config is not None:
            hf_config = model_config_from_mapping(model.config, vocab_size)
        else:
            snapshot = trial.pretrained_snapshot()
            assert snapshot is not None
            hf_config = AutoConfig.from_pretrained(snapshot.path, local_files_only=True,
                                                   trust_remote_code=model.trust_remote_code)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # whatever the model class's constructor rejects
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise ConfigError(trial.source, key, f"a config transformers can build a causal LM "
                          f"from, got {detail}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)


def _model_error(trial: SweepConfig, where: str, name: str, expected: str) -> ConfigError:
    if where == "model.config.":
        return ConfigError(trial.source, f"model.config.{name}", expected)
    return ConfigError(trial.source, "model.pretrained", f"{where}{name}: {expected}")


def _split_files(trial: SweepConfig, split: str) -> tuple[list[Path], str, int | None, str]:
    """A split's files, the key naming them, and its token cap with that key."""
    data = trial.data
    limit = data.max_train_tokens if split == "train" else data.max_eval_tokens
    limit_key = "data.max_train_tokens" if split == "train" else "data.max_eval_tokens"
    if data.dir is not None:
        from sweepmaster.workload.text import find_splits

        try:
            return [find_splits(data.dir)[split]], "data.dir", limit, limit_key
        except DataError as exc:
            raise ConfigError(trial.source, "data.dir", f"a WikiText-2 directory: {exc}") \
                from None
    files = data.train_files if split == "train" else data.valid_files
    return list(files or []), f"data.{split}_files", limit, limit_key


def _check_dataset(trial: SweepConfig, tokenizer: Any) -> None:
    """A ``data.dataset`` loads, has its fields and splits, and fills a batch of blocks.

    Tokenizing goes to the ``datasets`` cache, so the launch that follows reads it.
    """
    from sweepmaster.workload.hfdata import prepare_dataset

    blocks = prepare_dataset(trial.data, tokenizer, trial.source)
    have, wanted = int(blocks.train.shape[0]), trial.train.batch_size
    if have < wanted:
        raise ConfigError(trial.source, "train.batch_size", f"at most the {have} blocks of "
                          f"{trial.data.block_size} tokens the training split holds, got {wanted}")


def _check_data_text(trial: SweepConfig, tokenizer: Any, files: Sequence[Path], key: str,
                limit: int | None, limit_key: str, num_blocks: int) -> None:
    """The files are UTF-8 and hold ``num_blocks`` blocks of ``data.block_size`` tokens."""
    from sweepmaster.workload.text import check_utf8, count_tokens

    source, block_size = trial.source, trial.data.block_size
    for path in files:
        try:
            check_utf8(path)
        except DataError as exc:
            raise ConfigError(source, key, f"UTF-8 text files, got {exc}") from None
    needed = num_blocks * block_size
    try:
        num_tokens = count_tokens(files, tokenizer, needed)
    except DataError as exc:
        raise ConfigError(source, key, f"readable text files, got {exc}") from None
    if limit is not None:
        num_tokens = min(num_tokens, limit)
    if num_tokens >= needed:
        return
    have = num_tokens // block_size
    shown = ", ".join(str(p) for p in files)
    capped = limit is not None and limit < needed
    if have < 1:
        what = (f"at least one block of {block_size} tokens (data.block_size)")
        if capped:
            raise ConfigError(source, limit_key, f"{what}, got {limit}")
        raise ConfigError(source, key, f"text of {what}, got {num_tokens} tokens in {shown}")
    cap = f" ({limit_key}: {limit})" if capped else f" in {shown}"
    raise ConfigError(source, "train.batch_size", f"at most the {have} blocks of {block_size} "
                      f"tokens the training data hold{cap}, got {num_blocks}")


