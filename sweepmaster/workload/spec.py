"""What a job trains: :class:`TrainSpec` in, :class:`TrainResult` out.

Values crossing from ``sweep.py`` / the Python API into ``runtime/``. Token data are tensors of
fixed-length blocks, shape ``(N, T)``: N blocks of T token ids (int64). A **loss mask** beside
them, bool ``(N, T)``, says which tokens count as targets (completion or assistant tokens, not
prompt or padding): ``mask[n, t]`` is whether token ``t`` of block ``n`` is predicted by the
loss (position ``t - 1`` predicts it; ``mask[n, 0]`` is never used). The trainer turns ids and
mask into transformers' labels, the ids with :data:`IGNORED_TARGET` where the mask is false
(:func:`loss_targets`), so its loss is transformers' own.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, get_args

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from sweepmaster.errors import DataError
from sweepmaster.workload.choices import Dtype, Metric, OptimizerName, Schedule
from sweepmaster.workload.families import FAMILIES
from sweepmaster.workload.hub import HubRevisionError, Snapshot, resolve, snapshot_revision

__all__ = ["IGNORED_TARGET", "LoraSpec", "MetricPoint", "ModelSource", "OptimizerSpec",
           "TrainResult", "TrainSpec", "loss_targets"]

#: A label the loss skips: transformers' (and ``F.cross_entropy``'s) ``ignore_index``.
IGNORED_TARGET = -100

#: A model to train: a factory returning a fresh ``nn.Module`` (called after seeding), a
#: HuggingFace config (random init of its causal LM), or a pretrained causal LM: a local
#: directory or a HuggingFace hub id (resolved to its snapshot in the HuggingFace cache,
#: :mod:`sweepmaster.workload.hub`). A plain module's ``forward(input_ids (B, T)) `` must return
#: logits ``(B, T, V)`` or an object with a ``.logits`` attribute.
ModelSource: TypeAlias = Callable[[], nn.Module] | PretrainedConfig | str | os.PathLike

@dataclass
class OptimizerSpec:
    """Optimizer and learning-rate schedule of one job.

    Attributes:
        name: ``"adamw"`` (``torch.optim.AdamW``), ``"sgd"`` (``torch.optim.SGD``) or
            ``"lion"`` (``lion_pytorch.Lion``).
        lr: Peak learning rate.
        weight_decay: Decoupled (AdamW, Lion) or L2 (SGD) weight decay.
        betas: AdamW's or Lion's ``(beta1, beta2)``.
        eps: AdamW's epsilon.
        momentum: SGD momentum.
        nesterov: SGD Nesterov momentum.
        warmup_steps: Linear warmup from 0 to ``lr`` over this many steps.
        schedule: After warmup: ``"constant"``, ``"linear"`` decay to 0 at the last step, or
            ``"cosine"`` decay to 0 at the last step.
        grad_clip: Max global gradient norm, or ``None`` for no clipping.

    Raises:
        ValueError: An unknown ``name`` or ``schedule``; a negative or non-finite ``lr``,
            ``weight_decay``, ``eps`` or ``momentum``; ``betas`` not two numbers in ``[0, 1)``;
            ``nesterov`` for SGD without ``momentum``; a negative ``warmup_steps``; a
            ``grad_clip`` that is not ``None`` or > 0.
        TypeError: A number that is not an ``int`` or ``float`` (e.g. ``lr="1e-3"``).
    """

    name: OptimizerName = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    warmup_steps: int = 0
    schedule: Schedule = "constant"
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        _check_choice("OptimizerSpec.name", self.name, OptimizerName)
        _check_choice("OptimizerSpec.schedule", self.schedule, Schedule)
        for name in ("lr", "weight_decay", "eps", "momentum"):
            _check_number(f"OptimizerSpec.{name}", getattr(self, name), "a finite number >= 0",
                          lambda x: x >= 0)
        betas = self.betas
        if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"OptimizerSpec.betas must be two numbers (beta1, beta2) in [0, 1), "
                             f"got {betas!r}")
        for index, beta in enumerate(betas):
            _check_number(f"OptimizerSpec.betas[{index}]", beta, "a number in [0, 1)",
                          lambda x: 0 <= x < 1)
        self.betas = (betas[0], betas[1])
        if self.name == "sgd" and self.nesterov and not self.momentum > 0:
            raise ValueError("OptimizerSpec.nesterov=True needs momentum > 0 (SGD's Nesterov "
                             f"momentum), got momentum={self.momentum!r}")
        _check_int("OptimizerSpec.warmup_steps", self.warmup_steps, 0)
        if self.grad_clip is not None:
            _check_number("OptimizerSpec.grad_clip", self.grad_clip,
                          "a finite number > 0 or None", lambda x: x > 0)


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter trained over a frozen base (Hu et al., 2021, https://arxiv.org/abs/2106.09685).

    Each targeted linear layer ``W`` of the base gets a trainable low-rank update: its output
    becomes ``W x + (alpha / r) * B A dropout(x)`` with ``A`` of shape ``(r, in)`` (Kaiming
    uniform init) and ``B`` of shape ``(out, r)`` (zero init), so training starts from the
    base's function. Only ``A`` and ``B`` get gradients and optimizer state. The adapter is
    built, matched to modules, initialized and saved by HuggingFace PEFT
    (:mod:`sweepmaster.workload.adapters`).

    Attributes:
        r: Rank of the update, >= 1.
        alpha: Scale numerator (``lora_alpha``); the update is scaled by ``alpha / r``; > 0.
        dropout: Dropout probability on the adapter's input, in ``[0, 1)``.
        target_modules: Module names (or name suffixes) to adapt, as PEFT matches them
            (e.g. ``("c_attn", "c_proj")`` for GPT-2); ``None``: PEFT's default for the
            model type (GPT-2: ``c_attn``).

    Raises:
        ValueError: ``r < 1``, ``alpha <= 0``, ``dropout`` outside ``[0, 1)`` or an empty
            ``target_modules``.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA rank r must be an integer >= 1, got {self.r!r}")
        if not self.alpha > 0 or not math.isfinite(self.alpha):
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None:
            if isinstance(self.target_modules, str) or not self.target_modules:
                raise ValueError("LoRA target_modules must be a non-empty sequence of module "
                                 f"names or None, got {self.target_modules!r}")
            object.__setattr__(self, "target_modules", tuple(self.target_modules))


@dataclass
class TrainSpec:
    """Everything needed to train one trial.

    Attributes:
        model: What to train, see :data:`ModelSource`.
        train_data: Training blocks, int64 ``(N, T)``.
        eval_data: Validation blocks, int64 ``(M, T)``, or ``None`` (then the objective is the
            last train loss).
        optimizer: Optimizer and schedule.
        batch_size: Blocks per optimizer step (the minibatch).
        epochs: Passes over ``train_data``; ignored when ``max_steps`` is set.
        max_steps: Optimizer steps to run; overrides ``epochs``.
        eval_every: Evaluate every this many steps (also at step 0 and at the end); ``None``:
            only at step 0 and at the end. Without ``eval_data`` nothing is evaluated (and
            nothing is reported to an Optuna trial, so its pruner never stops the job).
        eval_max_blocks: Evaluate on at most this many validation blocks (the first ones);
            ``None``: all of them.
        metric: The objective: ``"eval_loss"``, ``"eval_perplexity"`` or ``"train_loss"``.
        seed: Seeds model init, data order and dropout.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` parameter dtype.
        name: A label for progress events (e.g. ``"trial-3"``).
        checkpoint_dir: Directory to save the final weights to, or ``None`` to not save.
        state_dir: Directory of the job's training-state checkpoints
            (:mod:`sweepmaster.runtime.training.training_state`), owned by this job. When it
            holds an intact checkpoint of this job, training resumes from the newest one;
            ``None``: always start from step 0 and write no training state.
        checkpoint_every: Write a training-state checkpoint to ``state_dir`` after every this
            many optimizer steps (after that step's evaluation, if one is due); ``None``: never
            write one (an existing one is still resumed from).
        keep_checkpoints: Training-state checkpoints kept in ``state_dir`` (the newest ones;
            more than one leaves something to fall back to if the newest is damaged).
        peft: Train a LoRA adapter over the frozen model instead of all its weights
            (:class:`LoraSpec`); ``None``: full fine-tuning.
        revision: With a hub id in ``model``: the branch, tag or commit to train (default
            ``main``). The id is resolved here, once: ``model`` becomes the local snapshot
            folder (``.../snapshots/<sha>``) and ``revision`` its commit sha.
        train_mask: The loss mask of ``train_data``, bool ``(N, T)`` (see the module doc);
            ``None``: every token but each block's first is a target.
        eval_mask: The loss mask of ``eval_data``, bool ``(M, T)``, or ``None``.

    Everything is checked here, before anything trains; each error names the attribute and
    what it takes.

    Raises:
        TypeError: ``model`` is a built ``nn.Module`` (give a factory) or no model source;
            ``train_data`` / ``eval_data`` is not an int64 tensor; ``optimizer`` is not an
            :class:`OptimizerSpec`, ``peft`` not a :class:`LoraSpec`; a count is not an ``int``.
        ValueError: ``train_data`` / ``eval_data`` is not ``(N, T)`` with N >= 1 and T >= 2,
            holds token ids outside ``[0, vocab_size)`` of an HF model, or has blocks longer
            than its learned position table (GPT-2's ``n_positions``, OPT's
            ``max_position_embeddings``); a mask that is not bool of its data's shape, or
            with a block that has no target (nothing for its loss to average);
            ``batch_size`` < 1 or more than N; ``epochs`` <= 0;
            ``max_steps``, ``eval_every`` or ``eval_max_blocks`` < 1; an unknown ``metric`` or
            ``dtype``; ``checkpoint_every`` < 1 or without ``state_dir``;
            ``keep_checkpoints`` < 1; a ``revision`` with a directory in ``model``.
        DataError: ``model`` is neither a directory nor a hub id that can be had (unknown,
            gated, not in the cache while ``HF_HUB_OFFLINE`` is set, no such ``revision``), or
            its config cannot be loaded.
    """

    model: ModelSource
    train_data: torch.Tensor
    eval_data: torch.Tensor | None = None
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    batch_size: int = 8
    epochs: float = 1.0
    max_steps: int | None = None
    eval_every: int | None = None
    eval_max_blocks: int | None = None
    metric: Metric = "eval_loss"
    seed: int = 0
    dtype: Dtype = "float32"
    name: str = "job"
    checkpoint_dir: Path | None = None
    state_dir: Path | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    peft: LoraSpec | None = None
    revision: str | None = None
    train_mask: torch.Tensor | None = None
    eval_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, (str, os.PathLike)):
            snapshot = _resolve_model(self.model, self.revision)  # the folder from here on
            self.model, self.revision = str(snapshot.path), snapshot.revision
        config = _check_model(self.model)
        _check_blocks("train_data", self.train_data, config)
        _check_mask("train_mask", self.train_mask, self.train_data)
        if self.eval_data is not None:
            _check_blocks("eval_data", self.eval_data, config)
            _check_mask("eval_mask", self.eval_mask, self.eval_data)
        elif self.eval_mask is not None:
            raise ValueError("eval_mask needs eval_data to mask")
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError("optimizer must be an OptimizerSpec, e.g. "
                            f"OptimizerSpec(name='adamw', lr=1e-3), got {self.optimizer!r}")
        if self.peft is not None and not isinstance(self.peft, LoraSpec):
            raise TypeError(f"peft must be a LoraSpec or None, got {self.peft!r}")
        _check_int("batch_size", self.batch_size, 1)
        if self.train_data.shape[0] < self.batch_size:
            raise ValueError(
                f"train_data has {self.train_data.shape[0]} blocks, fewer than one batch of "
                f"{self.batch_size}"
            )
        _check_number("epochs", self.epochs, "a finite number > 0", lambda x: x > 0)
        for name in ("max_steps", "eval_every", "eval_max_blocks"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, "or None")
        _check_choice("metric", self.metric, Metric)
        _check_choice("dtype", self.dtype, Dtype)
        _check_int("seed", self.seed, None)
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 or None, got {self.checkpoint_every}")
        if self.checkpoint_every is not None and self.state_dir is None:
            raise ValueError("checkpoint_every needs a state_dir to write checkpoints to")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")

    @functools.cached_property
    def train_targets(self) -> torch.Tensor:
        """The training labels, int64 ``(N, T)``: :func:`loss_targets` of data and mask."""
        return loss_targets(self.train_data, self.train_mask)

    @functools.cached_property
    def eval_targets(self) -> torch.Tensor | None:
        """The evaluation labels ``(M, T)`` (:func:`loss_targets`), or ``None``."""
        if self.eval_data is None:
            return None
        return loss_targets(self.eval_data, self.eval_mask)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch (the last partial batch is dropped)."""
        return int(self.train_data.shape[0]) // self.batch_size

    @property
    def total_steps(self) -> int:
        """Optimizer steps the job runs: ``max_steps``, else ``ceil(epochs * steps_per_epoch)``."""
        if self.max_steps is not None:
            return self.max_steps
        return max(1, math.ceil(self.epochs * self.steps_per_epoch))

    @property
    def tokens_per_step(self) -> int:
        """Training tokens in one minibatch, ``batch_size * T``."""
        return self.batch_size * int(self.train_data.shape[1])


@dataclass(frozen=True)
class MetricPoint:
    """One recorded value: ``name`` (e.g. ``"train_loss"``) at optimizer step ``step``."""

    step: int
    name: str
    value: float


@dataclass
class TrainResult:
    """What training one job produced.

    Attributes:
        objective: Final value of ``TrainSpec.metric`` (nan if the job stopped before any).
        metrics: Every recorded point, in order: ``train_loss``, ``lr``, ``tokens_per_s`` per
            step; ``eval_loss`` and ``eval_perplexity`` per evaluation.
        state_dict: The trained weights, on the host (CPU tensors).
        steps: Optimizer steps run.
        tokens: Training tokens processed.
        train_seconds: Wall-clock seconds spent in training and evaluation.
        pruned: ``True`` if a callback stopped the job early.
        checkpoint_path: Where the final weights were saved, or ``None``.
        device: The device it ran on (the last one, for a spilled job; a pipelined job's
            devices in pack order, comma-separated).
        swap_bytes: Bytes copied between host and devices (0 for plain training).
        p2p_bytes: Bytes copied device -> device (a pipelined job's boundaries; not part of
            ``swap_bytes``).
        num_promotes: Shard promotions (host -> device) of a spilled job.
        num_demotes: Shard demotions (device -> host) of a spilled job.
        peak_device_bytes: Highest metered device memory (bytes) while it ran, or ``None`` when
            the device is not metered.
        num_replans: Times the executor re-planned the job with less memory after it ran out
            of device memory in its first step (the result is that of its last plan).
    """

    objective: float
    metrics: list[MetricPoint]
    state_dict: dict[str, torch.Tensor]
    steps: int
    tokens: int
    train_seconds: float
    pruned: bool = False
    checkpoint_path: Path | None = None
    device: str = "cpu"
    swap_bytes: int = 0
    num_promotes: int = 0
    num_demotes: int = 0
    peak_device_bytes: int | None = None
    p2p_bytes: int = 0
    num_replans: int = 0

    def history(self, name: str) -> list[tuple[int, float]]:
        """Return ``[(step, value), ...]`` of one metric, in step order."""
        return [(p.step, p.value) for p in self.metrics if p.name == name]


def loss_targets(ids_NT: torch.Tensor, mask_NT: torch.Tensor | None) -> torch.Tensor:
    """The labels transformers takes: the ids, :data:`IGNORED_TARGET` where a token does not count.

    Args:
        ids_NT: Token ids, int64 ``(N, T)``.
        mask_NT: Loss mask, bool ``(N, T)``, or ``None`` (every token counts).

    Returns:
        ``ids_NT`` itself without a mask, else a new int64 ``(N, T)`` tensor.
    """
    if mask_NT is None:
        return ids_NT
    return ids_NT.masked_fill(~mask_NT, IGNORED_TARGET)


def _check_mask(name: str, mask_NT: Any, blocks_NT: torch.Tensor) -> None:
    """A loss mask: bool, its blocks' shape, at least one target per block (not token 0)."""
    if mask_NT is None:
        return
    if not isinstance(mask_NT, torch.Tensor) or mask_NT.dtype != torch.bool:
        got = mask_NT.dtype if isinstance(mask_NT, torch.Tensor) else type(mask_NT).__name__
        raise TypeError(f"{name} must be a bool tensor (True: the token is a target), got {got}")
    if mask_NT.shape != blocks_NT.shape:
        raise ValueError(f"{name} must have its data's shape {tuple(blocks_NT.shape)}, got "
                         f"{tuple(mask_NT.shape)}")
    empty = (~mask_NT[:, 1:].any(dim=1)).nonzero()
    if empty.numel():
        raise ValueError(f"{name}: block {int(empty[0, 0])} has no target (every token after "
                         "its first is masked out); drop such blocks")


def _check_choice(name: str, value: Any, choices: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is one of the ``Literal`` type ``choices``."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _check_number(name: str, value: Any, expected: str, holds: Callable[[float], bool]) -> None:
    """Raise unless ``value`` is a finite real number (not a bool) for which ``holds``."""
    # numbers.Real: Python and NumPy scalars alike (Optuna's suggestions, np.float64)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if not math.isfinite(float(value)) or not holds(float(value)):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_int(name: str, value: Any, minimum: int | None, extra: str = "") -> None:
    """Raise unless ``value`` is an ``int`` (not a bool) of at least ``minimum``."""
    expected = "an integer" + (f" >= {minimum}" if minimum is not None else "")
    expected += f" {extra}" if extra else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value}")


def _resolve_model(source: str | os.PathLike[str], revision: str | None) -> Snapshot:
    """:func:`~sweepmaster.workload.hub.resolve` of ``TrainSpec.model``, errors naming it."""
    if revision is not None and Path(source).is_dir() and snapshot_revision(source) != revision:
        raise ValueError(f"TrainSpec.revision is only for a hub id in TrainSpec.model, got "
                         f"{revision!r} with the directory {source}")
    try:
        return resolve(source, revision)
    except HubRevisionError as exc:
        raise HubRevisionError(f"TrainSpec.revision: a branch, tag or commit of {source} that "
                               f"can be had, got {exc}") from None
    except DataError as exc:
        raise DataError(f"TrainSpec.model: a directory saved with save_pretrained or a "
                        f"HuggingFace hub id, got {exc}") from None


def _check_model(source: Any) -> PretrainedConfig | None:
    """Check ``TrainSpec.model``; return its HF config (loaded for a directory), or ``None``.

    Raises:
        TypeError: A built module (a factory is needed) or no model source at all.
        DataError: A directory without a loadable config.
    """
    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        try:
            config: PretrainedConfig = AutoConfig.from_pretrained(str(source),
                                                                  local_files_only=True)
        except (OSError, ValueError) as err:
            raise DataError(f"{source}: cannot load a model config: {err}") from err
        return config
    if isinstance(source, nn.Module):
        raise TypeError(f"model must be a factory returning a fresh nn.Module (e.g. "
                        f"model=lambda: {type(source).__name__}(...)), not a built "
                        f"{type(source).__name__}: each job builds its own after seeding")
    if not callable(source):
        raise TypeError("model must be a HuggingFace config, a save_pretrained directory or a "
                        f"factory returning an nn.Module, got {type(source).__name__}")
    return None


def _check_blocks(name: str, blocks_NT: Any, config: PretrainedConfig | None) -> None:
    """Check token blocks: an int64 ``(N, T)`` tensor, N >= 1, T >= 2, ids the model can take.

    With an HF ``config``, every id must be in ``[0, vocab_size)`` and T within a learned
    position table (:attr:`~sweepmaster.workload.families.Family.positions`; rotary families
    take any T).
    """
    if not isinstance(blocks_NT, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64 token ids, shape (N, T), got "
                        f"{type(blocks_NT).__name__} (convert with torch.as_tensor)")
    if blocks_NT.dtype != torch.int64:
        raise TypeError(f"{name} must hold int64 token ids, got dtype {blocks_NT.dtype} "
                        "(convert with .long())")
    if blocks_NT.dim() != 2 or blocks_NT.shape[0] < 1 or blocks_NT.shape[1] < 2:
        raise ValueError(f"{name} must be (N, T) token blocks: N >= 1 blocks of T >= 2 tokens "
                         "(the loss predicts token t + 1 from t), got shape "
                         f"{tuple(blocks_NT.shape)}")
    if config is None:
        return
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int):
        low, high = int(blocks_NT.min()), int(blocks_NT.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary "
                             f"[0, {vocab_size}) (config.vocab_size = {vocab_size}; was the data "
                             "tokenized with another tokenizer?)")
    family = FAMILIES.get(getattr(config, "model_type", ""))
    max_positions = getattr(config, "max_position_embeddings", None)
    if family is not None and family.positions is not None and isinstance(max_positions, int) \
            and blocks_NT.shape[1] > max_positions:
        raise ValueError(f"{name} blocks have T = {blocks_NT.shape[1]} tokens, more than the "
                         f"model's {max_positions} positions (config.max_position_embeddings; "
                         "GPT-2's n_positions): make shorter blocks or raise it")
