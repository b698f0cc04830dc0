"""What a job trains: :class:`TrainSpec` in, :class:`TrainResult` out.

Values crossing from ``sweep.py`` / the Python API into ``runtime/``. Token data are tensors of
fixed-length blocks, shape ``(N, T)``: N blocks of T token ids (int64).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeAlias

import torch
from torch import nn
from transformers import PretrainedConfig

__all__ = ["LoraSpec", "MetricPoint", "ModelSource", "OptimizerSpec", "TrainResult", "TrainSpec"]

#: A model to train: a factory returning a fresh ``nn.Module`` (called after seeding), a
#: HuggingFace config (random init of its causal LM), or a local directory (never the hub) of a
#: pretrained causal LM. A plain module's ``forward(input_ids (B, T)) `` must return logits
#: ``(B, T, V)`` or an object with a ``.logits`` attribute.
ModelSource: TypeAlias = Callable[[], nn.Module] | PretrainedConfig | str | os.PathLike


@dataclass
class OptimizerSpec:
    """Optimizer and learning-rate schedule of one job.

    Attributes:
        name: ``"adamw"`` (``torch.optim.AdamW``) or ``"sgd"`` (``torch.optim.SGD``).
        lr: Peak learning rate.
        weight_decay: Decoupled (AdamW) or L2 (SGD) weight decay.
        betas: AdamW's ``(beta1, beta2)``.
        eps: AdamW's epsilon.
        momentum: SGD momentum.
        nesterov: SGD Nesterov momentum.
        warmup_steps: Linear warmup from 0 to ``lr`` over this many steps.
        schedule: After warmup: ``"constant"``, ``"linear"`` decay to 0 at the last step, or
            ``"cosine"`` decay to 0 at the last step.
        grad_clip: Max global gradient norm, or ``None`` for no clipping.
    """

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: float | None = None


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
            only at step 0 and at the end.
        eval_max_blocks: Evaluate on at most this many validation blocks (the first ones);
            ``None``: all of them.
        metric: The objective: ``"eval_loss"``, ``"eval_perplexity"`` or ``"train_loss"``.
        seed: Seeds model init, data order and dropout.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` parameter dtype.
        name: A label for progress events (e.g. ``"trial-3"``).
        checkpoint_dir: Directory to save the final weights to, or ``None`` to not save.
        state_dir: Directory of the job's training-state checkpoints
            (:mod:`sweepmaster.runtime.training.checkpoint`), owned by this job. When it holds an
            intact checkpoint of this job, training resumes from the newest one; ``None``: always
            start from step 0 and write no training state.
        checkpoint_every: Write a training-state checkpoint to ``state_dir`` after every this
            many optimizer steps (after that step's evaluation, if one is due); ``None``: never
            write one (an existing one is still resumed from).
        keep_checkpoints: Training-state checkpoints kept in ``state_dir`` (the newest ones;
            more than one leaves something to fall back to if the newest is damaged).
        peft: Train a LoRA adapter over the frozen model instead of all its weights
            (:class:`LoraSpec`); ``None``: full fine-tuning.
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
    metric: Literal["eval_loss", "eval_perplexity", "train_loss"] = "eval_loss"
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    name: str = "job"
    checkpoint_dir: Path | None = None
    state_dir: Path | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    peft: LoraSpec | None = None

    def __post_init__(self) -> None:
        if self.train_data.dim() != 2:
            raise ValueError(
                f"train_data must be (N, T) token blocks, got shape {tuple(self.train_data.shape)}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.train_data.shape[0] < self.batch_size:
            raise ValueError(
                f"train_data has {self.train_data.shape[0]} blocks, fewer than one batch of "
                f"{self.batch_size}"
            )
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 or None, got {self.checkpoint_every}")
        if self.checkpoint_every is not None and self.state_dir is None:
            raise ValueError("checkpoint_every needs a state_dir to write checkpoints to")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")

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
