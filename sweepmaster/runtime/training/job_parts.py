"""What every spilled job holds: its parts, and the hooks the job fills for them.

A spilled job (:class:`~sweepmaster.runtime.training.chain.ShardChain`) holds small parts, each
with a narrow interface, and gives each what it needs of the job as constructor arguments:

* :class:`~sweepmaster.runtime.training.boundaries.HostBoundaries` (:attr:`JobParts.boundaries`):
  microbatches, boundary activations and gradients demoted into host buffers of the whole
  minibatch, every copy counted in ``swap_bytes``;
* :class:`~sweepmaster.runtime.training.planned.PlannedPasses` (:attr:`JobParts.passes`): with a
  memory plan (mu-TWO), the planned forward and backward passes of a shard (kept, swapped or
  recomputed activations), and the last shard's recorded losses;
* :class:`~sweepmaster.runtime.training.tasks.TaskChain` (:attr:`JobParts.tasks`): the task
  sequence a scheduler reads, with the plan's estimated seconds and peaks;
* :class:`~sweepmaster.runtime.training.shard_store.ShardStore` (:attr:`JobParts.store`):
  promote and demote, Hydra's double buffering (prefetch), the shard kept resident for its next
  task; the job gives it its tensors
  (:class:`~sweepmaster.runtime.training.shard_store.ShardTensors`).

:class:`JobParts` builds them and forwards what a pipeline, the executor and tests read of the
job (``swap_bytes``, ``to_device``, ``next_task``, ``planned_peak_bytes``, ``prefetch``,
``evict`` ...).

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import HostBoundaries
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.planned import PlannedPasses
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.shard_store import ShardStore
from sweepmaster.runtime.training.tasks import (
    ShardTask,
    StateSlot,
    StepRange,
    TaskChain,
    TaskPhase,
    TensorKey,
    after_step_phase,
)

__all__ = ["JobParts"]


class JobParts(ABC):
    """The parts a spilled job holds, and what the job gives them.

    Its host boundaries (:attr:`boundaries`), its planned passes (:attr:`passes`, built from
    the job's token ids, layers, dropout mode and loss) and its task sequence (:attr:`tasks`:
    the job says what follows a step, :attr:`num_steps`, :meth:`_evaluates_after`,
    :meth:`_settles_after`, and whether it stopped early, :attr:`stopped`).

    Args:
        plan: The job plan (shards, microbatch sizes, seconds, peaks); its device's type
            (``cpu`` or ``cuda``) is where the job's tasks run.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation.

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).

    Attributes:
        boundaries: The host side of the job's shard boundaries and its counted copies.
        passes: The job's planned passes (mu-TWO) and its recorded losses.
        tasks: The job's task sequence.
        store: Where the job's shards live: promote, demote, prefetch, keep.
    """

    #: Dimension of the rows in token ids and host boundaries: 0 for one member's
    #: ``(B, ...)``, 1 for a fused array's ``(K, B, ...)``.
    row_dim = 0
    #: Prefetch only the task right after the current one within a training step (a fused
    #: array: members leave it between steps); else any task of the job's.
    prefetches_within_step = False
    #: Per shard, the optimizer of its owned parameters (``None``: it owns none).
    _optimizers: Sequence[Any]

    def __init__(self, plan: JobPlan, batch_size: int,
                 memory_plan: MemoryPlan | None = None) -> None:
        self.plan = plan
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
        self.boundaries = HostBoundaries(plan, batch_size, row_dim=self.row_dim,
                                         labels=self._labels, targets=self.step_targets)
        self.passes = PlannedPasses(plan, self.boundaries, memory_plan,
                                    layer_calls=self._layer_calls, pass_mode=self._pass_mode,
                                    lm_loss=self._lm_loss)
        self.memory_plan = memory_plan
        self.tasks = TaskChain(plan, memory_plan, self._step_range)
        self.store = ShardStore(plan, memory_plan, tensors=self, boundaries=self.boundaries,
                                passes=self.passes, tasks=self.tasks,
                                prefetch_within_step=self.prefetches_within_step)

    # ------------------------------------------------------------------ what a job provides

    @abstractmethod
    def _labels(self) -> torch.Tensor:
        """The step's token ids on the host, the whole minibatch (``(B, T)``, ``(K, B, T)``)."""

    def step_targets(self) -> torch.Tensor | None:
        """The step's loss labels on the host, as the token ids; ``None``: the ids are.

        With a loss mask (:attr:`~sweepmaster.workload.spec.TrainSpec.train_mask`): the ids
        with :data:`~sweepmaster.workload.spec.IGNORED_TARGET` where a token does not count.
        """
        return None

    @abstractmethod
    def _layer_calls(self, shard: int, rows: slice,
                     device: Device) -> tuple[list[Layer], list[list[torch.Tensor]]]:
        """The shard's layers on microbatch ``rows`` and, per layer, its resident tensors.

        Each layer is a callable of its input; the resident tensors (parameters and buffers on
        the device) are what its saved tensors may name instead of copying them.
        """

    @abstractmethod
    def _pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
                   site: int = 0, rng: JobRng | None = None,
                   ) -> contextlib.AbstractContextManager[Any]:
        """The dispatch mode of a shard pass (dropout record / replay from ``site``).

        Entered, it gives an object whose ``site`` counts the shard's random ops so far.
        ``rng``: the dropout stream
        (:meth:`~sweepmaster.runtime.training.compute.ShardCompute.dropout_stream`), else the
        job's.
        """

    @abstractmethod
    def _lm_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each member's causal-LM loss: 0-dim for one member, ``(K,)`` for a fused array.

        ``logits``: ``(b, T, V)``, ``ids``: ``(b, T)`` (a fused array: ``(K, ...)`` both).
        """

    # ------------------------------------------------------------------ the parts' numbers

    @property
    def swap_bytes(self) -> int:
        """Bytes moved between host and device so far (the boundaries' counter)."""
        return self.boundaries.swap_bytes

    @swap_bytes.setter
    def swap_bytes(self, value: int) -> None:
        self.boundaries.swap_bytes = value

    @property
    def counter_lock(self) -> threading.RLock:
        """Guards the byte counters and host bookkeeping (the boundaries' lock)."""
        return self.boundaries.counter_lock

    @property
    def num_recompute_fallbacks(self) -> int:
        """Backward tasks that recomputed their shard instead of running the memory plan."""
        return self.passes.num_recompute_fallbacks

    @property
    def plan_mismatches(self) -> int:
        """Layer passes that saved other activations than profiled."""
        return self.passes.plan_mismatches

    @property
    def activation_swap_bytes(self) -> int:
        """Bytes of saved activations a memory plan moved between host and device so far."""
        return self.passes.activation_swap_bytes

    def to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on ``device``, counted in :attr:`swap_bytes` (any thread)."""
        return self.boundaries.to_device(device, host)

    def to_host(self, device: Device, tensor: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of ``tensor`` (into ``out`` if given), counted in :attr:`swap_bytes`."""
        return self.boundaries.to_host(device, tensor, out)

    def microbatches(self, shard: int, num_rows: int | None = None) -> list[slice]:
        """Row slices of ``shard``'s microbatches over a minibatch (or ``num_rows`` rows)."""
        return self.boundaries.microbatches(shard, num_rows)

    def eval_chunks(self, shard: int, num_rows: int) -> list[slice]:
        """Plain's evaluation batches of ``batch_size`` rows, in ``shard``'s microbatches."""
        return self.boundaries.eval_chunks(shard, num_rows)

    def rows_of(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """``rows`` of ``tensor`` along :attr:`row_dim` (a view)."""
        return self.boundaries.rows_of(tensor, rows)

    # ------------------------------------------------------------------ the task sequence

    @property
    @abstractmethod
    def step(self) -> int:
        """Optimizer steps the job finished (a fused array's: in this run)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The job's name (a fused array's: its first member's)."""

    @property
    @abstractmethod
    def clips(self) -> bool:
        """Whether some member clips its gradients (``grad_clip``): updates wait for the norm."""

    @property
    @abstractmethod
    def stopped(self) -> bool:
        """Whether the job stopped before its task sequence ends (pruned, every member left)."""

    @property
    @abstractmethod
    def num_steps(self) -> int:
        """The step the job trains to (a fused array's: in this run)."""

    @abstractmethod
    def _evaluates_after(self, step: int) -> bool:
        """Whether some member evaluates after ``step`` (at the sequence's first: before it)."""

    @abstractmethod
    def _settles_after(self, step: int) -> bool:
        """Whether some member ends or writes a checkpoint after ``step``."""

    def next_task(self) -> ShardTask | None:
        """The next task to run, or ``None`` when the job is finished or :attr:`stopped`."""
        return None if self.stopped else self.tasks.peek(0)

    def peek_task(self, ahead: int = 1) -> ShardTask | None:
        """The task ``ahead`` positions after the next one (assuming nothing ends early)."""
        return self.tasks.peek(ahead)

    def take_tasks(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the chain at once, to be run together.

        A pipelined step (:mod:`~sweepmaster.runtime.training.pipelined`) runs a whole step's
        tasks over several devices at once.

        Raises:
            ValueError: The job has fewer tasks left, or it stopped.
        """
        if self.stopped:
            raise ValueError(f"the job has fewer than {num_tasks} tasks left")
        return self.tasks.take(num_tasks)

    def planned_peak_bytes(self, task: ShardTask) -> int:
        """Planned device peak of ``task`` (bytes): the one estimate prefetch decisions read.

        :meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes`, with the
        shard's optimizer state when it stayed on the device (:meth:`state_on_device`).
        """
        return self.tasks.planned_peak_bytes(task, self.state_on_device(task.shard))

    @property
    def remaining_seconds(self) -> float:
        """Estimated seconds of the job's remaining training steps (the Sharded-LRTF key).

        Steps from :attr:`step` to :attr:`num_steps` (a fused array's: until its last member
        ends), each of the memory plan's step seconds, or the job plan's without one.
        """
        return (self.num_steps - self.step) * self.tasks.step_s

    def _step_range(self) -> StepRange:
        """The job's steps from :attr:`step` on, and what follows each (:func:`after_step_phase`).

        Before the first step: only an evaluation.
        """
        first = self.step
        defers = self.clips and len(self.plan.shards) > 1

        def after(step: int) -> TaskPhase | None:
            return after_step_phase(evaluates=self._evaluates_after(step), defers=defers,
                                    settles=step != first and self._settles_after(step))

        self.passes.job_id = self.name
        return StepRange(self.name, first, self.num_steps, after)

    def _rechain(self) -> None:
        """Make the task sequence again from the next task on (what follows has changed).

        Call it between tasks with nothing prefetched.
        """
        assert not self.store.prefetching, "prefetched copies of the old sequence's tasks"
        self.tasks.rechain()

    # ------------------------------------------------------------------ the job's tensors
    # What the shard store reads (:class:`~sweepmaster.runtime.training.shard_store.ShardTensors`).

    @abstractmethod
    def shard_keys(self, shard: int) -> list[TensorKey]:
        """The tensors a promote of ``shard`` copies to a device, in promote order."""

    @abstractmethod
    def trainable(self, key: TensorKey) -> bool:
        """Whether the tensor ``key`` gets gradients."""

    @abstractmethod
    def host_tensor(self, key: TensorKey) -> torch.Tensor:
        """The host copy of ``key`` (stacked ``(K, ...)`` in a fused array)."""

    @abstractmethod
    def task_tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The tensors the job computes with, by key: every :data:`TensorKey` of every shard.

        The same tensors in every shard task and pipeline pack; their data is the installed
        device copy (:meth:`install`), or :meth:`idle_data` of the host copy when none is.
        """

    @abstractmethod
    def idle_data(self, host: torch.Tensor) -> torch.Tensor:
        """What a tensor's data is while no copy is installed, given its host copy.

        A single job's module holds its host copies (the tensor's data is ``host``); a fused
        array's stacked host tensors live apart (an empty tensor).
        """

    @abstractmethod
    def state_slots(self, shard: int) -> list[StateSlot]:
        """Where the optimizer state tensors of ``shard`` that move with it live, in order.

        Each ``(container, key)``: ``container[key]`` is one state tensor (its host copy, or
        its device copy between :meth:`promote_state` and :meth:`demote_state`); a step may
        add slots while the state is on the device (its first step makes the state there).
        """

    @abstractmethod
    def updates(self, shard: int) -> bool:
        """Whether ``shard`` has an optimizer (it owns trainable parameters)."""

    @abstractmethod
    def deferred(self, shard: int) -> bool:
        """Whether the shard's clipped update is deferred (it is never prefetched then)."""

    # ------------------------------------------------------------------ the shard store's

    @property
    def num_promotes(self) -> int:
        """Shard promotions so far."""
        return self.store.num_promotes

    @num_promotes.setter
    def num_promotes(self, value: int) -> None:
        self.store.num_promotes = value

    @property
    def num_demotes(self) -> int:
        """Shard demotions so far."""
        return self.store.num_demotes

    @num_demotes.setter
    def num_demotes(self, value: int) -> None:
        self.store.num_demotes = value

    @property
    def num_prefetches(self) -> int:
        """Shards promoted ahead of their task so far."""
        return self.store.num_prefetches

    @property
    def num_resident_hits(self) -> int:
        """Tasks whose shard was resident already (kept by the task before; no promote)."""
        return self.store.num_resident_hits

    @property
    def num_prefetch_refusals(self) -> int:
        """Prefetches dropped because the device had no memory for them."""
        return self.store.num_prefetch_refusals

    @property
    def device_name(self) -> str:
        """Devices the job ran on last (a pipeline's: every device's name, comma-separated)."""
        return self.store.device_name

    @device_name.setter
    def device_name(self, value: str) -> None:
        self.store.device_name = value

    def install(self, keys: Sequence[TensorKey], copies: Sequence[torch.Tensor]) -> None:
        """Make ``copies`` (on a device) the data of the tensors ``keys`` the job computes with."""
        self.store.install(keys, copies)

    def installed(self, key: TensorKey) -> torch.Tensor:
        """The installed tensor ``key`` (its ``.grad`` holds the gradient after a backward)."""
        return self.store.installed(key)

    def uninstall(self, keys: Sequence[TensorKey], device: Device) -> None:
        """Put the host copies of ``keys`` back, writing back what an update changed."""
        self.store.uninstall(keys, device)

    def write_back_tensor(self, key: TensorKey, device: Device) -> None:
        """Write the installed ``key`` back to its host copy now if an update changed it."""
        self.store.write_back_tensor(key, device)

    def state_on_device(self, shard: int) -> bool:
        """Whether the shard's optimizer state is on a device (it counts in its task's peak)."""
        return self.store.state_on_device(shard)

    def promote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state to ``device`` (nothing if there or no optimizer).

        Raises:
            torch.OutOfMemoryError: The state does not fit the device.
        """
        self.store.promote_state(shard, device)

    def demote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state on ``device`` back to the host, if it is there."""
        self.store.demote_state(shard, device)

    def prefetch(self, task: ShardTask | None, device: Device, *,
                 headroom_bytes: int | None = None) -> None:
        """Start promoting ``task``'s shard to ``device`` in the background (Hydra).

        See :meth:`~sweepmaster.runtime.training.shard_store.ShardStore.prefetch`: ``task``
        after the job's next task, or the next task itself within ``headroom_bytes``.
        """
        self.store.prefetch(task, self.next_task(), device, deferred=self.deferred,
                            headroom_bytes=headroom_bytes)

    def discard_prefetch(self, device: Device) -> None:
        """Drop what was prefetched onto ``device`` (it runs something else now), freeing it."""
        self.store.discard_prefetch(device)

    def release(self) -> None:
        """Free what the job holds on devices between its tasks; it cannot go on after this."""
        self.store.release()

    def resident_shard(self, device: Device) -> int | None:
        """The shard the job keeps resident on ``device`` between its tasks, if any."""
        return self.store.resident_shard(device)

    def resident_bytes(self, device: Device) -> int:
        """Planned bytes the job keeps on ``device`` between its tasks (0: nothing)."""
        return self.store.resident_bytes(device)

    def evict(self, device: Device | None = None) -> None:
        """Write back and free the shard kept resident on ``device`` (any device: None)."""
        self.store.evict(device)
