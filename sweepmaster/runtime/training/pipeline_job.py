"""What a pipelined run uses of the job it drives: the trainer's per-shard interface.

A pipelined run (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP
mode, Li et al., VLDB 2022) is the same trainer as a job's shard tasks, only placed over several
devices: it drives a spilled job (one member or a fused array) through :class:`PipelinedJob`,
and through nothing else. Any trainer that offers these attributes and methods pipelines;
``mypy`` checks each place that hands one to a pipelined run.

Thread safety: a pipelined run calls these from one thread per device at once. The byte
counters (``swap_bytes``, ``p2p_bytes``, ``num_promotes``, ``num_demotes``) and the host
bookkeeping (``install``, ``uninstall``, ``host_tensor``, ``demote_state``, ...) are changed
under :attr:`PipelinedJob.counter_lock`; the passes of different shards run concurrently.

Shape legend: K members (a fused array), B batch, b microbatch, T tokens per block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.tasks import ShardTask, TensorKey

__all__ = ["PipelinedJob"]


class PipelinedJob(Protocol):
    """The job a pipelined run drives (see the module doc for the thread-safety contract).

    Attributes:
        plan: The job plan: its shards (their microbatch sizes) and the budgets they fit.
        counter_lock: Guards the byte counters and host bookkeeping (reentrant).
        swap_bytes: Bytes moved between the host and devices so far.
        p2p_bytes: Bytes moved device -> device so far.
        num_promotes: Shards promoted so far.
        num_demotes: Shards demoted so far.
        peak_device_bytes: The highest metered bytes of a device it ran on.
        device_name: The devices it ran on last (a pipeline's: every name, comma-separated).
        row_dim: The dimension of a boundary's rows (0; a fused array's ``(K, B, ...)``: 1).
    """

    plan: JobPlan
    swap_bytes: int
    p2p_bytes: int
    num_promotes: int
    num_demotes: int
    peak_device_bytes: int
    device_name: str
    row_dim: int

    # ------------------------------------------------------------------ its task chain

    @property
    def counter_lock(self) -> Any:
        """Guards the byte counters and host bookkeeping (reentrant)."""

    @property
    def name(self) -> str:
        """The job's name (for errors)."""

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran."""

    @property
    def clips(self) -> bool:
        """Whether its updates wait for the global gradient norm (``grad_clip``)."""

    def next_task(self) -> ShardTask | None:
        """The next task of its chain, or ``None`` at its end."""

    def take_tasks(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the chain, to run them together."""

    def start(self, device: Device, task: ShardTask) -> None:
        """Start the job before ``task``, its first."""

    def host_due(self, task: ShardTask) -> bool:
        """Whether ending ``task`` reads or changes the host copies (every shard home first)."""

    def end_tasks(self, task: ShardTask, device: Device) -> None:
        """The bookkeeping once ``task``, a step's or evaluation's last, ran."""

    def settle(self, device: Device) -> None:
        """Hand on what has nothing left to train once :meth:`next_task` is ``None``."""

    # ------------------------------------------------------------------ its tensors

    def shard_keys(self, shard: int) -> list[TensorKey]:
        """The tensors ``shard`` computes with (parameters, frozen tensors, buffers)."""

    def owned_keys(self, shard: int) -> list[TensorKey]:
        """The parameters ``shard`` updates (the first shard using each owns it)."""

    def trainable(self, key: TensorKey) -> bool:
        """Whether ``key`` is a parameter it trains."""

    def host_tensor(self, key: TensorKey) -> torch.Tensor:
        """The host copy of ``key``."""

    def install(self, keys: Sequence[TensorKey], copies: Sequence[torch.Tensor]) -> None:
        """Compute with ``copies`` (on a device) as the tensors ``keys``."""

    def installed(self, key: TensorKey) -> torch.Tensor:
        """The installed tensor ``key`` (its ``.grad``: the gradient after a backward)."""

    def uninstall(self, keys: Sequence[TensorKey], device: Device) -> None:
        """Put the host copies of ``keys`` back, writing back what an update changed."""

    def write_back_tensor(self, key: TensorKey, device: Device) -> None:
        """Write the installed ``key`` back to its host copy now, if an update changed it."""

    def release(self) -> None:
        """Write back what its shard tasks kept or prefetched on a device."""

    def promote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state to ``device``."""

    def demote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state on ``device`` back to the host, if there."""

    def state_on_device(self, shard: int) -> bool:
        """Whether the shard's optimizer state is on a device."""

    def to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on ``device``, counted in :attr:`swap_bytes` (any thread)."""

    # ------------------------------------------------------------------ a step

    def start_step(self, device: Device) -> None:
        """Start a training step: its minibatch and its dropout state."""

    def step_ids(self) -> torch.Tensor:
        """The step's token ids on the host, ``(B, T)`` (a fused array: ``(K, B, T)``)."""

    def step_targets(self) -> torch.Tensor | None:
        """The step's loss labels on the host, as :meth:`step_ids`; ``None``: the ids are."""

    def microbatches(self, shard: int, num_rows: int | None = None) -> list[slice]:
        """Row slices of ``shard``'s microbatches over a minibatch (or ``num_rows`` rows)."""

    def rows_of(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """``rows`` of ``tensor`` along :attr:`row_dim` (a view)."""

    def dropout_stream(self, state: torch.Tensor | None) -> JobRng | None:
        """The dropout stream a pack draws from, started from ``state`` (``None``: none)."""

    def set_dropout_state(self, state: torch.Tensor) -> None:
        """Continue the job's dropout stream from ``state`` (the last pack's)."""

    def forward_pass(self, shard: int, mb: int, rows: slice, x: torch.Tensor, device: Device,
                     rng: JobRng | None = None,
                     overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """Microbatch ``mb``'s forward of ``shard`` without grad: its output."""

    def backward_pass(self, shard: int, mb: int, rows: slice, x: torch.Tensor,
                      target: Callable[[], torch.Tensor], device: Device, weight: bool,
                      rng: JobRng | None = None,
                      overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                      ) -> torch.Tensor | None:
        """Microbatch ``mb``'s recompute and backward of ``shard``: its input's gradient."""

    def updates(self, shard: int) -> bool:
        """Whether ``shard`` owns parameters to update."""

    def update_shard(self, shard: int, device: Device,
                     clip_coef: torch.Tensor | None = None) -> None:
        """Harmony's just-in-time update of the shard's installed parameters."""

    def grad_norms(self, shard: int) -> dict[TensorKey, torch.Tensor]:
        """The 2-norms of the shard's owned gradients (0-dim; a fused array's ``(K,)``)."""

    def clip_coefficient(self, norms: Mapping[TensorKey, torch.Tensor],
                         device: Device) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient from every owned parameter's norm."""

    def park_grads(self, shard: int, device: Device) -> None:
        """Defer the shard's clipped update: its owned gradients go to the host."""

    def defer_clip(self, coef: torch.Tensor, device: Device) -> None:
        """Keep the step's clip coefficient on the host for the deferred updates."""

    def deferred(self, shard: int) -> bool:
        """Whether the shard's clipped update is deferred (applied when it comes in)."""

    def apply_deferred(self, shard: int, device: Device) -> None:
        """Apply the shard's deferred clipped update to its installed parameters."""

    def finish_step(self, device: Device, swap_bytes: int) -> None:
        """Record the step whose passes ran (its loss); ``swap_bytes`` it moved."""

    # ------------------------------------------------------------------ an evaluation

    def eval_ids(self) -> torch.Tensor:
        """The evaluation blocks on the host, ``(M, T)`` (a fused array: ``(K, M, T)``)."""

    def eval_targets(self) -> torch.Tensor | None:
        """The evaluation labels on the host, as :meth:`eval_ids`; ``None``: the ids are."""

    def eval_chunks(self, shard: int, num_rows: int) -> list[slice]:
        """Plain's evaluation batches, in ``shard``'s microbatches."""

    def evaluating(self) -> contextlib.AbstractContextManager[None]:
        """Evaluation mode (dropout off), its loss sum reset."""

    def eval_pass(self, shard: int, x: torch.Tensor, device: Device,
                  overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """An evaluation chunk's forward of ``shard`` (no grad)."""

    def add_eval_loss(self, logits: torch.Tensor, ids: torch.Tensor, device: Device) -> None:
        """Record an evaluation chunk's loss and tokens."""

    def finish_eval(self) -> None:
        """Record the evaluation whose passes ran."""
