"""A job's plan: its shards, their bytes and times, and the bytes each shard task moves.

:class:`JobPlan` is what the partitioners (:mod:`~sweepmaster.runtime.planning.partition`,
:mod:`~sweepmaster.runtime.planning.packing`, :mod:`~sweepmaster.runtime.planning.pilot`)
produce and the trainers, the memory planner, the policy's chains, the simulator, ``sweepmaster
plan`` and the plan cache read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from sweepmaster.errors import SweepmasterError
from sweepmaster.runtime.devices.meter import format_bytes
from sweepmaster.runtime.planning.json_records import record_from_json, record_to_json
from sweepmaster.runtime.planning.task_bytes import (
    TaskBytes,
    shard_task_bytes,
    state_fits,
    steady_task_bytes,
    task_order,
    task_peak,
)
from sweepmaster.runtime.planning.update_site import UpdateSite

if TYPE_CHECKING:
    from sweepmaster.runtime.planning.memplan import ShardMemoryPlan

__all__ = ["JobPlan", "KeyedCache", "LayerTooLargeError", "ShardPlan", "prefetch_fits"]

Value = TypeVar("Value")


class LayerTooLargeError(SweepmasterError, ValueError):
    """One layer alone does not fit the device budget (also a ``ValueError``, for older callers).

    Attributes:
        layer: The layer name.
        num_bytes: Its working set (bytes).
        budget_bytes: The device budget (bytes).
    """

    def __init__(
        self, layer: str, num_bytes: int, budget_bytes: int, measured_on: str | None = None
    ) -> None:
        self.layer = layer
        self.num_bytes = num_bytes
        self.budget_bytes = budget_bytes
        if measured_on is None:
            need = f"needs {format_bytes(num_bytes)} to train, more than"
        else:  # the pilot pass ran out of memory: the size of the failed request is unknown
            need = f"ran out of memory on {measured_on} after {format_bytes(num_bytes)}, past"
        super().__init__(
            f"layer {layer!r} {need} the device budget of {format_bytes(budget_bytes)}: use a "
            "device with more memory or a smaller model"
        )


class KeyedCache(Protocol[Value]):
    """Where plans or measurements are kept across processes, per (key, budget, device kind).

    Contract: :meth:`get` returns ``None`` for a miss (also for an entry it cannot read);
    :meth:`put` of an entry that exists already keeps one entry and does not raise, even when
    several processes put the same entry at once. Both may be called from any thread.
    """

    def get(self, key: str, budget_bytes: int, device_kind: str) -> Value | None:
        """Return the value stored for the entry, or ``None``."""
        ...

    def put(self, key: str, budget_bytes: int, device_kind: str, value: Value) -> None:
        """Store ``value`` for the entry (an existing entry is kept; see the class doc)."""
        ...


@dataclass(frozen=True)
class ShardPlan:
    """One shard: layers ``[start, stop)`` and its estimated costs.

    Attributes:
        index: Position of the shard (0 = input side).
        start: First layer, ``stop`` one past its last; ``layer_names`` their names.
        microbatch_size: Blocks per pass of this shard (it runs over every microbatch of the
            minibatch while resident: Harmony's input-batch grouping).
        param_bytes: Parameters it uses, trainable and frozen (bytes; tied parameters it
            borrows included).
        owned_param_bytes: Parameters it updates (bytes; a tied parameter belongs to the first
            shard that uses it; frozen parameters are nobody's).
        optimizer_bytes: Optimizer state of its owned parameters (bytes).
        num_owned_params: Parameters it updates (a count: each gets one fp32 gradient norm
            under ``grad_clip``).
        input_bytes: Its boundary input for the whole minibatch (bytes; int64 token ids for the
            first shard).
        output_bytes: Its boundary output for the whole minibatch (bytes; the last shard's
            logits never leave the device).
        contribution_bytes: Owned parameters a later shard uses too (bytes): their gradient
            contributions come from the host in its backward.
        activation_bytes: Recompute activations of one microbatch (bytes).
        forward_peak_bytes: Peak of its forward task (bytes; 0 for the last shard, which has none).
        backward_peak_bytes: Peak of its backward task (bytes).
        forward_s: Seconds of its forward task over the minibatch, ``backward_s`` of its backward
            task (recompute, backward, update).
        noise_bytes: Per layer of the shard, the pre-drawn dropout noise a training pass of the
            layer over the minibatch promotes (bytes): a fused array's, whose members' noise
            is drawn on the host at the start of each step and promoted with every pass of
            the layer (each microbatch's rows of K members' masks, packed 8 draws a byte per
            row, and K scales per microbatch). Empty for a job that draws its dropout on the
            device (nothing moved).
        noise_scale_bytes: Of a pass's ``noise_bytes``, what each microbatch promotes
            whatever its rows: the K members' scale of every dropout draw of its layers
            (bytes), so that a pass over other microbatches (a pipeline's) is counted too.
        scaling_bytes: The members' LoRA scalings ``alpha / r`` every pass of the shard
            promotes, over one microbatch or evaluation chunk, training, recompute or
            evaluation (bytes: a fused array of LoRA members', ``(K,)`` fp32). 0 for a job
            without adapters.
        borrowed_params: Tied parameters it uses but an earlier shard owns, one ``(name,
            owner, bytes)`` each, in name order: the parameter, the index of the earlier shard
            that owns it (the first that uses it), its bytes. Their gradient contributions go
            to the host after its backward (:attr:`borrowed_bytes`).
    """

    index: int
    start: int
    stop: int
    layer_names: tuple[str, ...]
    microbatch_size: int
    param_bytes: int
    owned_param_bytes: int
    optimizer_bytes: int
    num_owned_params: int
    input_bytes: int
    output_bytes: int
    contribution_bytes: int
    activation_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_s: float
    backward_s: float
    noise_bytes: tuple[int, ...] = ()
    scaling_bytes: int = 0
    noise_scale_bytes: int = 0
    borrowed_params: tuple[tuple[str, int, int], ...] = ()

    @property
    def borrowed_bytes(self) -> int:
        """Bytes of :attr:`borrowed_params`: the tied parameters an earlier shard owns."""
        return sum(num_bytes for _, _, num_bytes in self.borrowed_params)


def prefetch_fits(peak_bytes: int, next_bytes: int, limit_bytes: int, margin: float) -> bool:
    """Whether a prefetch of ``next_bytes`` fits beside a task of planned ``peak_bytes``.

    The task's peak grown by ``margin`` (the share of it its estimate may be off by) plus the
    prefetched bytes stay within ``limit_bytes``. What a plan's prefetch choices and a running
    job's prefetches both decide by (:meth:`JobPlan.prefetch_fits`).
    """
    return math.ceil(peak_bytes * (1 + margin)) + next_bytes <= limit_bytes


@dataclass(frozen=True)
class JobPlan:
    """How one job trains on a device budget.

    Attributes:
        device: Name of the device planned for.
        budget_bytes: Its budget (bytes).
        batch_size: Blocks per optimizer step.
        microbatch_size: The largest blocks per layer pass allowed (each shard has its own).
        plain_bytes: Estimated peak of plain training on one device (bytes).
        spill: Whether the job spills (``plain_bytes > budget_bytes``).
        shards: The shards, in order.
        prefetch: Per shard task of a step (``task_order``), whether the *next* task's
            parameters are prefetched while it runs (double buffering fits the budget).
        peak_bytes: Estimated peak of the spilled job, prefetch included (bytes).
        num_tasks_per_step: Shard tasks per optimizer step (``2 * shards - 1``).
        swap_bytes_per_step: Estimated host <-> device bytes per steady-state step.
        step_s: Estimated seconds per spilled step.
        method: ``"estimate"`` (Harmony-style packing) or ``"pilot"`` (Hydra pilot pass).
        grad_clip: Whether the job clips gradients (the update of shards ``1..S-1`` waits for
            the global norm: it runs in the shard's next task).
        prefetch_margin: Share of a task's planned peak a prefetch beside it leaves free: the
            error its peaks may have. 0 for a plan profiled on the job's own layers (its metered
            peaks equal the planned ones), ``PEAK_MARGIN`` for a fused array's stacked plan (K
            times one member's profile: estimates). :meth:`prefetch_fits` applies it.
        update_on: Where the shards' optimizer steps run: ``"device"`` (Harmony's
            just-in-time update, the state promoted and demoted) or ``"host"`` (ZeRO-Offload:
            gradients demoted, the step on the host copies; chosen by
            :func:`~sweepmaster.runtime.planning.update_site.update_cost`). Every consumer
            reads this one field.
    """

    device: str
    budget_bytes: int
    batch_size: int
    microbatch_size: int
    plain_bytes: int
    spill: bool
    shards: tuple[ShardPlan, ...]
    prefetch: tuple[bool, ...]
    peak_bytes: int
    num_tasks_per_step: int
    swap_bytes_per_step: int
    step_s: float
    method: str
    grad_clip: bool
    prefetch_margin: float = 0.0
    update_on: UpdateSite = "device"

    def prefetch_fits(self, peak_bytes: int, next_bytes: int, limit_bytes: int) -> bool:
        """Whether ``next_bytes`` of parameters fit beside a task of planned ``peak_bytes``.

        The one rule for prefetching the next task's shard: the task's peak grown by
        :attr:`prefetch_margin` plus the parameters stay within ``limit_bytes`` (the budget,
        or a memory plan's limit).
        """
        return prefetch_fits(peak_bytes, next_bytes, limit_bytes, self.prefetch_margin)

    def num_microbatches(self, shard: int) -> int:
        """Microbatches per minibatch of one shard."""
        return math.ceil(self.batch_size / self.shards[shard].microbatch_size)

    def task_order(self) -> list[tuple[str, int]]:
        """``(kind, shard)`` of one step's shard tasks, in dependency order."""
        return task_order(len(self.shards))

    def task_bytes(
        self, num_steps: int, *, first_step: int = 0, eval_rows: int = 0,
        eval_every: int | None = None, activations: Sequence[ShardMemoryPlan] | None = None,
        limit_bytes: int | None = None, num_members: int = 1,
    ) -> list[TaskBytes]:
        """Host <-> device bytes of each shard task of ``num_steps`` steps, in task order.

        The one account of a spilled job's transfers: the policy's chain
        (:func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`), so the simulator, reads
        it, and it equals what :class:`~sweepmaster.runtime.training.spill.SpilledJob` moves (with
        at most one later shard borrowing each tied parameter) when every shard whose next
        task is its own stays resident for it. A shard that stays keeps its parameters, and
        its optimizer state when that next task updates it too and the state fits beside the
        task's planned peak (a job of one shard between its steps); what the task changed of
        them is written back when the shard leaves (``kept_bytes``, ``write_back_bytes``).
        With :attr:`update_on` ``"host"`` a backward task demotes its owned gradients instead
        (no optimizer state moves, nothing is written back) and its shard leaves the device. An
        evaluation pass runs in the task after the step that makes it due (the last task
        after the last step) and applies the updates ``grad_clip`` deferred of the shards it
        visits; the last task applies the rest. A fused array's training task promotes its
        dropout noise (:attr:`ShardPlan.noise_bytes`) with every layer pass it runs: a forward
        task's, a backward task's recompute (with ``activations``: of the layers its memory
        plan recomputes) and the last shard's forward in its backward task; none in an
        evaluation pass. Its LoRA members' scalings (:attr:`ShardPlan.scaling_bytes`) go with
        every pass of a shard over a microbatch, an evaluation's too. A backward task of a
        first shard that trains nothing (a LoRA base's embeddings) runs no pass: it moves no
        input, output gradient, activation, noise or scaling (with ``grad_clip``, only the
        step's clip coefficient, home).

        Args:
            num_steps: Steps of the chain.
            first_step: Steps done before (a resumed job: optimizer state and the step-0
                evaluation exist).
            eval_rows: Blocks of the evaluation set (0: no evaluation).
            eval_every: Evaluate every this many steps besides step 0 and the end.
            activations: Per shard, what its memory plan swaps (``MemoryPlan.shards``);
                ``None``: Hydra's recompute. Offloads count in the forward task (the last
                shard: its backward task), fetches in the backward task (even one issued
                early); a planned backward task but the last fetches its input with the
                activations instead of promoting it.
            limit_bytes: The bytes planned peaks stay within (``MemoryPlan.limit_bytes`` with
                ``activations``); ``None``: :attr:`budget_bytes`. A shard's optimizer state
                stays with it when its backward task's planned peak plus the state fit.
            num_members: K of a fused array's stacked plan: its gradient norms and clip
                coefficient are per member, ``(K,)`` fp32 each (the stacked shards' bytes
                are K members' already).

        Returns:
            One :class:`~sweepmaster.runtime.planning.task_bytes.TaskBytes` per task: forward
            of shards ``0..S-2`` then backward of ``S-1..0``, per step.
        """
        return shard_task_bytes(self.shards, self.grad_clip, self.batch_size, num_steps,
                                first_step, eval_rows, eval_every, activations,
                                self.budget_bytes if limit_bytes is None else limit_bytes,
                                num_members, self.update_on == "host")

    def task_peak_bytes(self, kind: str, shard: int,
                        activations: Sequence[ShardMemoryPlan] | None = None) -> int:
        """Planned device peak of the training task ``(kind, shard)`` of a step (bytes).

        The one estimate of a training task's peak: the memory plan's job peak and prefetch
        choices (:class:`~sweepmaster.runtime.planning.memplan.MemoryPlan`), a running job's
        prefetch decisions
        (:meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes`) and the
        policy's chain (:func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`) read it.
        Without ``activations``: the shard's
        :attr:`ShardPlan.forward_peak_bytes` or :attr:`ShardPlan.backward_peak_bytes` (Hydra's
        recompute of every activation). With a memory plan's ``activations``
        (``MemoryPlan.shards``): its shard's simulated peak, and a backward task of shard
        ``i > 0`` also holds the first fetch of shard ``i - 1``'s backward that the memory plan
        runs during it (``ShardMemoryPlan.early_fetch_bytes``; 0 where it fetches nothing
        early). Parameters prefetched beside the task and optimizer state kept with a resident
        shard are not included.

        Args:
            kind: ``"forward"`` or ``"backward"`` (the last shard's forward: 0, it has none).
            shard: The shard index.
            activations: Per shard, its memory plan (``MemoryPlan.shards``), or ``None``.

        Raises:
            ValueError: ``kind`` is neither, or ``activations`` are for another number of
                shards.
        """
        return task_peak(self.shards, kind, shard, activations)

    def eval_peak_bytes(self, shard: int) -> int:
        """Planned device peak of an evaluation pass of ``shard`` (bytes).

        A forward without gradients: the peak of the shard's forward task
        (:attr:`ShardPlan.forward_peak_bytes`); the last shard, which has none, holds its
        logits like its backward (:attr:`ShardPlan.backward_peak_bytes`). The one estimate of
        the job's tasks
        (:meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes`) and of the
        policy's chain (:func:`~sweepmaster.runtime.execution.policy_chain.shard_chain`).
        """
        kind = "backward" if shard == len(self.shards) - 1 else "forward"
        return task_peak(self.shards, kind, shard, None)

    def state_stays(self, shard: int, activations: Sequence[ShardMemoryPlan] | None = None,
                    limit_bytes: int | None = None) -> bool:
        """Whether ``shard``'s optimizer state may stay on the device with the kept shard.

        Only when its backward task's planned peak (:meth:`task_peak_bytes`, its memory
        plan's with ``activations``) plus the state fit ``limit_bytes`` (``None``:
        :attr:`budget_bytes`): the state then sits beside the whole task, not only its update
        (a job or fused array of one shard between its steps). The one rule of the jobs that
        keep it (:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`) and of
        :meth:`task_bytes`.
        """
        limit = self.budget_bytes if limit_bytes is None else limit_bytes
        return state_fits(self.shards, shard, activations, limit)

    def step_swap_bytes(self, activations: Sequence[ShardMemoryPlan] | None = None) -> int:
        """Bytes moved in a steady-state step, no shard resident (as :meth:`task_bytes`)."""
        return sum(steady_task_bytes(self.shards, self.grad_clip, self.batch_size, activations,
                                     self.update_on == "host"))

    def to_json(self) -> str:
        """Serialize to a JSON string, e.g. to cache it (see :meth:`from_json`)."""
        return record_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        """Inverse of :meth:`to_json` (:func:`~.json_records.record_from_json`)."""
        return record_from_json(cls, text)
