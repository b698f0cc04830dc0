"""Architecture keys: which trials may train together as one fused array.

Trials fuse (mu-TWO, Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313; HFTA, Wang et
al., MLSys 2021, https://arxiv.org/abs/2102.02344) only when one stacked forward computes every
member exactly like its own model would: same layers and shapes (the model config), the same
parameter dtype, the same LoRA adapter (if any), and the same input shape, microbatch ``B`` by
sequence length ``T``. The :func:`architecture_key` hashes exactly that; hyperparameters that
only the optimizer sees (learning rate, weight decay, betas, schedule, seed, data order) are per
member and stay out.

LoRA trials (multi-LoRA training over one shared frozen base: mLoRA / ASPEN, VLDB 2025;
LoRAFusion) fuse by :func:`fusion_key`: the base and the adapted modules must match, while rank,
alpha and dropout are per member (a fused array pads every adapter to the largest rank, exactly).
The frozen base is held once, so members must share it: a base built from a config draws its init
from the seed, so those members share the seed too; one loaded from a pretrained directory is the
same for all.

Example:
    >>> from transformers import GPT2Config
    >>> import torch
    >>> blocks_NT = torch.zeros(8, 16, dtype=torch.long)
    >>> a = TrainSpec(model=GPT2Config(n_layer=2), train_data=blocks_NT, batch_size=4, seed=0)
    >>> b = TrainSpec(model=GPT2Config(n_layer=2), train_data=blocks_NT, batch_size=4, seed=1)
    >>> architecture_key(a) == architecture_key(b)
    True
    >>> group_for_fusion([a, b], max_k=4)
    [[0, 1]]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from sweepmaster.errors import DataError
from sweepmaster.workload.hub import snapshot_revision
from sweepmaster.workload.spec import TrainSpec

__all__ = [
    "FACTORY_KEY_ATTRIBUTE",
    "architecture_key",
    "check_fusable",
    "fusable",
    "fusion_group_key",
    "fusion_key",
    "group_for_fusion",
    "model_config",
]

#: A model factory opts into fusion by carrying this attribute, a string naming its architecture
#: (e.g. ``make_bigram.architecture_key = "bigram-v1"``): factories are opaque, so sweepmaster
#: cannot tell by itself whether two of them build the same layers.
FACTORY_KEY_ATTRIBUTE = "architecture_key"

#: Bumped when the key's definition changes, so cached fusion measurements are not reused.
_KEY_VERSION = 1

#: Config fields that never change the numbers of a training forward: provenance and
#: generation-time token ids / labels. Every other field stays in the key (a field kept in
#: needlessly only prevents a fusion; one left out wrongly would break exactness).
_IRRELEVANT_CONFIG_FIELDS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "problem_type",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        "finetuning_task",
    }
)


def architecture_key(spec: TrainSpec, microbatch_size: int | None = None) -> str:
    """Stable hash of everything that must match for trials to fuse.

    Hashes the model config (``PretrainedConfig.to_dict()`` without provenance and generation-only
    fields, plus the attention implementation), the parameter dtype, the microbatch size ``B``
    and the block length ``T``. Two specs with equal keys can share one fused array; the key is
    the same across processes and machines, so fusion measurements can be cached under it.

    Args:
        spec: The trial. A ``PretrainedConfig`` or pretrained directory is keyed by its
            config (a hub snapshot also by its commit sha); a factory by its
            ``architecture_key`` attribute (see :data:`FACTORY_KEY_ATTRIBUTE`).
        microbatch_size: Blocks per forward, when it differs from ``spec.batch_size`` (e.g. a
            minibatch split into microbatches); ``None`` uses ``spec.batch_size``.

    Returns:
        A 16-character hex digest.

    Raises:
        ValueError: ``spec.model`` is a factory without an ``architecture_key`` string attribute
            (its trials cannot fuse), or ``microbatch_size < 1``.
        DataError: The config of a pretrained model cannot be loaded.
    """
    payload = _base_payload(spec, microbatch_size)
    if spec.peft is not None:  # a LoRA job trains other parameters: its own plans and profile
        payload["peft"] = dataclasses.asdict(spec.peft)
    return _digest(payload)


def fusion_key(spec: TrainSpec) -> str:
    """Stable hash of what members of one fused array share: :func:`architecture_key` for LoRA.

    Equal to :func:`architecture_key` for full fine-tuning. For a LoRA trial, its adapter's rank,
    alpha and dropout stay out (per member in a fused array) and its target modules stay in;
    the seed goes in when the base is built from a config or a factory (its init is drawn from
    the seed, and the array holds one frozen base for all members).

    Returns:
        A 16-character hex digest.

    Raises:
        ValueError: As :func:`architecture_key`.
        DataError: The config of a pretrained model cannot be loaded.
    """
    if spec.peft is None:
        return architecture_key(spec)
    payload = _base_payload(spec, None)
    payload["peft"] = {"target_modules": spec.peft.target_modules}
    if not isinstance(spec.model, (str, os.PathLike)):  # a base drawn from the seed
        payload["base_seed"] = spec.seed
    return _digest(payload)


def _base_payload(spec: TrainSpec, microbatch_size: int | None) -> dict[str, Any]:
    batch_size = spec.batch_size if microbatch_size is None else microbatch_size
    if batch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {batch_size}")
    return {
        "version": _KEY_VERSION,
        "model": _model_identity(spec),
        "dtype": spec.dtype,
        "microbatch_size": batch_size,
        "block_size": int(spec.train_data.shape[1]),
    }


def _digest(payload: dict[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fusable(spec: TrainSpec) -> bool:
    """Whether ``spec`` may fuse: it has an architecture key.

    Every source but an unkeyed factory has a key. LoRA trials fuse over one shared frozen base
    (:func:`fusion_key`).
    """
    source = spec.model
    if isinstance(source, (PretrainedConfig, str, os.PathLike)):
        return True
    return isinstance(getattr(source, FACTORY_KEY_ATTRIBUTE, None), str)


def fusion_group_key(spec: TrainSpec) -> tuple[str, str] | None:
    """What trials must share to fuse: ``(fusion_key, optimizer name)``.

    A fused array runs one stacked forward (same :func:`fusion_key`: the architecture key, for
    LoRA without the adapter's rank, alpha and dropout) and one fused optimizer (HFTA: same
    optimizer kind, per-member hyperparameters).

    Returns:
        The pair, or ``None`` for a trial that never fuses: its model cannot be keyed, or its
        token embedding has a padding row (``padding_idx``), whose zero gradient ``vmap`` keeps
        for the first member only (PyTorch 2.13), so members after it would drift.

    Raises:
        DataError: The config of a pretrained model cannot be loaded.
    """
    if not fusable(spec) or _has_padding_row(spec):
        return None
    return fusion_key(spec), spec.optimizer.name


def check_fusable(specs: Sequence[TrainSpec]) -> None:
    """Refuse members of one fused array that cannot fuse, naming the first that differs.

    Every path that builds a fused array checks its members here (the executor's
    ``submit_fused``, the fit check of its members, a spilled fused array itself).

    Args:
        specs: The members, at least one.

    Raises:
        ValueError: A member without an architecture key (an unkeyed factory, or a token
            embedding with a padding row), or one whose
            :func:`fusion_group_key` differs from the first
            member's, with what differs (optimizer, dtype, batch_size, block length T, LoRA
            target modules, else the model).
    """
    first = specs[0]
    first_key = fusion_group_key(first)
    for index, spec in enumerate(specs):
        key = first_key if index == 0 else fusion_group_key(spec)
        if key is None:
            why = ("its model factory has no 'architecture_key' string attribute"
                   if not fusable(spec) else
                   "its token embedding has a padding row (padding_idx), which fused "
                   "training does not keep exact")
            raise ValueError(f"specs[{index}] ({spec.name!r}) cannot train in a fused array: "
                             f"{why}; submit it alone")
        if key == first_key:
            continue
        differences = [
            f"{label} {a!r} vs {b!r}" for label, a, b in (
                ("optimizer", first.optimizer.name, spec.optimizer.name),
                ("dtype", first.dtype, spec.dtype),
                ("batch_size", first.batch_size, spec.batch_size),
                ("block length T", int(first.train_data.shape[1]),
                 int(spec.train_data.shape[1])),
                ("LoRA target_modules",
                 None if first.peft is None else first.peft.target_modules,
                 None if spec.peft is None else spec.peft.target_modules),
            ) if a != b
        ] or ([f"seed {first.seed!r} vs {spec.seed!r} (a LoRA base built from a config or "
               "a factory is drawn from it, and the array shares one base)"]
              if first.seed != spec.seed and spec.peft is not None
              and fusion_group_key(dataclasses.replace(spec, seed=first.seed)) == first_key
              else ["model config (or factory key)"])
        raise ValueError(f"specs[{index}] ({spec.name!r}) cannot fuse with specs[0] "
                         f"({first.name!r}): they differ in {', '.join(differences)}; members "
                         "of a fused array share one architecture key (model config, dtype, "
                         "batch_size, block length T) and optimizer kind")


def _has_padding_row(spec: TrainSpec) -> bool:
    """Whether the model's token embedding has a ``padding_idx`` (see :func:`fusion_group_key`)."""
    from sweepmaster.workload.families import FAMILIES

    config = model_config(spec)
    family = FAMILIES.get(getattr(config, "model_type", None) or "")
    return (family is not None and family.padded_tokens
            and getattr(config, "pad_token_id", None) is not None)


def group_for_fusion(specs: Sequence[TrainSpec], max_k: int) -> list[list[int]]:
    """Partition trials into fusion groups of at most ``max_k`` members.

    Rules: members of a group have equal :func:`fusion_group_key`: equal
    :func:`fusion_key` (so different batch sizes, sequence lengths, dtypes, configs or LoRA
    target modules never fuse; LoRA ranks, alphas and dropouts may)
    and the same optimizer kind (a fused array runs one fused optimizer, HFTA); a trial
    whose model cannot be keyed is a group of its own.
    A key with more than ``max_k`` trials is cut into consecutive chunks of ``max_k`` (the last
    may be smaller); members keep the order of ``specs``, groups are sorted by first member.

    Args:
        specs: The trials to group.
        max_k: Largest fusion degree, e.g. from
            :func:`~sweepmaster.runtime.planning.fusion_degree.choose_fusion_degree`; 1
            disables fusion.

    Returns:
        Lists of indices into ``specs``; every index appears exactly once.

    Raises:
        ValueError: ``max_k < 1``.
        DataError: The config of a pretrained model cannot be loaded.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    buckets: dict[tuple[str, str] | int, list[int]] = {}
    for index, spec in enumerate(specs):
        key = fusion_group_key(spec)
        buckets.setdefault(index if key is None else key, []).append(index)
    groups = [
        members[start : start + max_k]
        for members in buckets.values()
        for start in range(0, len(members), max_k)
    ]
    return sorted(groups, key=lambda group: group[0])


def model_config(spec: TrainSpec) -> PretrainedConfig | None:
    """The HF config of ``spec.model`` (loaded for a pretrained source), or ``None`` (factory).

    Raises:
        DataError: The config of a pretrained model cannot be loaded.
    """
    source = spec.model
    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        is_dir = Path(source).is_dir()
        try:
            config: PretrainedConfig = AutoConfig.from_pretrained(
                str(source), local_files_only=is_dir
            )
        except (OSError, ValueError) as err:
            raise DataError(f"{source}: cannot load a model config: {err}") from err
        return config
    return None


def _model_identity(spec: TrainSpec) -> dict[str, Any]:
    config = model_config(spec)
    if config is not None:
        fields = {
            name: value
            for name, value in config.to_dict().items()
            if name not in _IRRELEVANT_CONFIG_FIELDS
        }
        attn = getattr(config, "_attn_implementation", None)
        identity: dict[str, Any] = {"config": fields, "attn_implementation": attn}
        revision = (snapshot_revision(spec.model)
                    if isinstance(spec.model, (str, os.PathLike)) else None)
        if revision is not None:  # weights of a hub commit: plans and fused bases follow it
            identity["revision"] = revision
        return identity
    key = getattr(spec.model, FACTORY_KEY_ATTRIBUTE, None)
    if not isinstance(key, str):
        name = getattr(spec.model, "__name__", type(spec.model).__name__)
        raise ValueError(
            f"model factory {name!r} has no {FACTORY_KEY_ATTRIBUTE!r} string attribute, so "
            f"its trials cannot fuse; set {name}.{FACTORY_KEY_ATTRIBUTE} = '<name>' to let "
            "trials of identical architecture fuse"
        )
    return {"factory": key}
