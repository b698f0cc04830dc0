"""The members part of a spilled job: what its other parts read of the members it trains.

A job trains K >= 1 members through one trainer
(:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`); its parts (the shard
store, the per-shard compute, the planned passes, the bookkeeping) read the members through
:class:`ShardMembers` and through nothing else. Two implementations:

* one member (:class:`~sweepmaster.runtime.training.spill.ModuleMember`): the model's module
  run directly, its parameters and buffers the tensors the job computes with (K = 1 keeps
  ``torch``'s own kernels: on CUDA, flash attention);
* K stacked members (:class:`~sweepmaster.runtime.training.fused_spill.FusedMembers`, holding
  a :class:`~sweepmaster.runtime.training.fused_members.StackedMembers` as its ``stacked``
  part: the stacking, joins and leaves): their tensors stacked ``(K, ...)`` and run through a
  template under ``vmap`` (HFTA).

Tensors are named by a :data:`~sweepmaster.runtime.training.tasks.TensorKey`; a stacked array's
rows sit after its member dimension (``row_dim`` 1), its losses, norms and clip coefficients
are per member ``(K,)``.

Shape legend: B batch, b microbatch, T tokens per block, V vocabulary, K members, M eval blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.member_runs import MemberRun
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.shard_store import ShardTensors
from sweepmaster.runtime.training.tasks import ShardTask, TensorKey
from sweepmaster.runtime.training.training_state import TrainingState

if TYPE_CHECKING:
    from sweepmaster.runtime.training.shard_trainer import ShardTrainer

__all__ = ["ShardMembers"]


class ShardMembers(ShardTensors, Protocol):
    """What a job's parts read of its members (one module, or K stacked members).

    Besides its tensors (:class:`~sweepmaster.runtime.training.shard_store.ShardTensors`, what
    the shard store reads): a shard's layers and their forward, the dropout mode of a pass,
    the members' loss, gradient norms, clip coefficients and optimizer steps.
    """

    #: Dimension of the rows in token ids and host boundaries: 0 for one member's
    #: ``(B, ...)``, 1 for a fused array's ``(K, B, ...)``.
    row_dim: int
    #: Whether a member's failure fails it alone (a fused array) or the job (K = 1: the
    #: member's error is raised).
    fail_alone: bool
    #: The current step's per-member epoch and learning rate (:meth:`start_step`).
    epochs: list[int]
    lrs: list[float]
    #: Prefetch only the task right after the current one within a training step (a fused
    #: array: members leave it between steps); else any task of the job's.
    prefetches_within_step: bool

    @property
    def runs(self) -> list[MemberRun]:
        """Every trial the job trains (K = 1: one), in order of :attr:`MemberRun.index`."""
        ...

    @property
    def live(self) -> list[MemberRun]:
        """The trials still training: ``live[k]`` is member k of the job's stacked tensors."""
        ...

    @property
    def fresh_shards(self) -> set[int]:
        """Shards whose optimizer state is all zeros still when the members are built.

        Made before any update: their first promote copies nothing.
        """
        ...

    def bind(self, job: ShardTrainer) -> None:
        """Be the members part of ``job``, whose parts exist now (called once, by the job)."""
        ...

    # ------------------------------------------------------------------ the task sequence

    @property
    def name(self) -> str:
        """The job's name (a fused array's: its first member's)."""
        ...

    @property
    def step(self) -> int:
        """Optimizer steps the job finished (a fused array's: in this run)."""
        ...

    @property
    def stopped(self) -> bool:
        """Whether the job stopped before its task sequence ends (pruned, every member left)."""
        ...

    @property
    def num_steps(self) -> int:
        """The step the job trains to (a fused array's: in this run)."""
        ...

    def evaluates_after(self, step: int) -> bool:
        """Whether some member evaluates after ``step`` (at the sequence's first: before it)."""
        ...

    def settles_after(self, step: int) -> bool:
        """Whether some member ends or writes a checkpoint after ``step``."""
        ...

    def settle(self, device: Device) -> None:
        """Hand on what has nothing left to train, the task sequence ended (a fused array's)."""
        ...

    # ------------------------------------------------------------------ a step

    def start_step(self, device: Device) -> None:
        """Start a training step: its minibatch (plain's data order) and its dropout state."""
        ...

    def step_ids(self) -> torch.Tensor:
        """The step's token ids on the host, ``(B, T)`` (a fused array: ``(K, B, T)``)."""
        ...

    def task_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """What a task runs in, from its promote to its demote (a job's dropout stream)."""
        ...

    def compute_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """What a task's compute runs in, between its promote and demote (metering)."""
        ...

    @property
    def clips(self) -> bool:
        """Whether some member clips its gradients (``grad_clip``): updates wait for the norm."""
        ...

    def owned_keys(self, shard: int) -> list[TensorKey]:
        """The parameters ``shard`` updates (it owns them: the first shard using each)."""
        ...

    def labels(self) -> torch.Tensor:
        """The step's token ids on the host, the whole minibatch (``(B, T)``, ``(K, B, T)``)."""
        ...

    def step_targets(self) -> torch.Tensor | None:
        """The step's loss labels on the host, as the token ids; ``None``: the ids are.

        With a loss mask (:attr:`~sweepmaster.workload.spec.TrainSpec.train_mask`): the ids
        with :data:`~sweepmaster.workload.spec.IGNORED_TARGET` where a token does not count.
        """
        ...

    def layer_calls(self, shard: int, rows: slice,
                    device: Device) -> tuple[list[Layer], list[list[torch.Tensor]]]:
        """The shard's layers on microbatch ``rows`` and, per layer, its resident tensors.

        Each layer is a callable of its input; the resident tensors (parameters and buffers on
        the device) are what its saved tensors may name instead of copying them.
        """
        ...

    def pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
                  site: int = 0, rng: JobRng | None = None,
                  ) -> contextlib.AbstractContextManager[Any]:
        """The dispatch mode of a shard pass (dropout record / replay from ``site``).

        Entered, it gives an object whose ``site`` counts the shard's random ops so far.
        ``rng``: the dropout stream (:meth:`dropout_stream`), else the job's.
        """
        ...

    def lm_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each member's causal-LM loss: 0-dim for one member, ``(K,)`` for a fused array.

        ``logits``: ``(b, T, V)``, ``ids``: ``(b, T)`` (a fused array: ``(K, ...)`` both).
        """
        ...

    def run_shard(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                  x: torch.Tensor, rows: slice | None, device: Device,
                  overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """The shard's forward on ``x``: of the step's microbatch ``rows``, or evaluation.

        ``x``: ``(b, ...)`` (a fused array: ``(K, b, ...)``); ``rows``: ``None`` for an
        evaluation chunk (no dropout); ``overrides``: ``key -> tensor`` used instead of
        ``tensors`` (a pipeline pack's copies of tied parameters another pack holds).
        """
        ...

    def dropout_stream(self, state: torch.Tensor | None) -> JobRng | None:
        """The dropout stream a pipeline's pack draws from (``None``: drawn up front).

        Args:
            state: The stream's state where the pack starts, ``None`` for the job's own stream.

        Returns:
            The stream, or ``None`` for members that draw a step's dropout at its start (a
            fused array).
        """
        ...

    def set_dropout_state(self, state: torch.Tensor) -> None:
        """Continue the job's dropout stream from ``state`` (a pipeline's last pack's)."""
        ...

    def norms_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The 2-norm of each gradient: 0-dim, a fused array's per member ``(K,)``."""
        ...

    def clip_coefficient(self, norms: Mapping[TensorKey, torch.Tensor],
                         device: Device) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient from every owned parameter's gradient norm.

        Args:
            norms: Every owned parameter's gradient norm, on ``device``.
            device: Where they are.

        Returns:
            The coefficient on ``device``: 0-dim, a fused array's per member ``(K,)``.
        """
        ...

    def schedule(self) -> Any:
        """What an update of this step needs besides the gradients (its step, or lrs)."""
        ...

    def update(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor], schedule: Any,
               device: Device, clip_coef: torch.Tensor | None = None) -> None:
        """The optimizer step of the shard's owned parameters, its state on ``device`` already.

        ``schedule``: :meth:`schedule` of the update's step; ``clip_coef``: the clip
        coefficient on ``device`` (:meth:`clip_coefficient`), multiplied into the gradients
        first. The gradients are dropped after it.
        """
        ...

    def eval_ids(self) -> torch.Tensor:
        """The evaluation blocks on the host, ``(M, T)`` (a fused array: ``(K, M, T)``)."""
        ...

    def eval_targets(self) -> torch.Tensor | None:
        """The evaluation labels on the host, as :meth:`eval_ids`; ``None``: the ids are."""
        ...

    def dropout_off(self, shard: int | None) -> contextlib.AbstractContextManager[None]:
        """The layers of ``shard`` (``None``: every layer) in evaluation mode, then back."""
        ...

    def eval_guard(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """What an evaluation task runs in besides :meth:`dropout_off`."""
        ...

    # ------------------------------------------------------------------ what bookkeeping reads

    def member_state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """Member ``index``'s weights (of :attr:`live`) as its model's ``state_dict`` (CPU)."""
        ...

    def member_module(self, index: int) -> nn.Module:
        """Member ``index`` (of :attr:`live`) as a model of its own (to save its weights)."""
        ...

    def member_training_state(self, index: int) -> TrainingState:
        """Member ``index``'s training state (of :attr:`live`), as a checkpoint holds it.

        Call it between steps, with no clipped update deferred.
        """
        ...

    def evaluated(self, run: MemberRun) -> bool:
        """Whether the evaluation that ran concerns ``run`` (a single job's: always)."""
        ...

    def members_change(self) -> bool:
        """Whether a member leaves or may join at the step boundary now (K = 1: never)."""
        ...

    def after_start(self, task: ShardTask) -> None:
        """The members started before ``task`` (a fused array's done members leave now)."""
        ...

    def step_done(self) -> None:
        """A training step's tasks ran (before its records; a fused array counts its step)."""
        ...

    def at_step_boundary(self) -> None:
        """A step boundary, its checkpoints written: members leave or join (K = 1: none)."""
        ...
