r"""The one way a sweep file becomes :class:`~sweepmaster.workload.spec.TrainSpec`\ s.

``launch`` (:mod:`sweepmaster.sweep.run`) and the ``plan`` dry run (:mod:`sweepmaster.sweep.plan`)
both build a trial's spec here, so what the dry run plans is what the launch trains: they differ
only in the token data they give (the tokenized text, or stand-in zeros of its shape).

Example:
    >>> config = load_sweep_config("examples/quickstart.yaml")  # doctest: +SKIP
    >>> specs = TrialSpecs(config, lambda trial: prepare_data(trial))  # doctest: +SKIP
    >>> specs({"train.lr": 1e-3}, name="trial-0").optimizer.lr  # doctest: +SKIP
    0.001
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sweepmaster.config.schema import SweepConfig
from sweepmaster.workload import (
    OptimizerSpec,
    TrainSpec,
    find_splits,
    load_tokenizer,
    make_blocks,
    model_config_from_mapping,
    tokenize_files,
)

__all__ = ["TokenData", "TrialSpecs", "prepare_data", "train_spec_from_config", "widest_member"]


@dataclass(frozen=True)
class TokenData:
    """Tokenized blocks of one data configuration: ``train`` ``(N, T)``, ``valid`` ``(M, T)``.

    ``train_mask`` / ``valid_mask``: their bool loss masks (``None``: every token counts).
    """

    train: torch.Tensor
    valid: torch.Tensor | None
    vocab_size: int
    train_mask: torch.Tensor | None = None
    valid_mask: torch.Tensor | None = None


def prepare_data(config: SweepConfig,
                 on_tokenize: Callable[[], None] | None = None) -> TokenData:
    """Tokenize (or load from the cache) the sweep's train and validation text into blocks.

    ``on_tokenize`` is called before each file set (or ``data.dataset`` split) the cache does
    not hold is tokenized. A ``data.dataset`` gives loss masks too
    (:func:`~sweepmaster.workload.hfdata.prepare_dataset`).

    Raises:
        DataError: A file or the tokenizer is missing, or the text is shorter than one block.
        ConfigError: A ``data.dataset`` that cannot be loaded or has no such field or split.
    """
    data = config.data
    tokenizer = config.tokenizer_snapshot().path  # a hub id: its snapshot, resolved once
    if data.dataset is not None:
        from sweepmaster.workload.hfdata import prepare_dataset

        loaded = load_tokenizer(tokenizer)
        blocks = prepare_dataset(data, loaded, config.source, on_tokenize=on_tokenize)
        return TokenData(blocks.train, blocks.valid, len(loaded), blocks.train_mask,
                         blocks.valid_mask)
    if data.dir is not None:
        splits = find_splits(data.dir)
        train_files, valid_files = [splits["train"]], [splits["valid"]]
    else:
        assert data.train_files is not None
        train_files, valid_files = list(data.train_files), list(data.valid_files or [])
    train_ids = tokenize_files(train_files, tokenizer, max_tokens=data.max_train_tokens,
                               cache_dir=data.cache_dir, on_tokenize=on_tokenize)
    valid = None
    if valid_files:
        valid_ids = tokenize_files(valid_files, tokenizer, max_tokens=data.max_eval_tokens,
                                   cache_dir=data.cache_dir, on_tokenize=on_tokenize)
        valid = make_blocks(valid_ids, data.block_size)
    vocab_size = len(load_tokenizer(tokenizer))
    return TokenData(make_blocks(train_ids, data.block_size), valid, vocab_size)


def train_spec_from_config(config: SweepConfig, data: TokenData, name: str = "job",
                           checkpoint_dir: Path | None = None,
                           state_dir: Path | None = None) -> TrainSpec:
    """Turn one trial's resolved config into the runtime's :class:`TrainSpec`.

    ``state_dir``: the trial's training-state directory (resumed from if it holds a checkpoint
    of the same job; written every ``train.checkpoint_every`` steps); ``None``: no checkpoints.
    """
    model = config.model
    source: Any
    if model.config is not None:
        source = model_config_from_mapping(model.config, vocab_size=data.vocab_size)
    else:
        snapshot = config.pretrained_snapshot()  # a hub id: its snapshot, resolved once
        assert snapshot is not None
        source = str(snapshot.path)
    train = config.train
    optimizer = OptimizerSpec(
        name=train.optimizer, lr=train.lr, weight_decay=train.weight_decay,
        betas=(train.betas[0], train.betas[1]), momentum=train.momentum,
        warmup_steps=train.warmup_steps, schedule=train.schedule, grad_clip=train.grad_clip,
    )
    return TrainSpec(
        model=source, train_data=data.train, eval_data=data.valid, optimizer=optimizer,
        batch_size=train.batch_size, epochs=train.epochs, max_steps=train.max_steps,
        eval_every=train.eval_every, metric=config.study.metric, seed=train.seed,
        dtype=model.dtype, name=name, checkpoint_dir=checkpoint_dir, state_dir=state_dir,
        checkpoint_every=train.checkpoint_steps() if state_dir is not None else None,
        peft=None if model.peft is None else model.peft.lora_spec(),
        train_mask=data.train_mask, eval_mask=data.valid_mask,
    )


def widest_member(config: SweepConfig, spec: TrainSpec) -> TrainSpec:
    """The trial a fused array of ``spec``'s group is sized for: as wide as any the sweep asks.

    Trials of one fusion group share the model, its shapes and the optimizer kind; what else
    changes a member's bytes is per member: a LoRA adapter's rank and dropout, SGD momentum.
    A fused array is padded to its widest member (:func:`~sweepmaster.runtime.training.\
fused_shards.stacked_spec`), members that join it later included, so its K is chosen
    (``Executor.fusion_choice``) for ``spec`` with the largest ``model.peft.r``,
    ``model.peft.dropout`` and ``train.momentum`` the search space allows (the largest of
    ``values:``, a range's ``max``): K such members fit the device, whichever trials of the
    sweep fill the array. ``spec`` itself when the space sweeps none of them wider.
    """
    def widest(value: float, path: str) -> float:
        return max(value, config.largest_value(path) or value)

    peft = spec.peft if spec.peft is None else dataclasses.replace(
        spec.peft, r=int(widest(spec.peft.r, "model.peft.r")),
        dropout=widest(spec.peft.dropout, "model.peft.dropout"))
    optimizer = dataclasses.replace(spec.optimizer,
                                    momentum=widest(spec.optimizer.momentum, "train.momentum"))
    if peft == spec.peft and optimizer == spec.optimizer:
        return spec
    return dataclasses.replace(spec, peft=peft, optimizer=optimizer)


class TrialSpecs:
    """Builds the TrainSpec of each parameter set of a sweep, from the data ``data`` gives.

    Args:
        config: The sweep.
        data: A trial's config -> its token data: :func:`prepare_data` at launch, stand-in
            zeros of the same shapes in the dry run. Called for every spec; it caches what
            it must.
    """

    def __init__(self, config: SweepConfig, data: Callable[[SweepConfig], TokenData]) -> None:
        self.config = config
        self.data = data

    def __call__(self, params: Mapping[str, Any], name: str = "job",
                 state_dir: Path | None = None) -> TrainSpec:
        """The spec of the trial with ``params`` (dotted path -> value).

        Raises:
            ConfigError: ``params`` make an invalid config (:meth:`SweepConfig.with_params`).
        """
        trial = self.config.with_params(params)
        return train_spec_from_config(trial, self.data(trial), name, state_dir=state_dir)
