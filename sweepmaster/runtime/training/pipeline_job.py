"""What a pipelined run uses of the job it drives: the trainer's parts.

A pipelined run (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP
mode, Li et al., VLDB 2022) is the same trainer as a job's shard tasks, only placed over several
devices: it drives a spilled job (one member or a fused array) through :class:`PipelinedJob`,
the parts the trainer (:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`) holds
and its task sequence, and through nothing else; ``mypy`` checks each place that hands one to a
pipelined run.

Thread safety: a pipelined run calls the parts from one thread per device at once. The byte
counters (the boundaries' ``swap_bytes``, the bookkeeping's ``p2p_bytes``, the store's promote
and demote counts) and the host bookkeeping (the store's ``install``, ``uninstall``,
``demote_state``, ...) are changed under the boundaries' ``counter_lock``; the passes of
different shards run concurrently.

Shape legend: K members (a fused array), B batch, b microbatch, T tokens per block.
"""

from __future__ import annotations

from typing import Protocol

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.bookkeeping import TrialBookkeeping
from sweepmaster.runtime.training.boundaries import HostBoundaries
from sweepmaster.runtime.training.compute import ShardCompute
from sweepmaster.runtime.training.shard_members import ShardMembers
from sweepmaster.runtime.training.shard_store import ShardStore
from sweepmaster.runtime.training.tasks import ShardTask

__all__ = ["PipelinedJob"]


class PipelinedJob(Protocol):
    """The job a pipelined run drives (see the module doc for the thread-safety contract).

    Attributes:
        plan: The job plan: its shards (their microbatch sizes) and the budgets they fit.
        members: Its members: their tensors by key, step ids, dropout streams, clip
            coefficients, evaluation blocks.
        boundaries: Its host boundaries: microbatches, rows, counted copies and their lock.
        store: Its shard store: installs, write-backs, optimizer states' moves.
        compute: Its per-shard compute: a shard's passes on a microbatch, its update, the
            clipped update's flow, the evaluation's passes and losses.
        bookkeeping: Its members' records (start, steps, evaluations, checkpoints; the
            device -> device bytes and metered peaks).
    """

    plan: JobPlan
    boundaries: HostBoundaries
    store: ShardStore
    compute: ShardCompute
    bookkeeping: TrialBookkeeping

    @property
    def members(self) -> ShardMembers:
        """Its members part (one module, or K stacked members)."""

    def next_task(self) -> ShardTask | None:
        """The next task of its chain, or ``None`` at its end."""

    def take_tasks(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the chain, to run them together."""

    def start_step(self, device: Device) -> None:
        """Start a training step: its seconds, its minibatch and its dropout state."""

    def settle(self, device: Device) -> None:
        """Hand on what has nothing left to train once :meth:`next_task` is ``None``."""
