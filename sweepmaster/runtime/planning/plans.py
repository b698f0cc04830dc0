"""A job's plan: its shards, their bytes and times, and the bytes each shard task moves.

:class:`JobPlan` is what the partitioners (:mod:`~sweepmaster.runtime.planning.partition`,
:mod:`~sweepmaster.runtime.planning.packing`, :mod:`~sweepmaster.runtime.planning.pilot`)
produce and the trainers, the memory planner, the policy's chains, the simulator, ``sweepmaster
plan`` and the plan cache read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from sweepmaster.errors import SweepmasterError
from sweepmaster.runtime.devices.meter import format_bytes

if TYPE_CHECKING:
    from sweepmaster.runtime.planning.memplan import ShardMemoryPlan

__all__ = [
    "JobPlan", "KeyedCache", "LayerTooLargeError", "ShardPlan", "TaskBytes", "prefetch_fits",
    "steady_task_bytes",
]

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
        borrowed_bytes: Tied parameters it uses but an earlier shard owns (bytes): their
            gradient contributions go to the host after its backward.
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
        borrowed_params: The tied parameters of ``borrowed_bytes``, one ``(name, owner,
            bytes)`` each, in name order: the parameter, the index of the earlier shard that
            owns it (the first that uses it), its bytes.
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
    borrowed_bytes: int
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


@dataclass(frozen=True)
class TaskBytes:
    """Bytes one shard task moves between host and device (see :meth:`JobPlan.task_bytes`).

    Attributes:
        shard_bytes: The shard's bytes promoted at its start unless the device holds the shard
            already: its parameters, and its optimizer state when the task before kept that
            there (``kept_bytes``).
        state_bytes: That optimizer state (bytes of ``shard_bytes``; 0 when none was kept).
        promote_bytes: Every other host -> device byte: boundaries and their gradients, token
            ids, tied-gradient contributions, optimizer state, a deferred update's inputs, a
            fused array's dropout noise and LoRA scalings (:attr:`ShardPlan.noise_bytes`,
            :attr:`ShardPlan.scaling_bytes`).
        demote_bytes: Every device -> host byte the task moves at its end whether or not the
            shard stays: boundaries and their gradients, tied-gradient contributions, gradient
            norms, the clip coefficient, optimizer state that goes home, a deferred update's
            parameters.
        kept_bytes: What the shard keeps on the device after the task when it stays for its
            job's next task (same shard): its parameters, and its optimizer state when that
            task updates it too (a job of one shard between its steps).
        write_back_bytes: What of ``kept_bytes`` the task changed (the parameters its update
            changed, the state kept with them): written back when the shard leaves the device
            (at the task's end when it does not stay).
    """

    shard_bytes: int
    state_bytes: int
    promote_bytes: int
    demote_bytes: int
    kept_bytes: int
    write_back_bytes: int


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
        return _order(len(self.shards))

    def task_bytes(
        self, num_steps: int, *, first_step: int = 0, eval_rows: int = 0,
        eval_every: int | None = None, activations: Sequence[ShardMemoryPlan] | None = None,
        limit_bytes: int | None = None, num_members: int = 1,
    ) -> list[TaskBytes]:
        """Host <-> device bytes of each shard task of ``num_steps`` steps, in task order.

        The one account of a spilled job's transfers: the policy's chain
        (:func:`~sweepmaster.runtime.execution.job_chain.shard_chain`), so the simulator, reads it,
        and it equals what :class:`~sweepmaster.runtime.training.spill.SpilledJob` moves (with
        at most one later shard borrowing each tied parameter) when every shard whose next
        task is its own stays resident for it. A shard that stays keeps its parameters, and
        its optimizer state when that next task updates it too and the state fits beside the
        task's planned peak (a job of one shard between its steps); what the task changed of
        them is written back when the shard leaves (``kept_bytes``, ``write_back_bytes``). An
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
            One :class:`TaskBytes` per task: forward of shards ``0..S-2`` then backward of
            ``S-1..0``, per step.
        """
        return _task_bytes(self.shards, self.grad_clip, self.batch_size, num_steps, first_step,
                           eval_rows, eval_every, activations,
                           self.budget_bytes if limit_bytes is None else limit_bytes,
                           num_members)

    def task_peak_bytes(self, kind: str, shard: int,
                        activations: Sequence[ShardMemoryPlan] | None = None) -> int:
        """Planned device peak of the training task ``(kind, shard)`` of a step (bytes).

        The one estimate of a training task's peak: the memory plan's job peak and prefetch
        choices (:class:`~sweepmaster.runtime.planning.memplan.MemoryPlan`), a running job's
        prefetch decisions
        (:meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes`) and the
        policy's chain (:func:`~sweepmaster.runtime.execution.job_chain.shard_chain`) read it.
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
        return _task_peak(self.shards, kind, shard, activations)

    def eval_peak_bytes(self, shard: int) -> int:
        """Planned device peak of an evaluation pass of ``shard`` (bytes).

        A forward without gradients: the peak of the shard's forward task
        (:attr:`ShardPlan.forward_peak_bytes`); the last shard, which has none, holds its
        logits like its backward (:attr:`ShardPlan.backward_peak_bytes`). The one estimate of
        the job's tasks
        (:meth:`~sweepmaster.runtime.training.tasks.TaskChain.planned_peak_bytes`) and of the
        policy's chain (:func:`~sweepmaster.runtime.execution.job_chain.shard_chain`).
        """
        kind = "backward" if shard == len(self.shards) - 1 else "forward"
        return _task_peak(self.shards, kind, shard, None)

    def state_stays(self, shard: int, activations: Sequence[ShardMemoryPlan] | None = None,
                    limit_bytes: int | None = None) -> bool:
        """Whether ``shard``'s optimizer state may stay on the device with the kept shard.

        Only when its backward task's planned peak (:meth:`task_peak_bytes`, its memory
        plan's with ``activations``) plus the state fit ``limit_bytes`` (``None``:
        :attr:`budget_bytes`): the state then sits beside the whole task, not only its update
        (a job or fused array of one shard between its steps). The one rule of the jobs that
        keep it (:class:`~sweepmaster.runtime.training.chain.ShardChain`) and of
        :meth:`task_bytes`.
        """
        limit = self.budget_bytes if limit_bytes is None else limit_bytes
        return _state_fits(self.shards, shard, activations, limit)

    def step_swap_bytes(self, activations: Sequence[ShardMemoryPlan] | None = None) -> int:
        """Bytes moved in a steady-state step, no shard resident (as :meth:`task_bytes`)."""
        return sum(steady_task_bytes(self.shards, self.grad_clip, self.batch_size, activations))

    def to_json(self) -> str:
        """Serialize to a JSON string, e.g. to cache it (see :meth:`from_json`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        shards = tuple(
            ShardPlan(**{**s, "layer_names": tuple(s["layer_names"]),
                         "noise_bytes": tuple(s.get("noise_bytes", ())),
                         "borrowed_params": tuple(tuple(p) for p in s["borrowed_params"])})
            for s in data.pop("shards")
        )
        return cls(shards=shards, prefetch=tuple(data.pop("prefetch")), **data)


def _task_bytes(
    shards: Sequence[ShardPlan], grad_clip: bool, batch_size: int, num_steps: int,
    first_step: int, eval_rows: int = 0, eval_every: int | None = None,
    activations: Sequence[ShardMemoryPlan] | None = None, limit_bytes: int = 0,
    num_members: int = 1,
) -> list[TaskBytes]:
    """See :meth:`JobPlan.task_bytes`; also the plan's steady-state swap volume.

    ``limit_bytes``: as :meth:`JobPlan.task_bytes`'s; 0 keeps no optimizer state with a shard.
    """
    last = len(shards) - 1
    if activations is not None and len(activations) != len(shards):
        raise ValueError(f"activations of {len(activations)} shards, the plan has {len(shards)}")
    updated = [first_step > 0] * len(shards)  # optimizer state exists (made by the first step)
    pending = [False] * len(shards)  # gradients on the host, update deferred (grad_clip)
    state_kept = [False] * len(shards)  # the state stayed on the device with the kept shard
    coef = 4 * num_members if grad_clip else 0  # the fp32 clip coefficient, per member
    order = _order(len(shards))

    def rows(minibatch_bytes: int) -> int:
        """Bytes of the evaluation set's blocks of a boundary (``minibatch_bytes`` per batch)."""
        return minibatch_bytes * eval_rows // batch_size

    def num_passes(i: int, num_rows: int) -> int:
        """Passes of shard ``i`` over ``num_rows`` blocks: its microbatches of each batch."""
        size = shards[i].microbatch_size
        return sum(math.ceil(min(batch_size, num_rows - lo) / size)
                   for lo in range(0, num_rows, batch_size))

    def state_in(i: int) -> int:
        """Bytes of shard ``i``'s optimizer state its update promotes (none before the first)."""
        num_bytes = shards[i].optimizer_bytes if updated[i] else 0
        updated[i] = True
        return num_bytes

    def state_fits(i: int) -> bool:
        """Whether shard ``i``'s state fits beside its backward task (then it stays)."""
        return _state_fits(shards, i, activations, limit_bytes)

    def deferred(i: int) -> tuple[int, int]:
        """Apply shard ``i``'s pending update: its gradients come back, then the update."""
        if not pending[i]:
            return 0, 0
        pending[i] = False
        shard = shards[i]
        return (shard.owned_param_bytes + state_in(i) + coef,
                shard.optimizer_bytes + shard.owned_param_bytes)

    def noise(i: int, kind: str) -> int:
        """Dropout noise bytes a training task of shard ``i`` promotes (see the docstring)."""
        passes = shards[i].noise_bytes
        if not passes:
            return 0
        if kind == "forward":
            return sum(passes)
        swapped = None if activations is None else activations[i]
        if swapped is None:  # Hydra's recompute (the last shard's: its forward) runs every layer
            return sum(passes)
        recomputed = sum(n for n, d in zip(passes, swapped.decisions, strict=True)
                         if d.recompute)
        return recomputed + (sum(passes) if i == last else 0)

    def passes_moved(i: int, kind: str) -> tuple[int, int]:
        """(promoted, demoted) bytes of the passes a training task of shard ``i`` runs.

        Its input, output or output gradient, activations, dropout noise and LoRA scalings;
        none in a backward task of a first shard that trains nothing (it runs no pass).
        """
        shard = shards[i]
        if kind == "backward" and i == 0 and last > 0 and not shard.num_owned_params:
            return 0, 0
        up = noise(i, kind) + shard.scaling_bytes * num_passes(i, batch_size)
        down = 0
        swapped = None if activations is None else activations[i]
        if swapped is None or kind == "forward" or i == last:
            up += shard.input_bytes  # else fetched with the activations
        if swapped is not None and kind == "forward":
            down += swapped.offload_bytes
        elif swapped is not None:
            up += swapped.fetch_bytes
            down += swapped.offload_bytes if i == last else 0
        if kind == "forward":
            down += shard.output_bytes
        else:
            up += shards[0].input_bytes if i == last and i > 0 else 0  # ids for the loss
            up += shard.output_bytes if i < last else 0  # gradient of the output
            down += shard.input_bytes if i > 0 else 0  # gradient of the input
        return up, down

    def evaluation(kept: bool) -> tuple[int, int, int]:
        """(shard 0's promote, other promoted, demoted) bytes of an evaluation pass.

        ``kept``: shard 0 stays resident from the task before (the last task's own pass).
        """
        up = down = 0
        for i, shard in enumerate(shards):
            u, d = deferred(i) if i > 0 else (0, 0)
            up += u + (shard.param_bytes if i > 0 else 0)
            down += d
            up += rows(shard.input_bytes) + shard.scaling_bytes * num_passes(i, eval_rows)
            if i < last:
                down += rows(shard.output_bytes)
            elif i > 0:
                up += rows(shards[0].input_bytes)  # ids for the loss
        return (0 if kept else shards[0].param_bytes), up, down

    out = []
    total = first_step + num_steps
    due = eval_rows > 0 and first_step == 0  # step 0's evaluation runs before the first task
    for done in range(first_step + 1, total + 1):
        evaluates = eval_rows > 0 and (done == total or (eval_every is not None
                                                         and done % eval_every == 0))
        for p, (kind, i) in enumerate(order):
            shard = shards[i]
            # the state found on the device with the shard, else promoted with it
            state = shard.optimizer_bytes if state_kept[i] else 0
            shard_bytes, up, down, changed = shard.param_bytes + state, 0, 0, 0
            if due and p == 0:  # the pass runs in this task first
                shard_bytes, up, down = evaluation(False)
                if last > 0:  # then its own shard again (the pass ended on another)
                    up += shard.param_bytes
                due = False
            # the job's next real task: the next of the step, an evaluation pass (its first
            # task is a forward of shard 0), the next step's first, nothing at the end (or
            # the deferred updates of shards 1..S-1)
            following = (order[p + 1] if p + 1 < len(order) else ("forward", 0) if evaluates
                         else None if done == total else order[0])
            stays = following is not None and following[1] == i
            state_stays = stays and following == ("backward", i) and state_fits(i)
            u, d = deferred(i) if i > 0 else (0, 0)
            up, down = up + u, down + d
            u, d = passes_moved(i, kind)
            up, down = up + u, down + d
            if kind == "backward":
                down += shard.borrowed_bytes
                up += shard.contribution_bytes
                if shard.num_owned_params and grad_clip:
                    down += 4 * num_members * shard.num_owned_params  # fp32 norms, per member
                if i == 0:  # the step's last backward makes the clip coefficient: home
                    down += coef
                if shard.num_owned_params and grad_clip and i > 0:
                    down += shard.owned_param_bytes  # gradients wait on the host
                    pending[i] = True
                elif shard.num_owned_params:  # the just-in-time update
                    if not state_kept[i]:  # else found with the shard
                        up += state_in(i)
                    up += coef  # the clip coefficient back on the device
                    changed = shard.owned_param_bytes
                    if state_stays:
                        changed += shard.optimizer_bytes
                    else:
                        down += shard.optimizer_bytes  # home before the next task
            state_kept[i] = state_stays
            kept = shard.param_bytes + (shard.optimizer_bytes if state_stays else 0)
            out.append(TaskBytes(shard_bytes, state, up, down, kept, changed))
        due = evaluates
    if out and due:  # the last task runs the last evaluation, shard 0 still resident
        _, u, d = evaluation(True)
        end = out[-1]
        out[-1] = dataclasses.replace(end, promote_bytes=end.promote_bytes + u,
                                      demote_bytes=end.demote_bytes + d)
    elif out and grad_clip:  # the last task applies the deferred updates after the last step
        end = out[-1]
        up, down = end.promote_bytes, end.demote_bytes
        for i in range(1, len(shards)):
            u, d = deferred(i)
            up, down = up + shards[i].param_bytes + u, down + d
        out[-1] = dataclasses.replace(end, promote_bytes=up, demote_bytes=down)
    return out


def _task_peak(shards: Sequence[ShardPlan], kind: str, shard: int,
               activations: Sequence[ShardMemoryPlan] | None) -> int:
    """See :meth:`JobPlan.task_peak_bytes`; also the planner's, before its plan is made."""
    if kind not in ("forward", "backward"):
        raise ValueError(f"kind must be 'forward' or 'backward', got {kind!r}")
    if activations is None:
        planned: ShardPlan | ShardMemoryPlan = shards[shard]
        early = 0
    else:
        if len(activations) != len(shards):
            raise ValueError(
                f"activations of {len(activations)} shards, the plan has {len(shards)}")
        planned = activations[shard]
        # the memory plan fetches the first item of shard i - 1's backward during this task
        early = activations[shard - 1].early_fetch_bytes if kind == "backward" and shard else 0
    if kind == "forward":
        return planned.forward_peak_bytes
    return planned.backward_peak_bytes + early


def _state_fits(shards: Sequence[ShardPlan], shard: int,
                activations: Sequence[ShardMemoryPlan] | None, limit_bytes: int) -> bool:
    """Whether ``shard``'s backward task's planned peak plus its optimizer state fit."""
    peak = _task_peak(shards, "backward", shard, activations)
    return peak + shards[shard].optimizer_bytes <= limit_bytes


def steady_task_bytes(
    shards: Sequence[ShardPlan], grad_clip: bool, batch_size: int,
    activations: Sequence[ShardMemoryPlan] | None = None,
) -> list[int]:
    """Bytes each shard task of a steady-state step moves, in task order (no shard resident).

    :meth:`JobPlan.task_bytes` of the middle of three steps of ``batch_size`` blocks: the
    plan's swap volume per step.
    """
    per_step = 2 * len(shards) - 1
    three = _task_bytes(shards, grad_clip, batch_size, 3, 1, activations=activations)
    middle = three[per_step : 2 * per_step]
    return [t.shard_bytes + t.promote_bytes + t.demote_bytes + t.write_back_bytes
            for t in middle]


def _order(num_shards: int) -> list[tuple[str, int]]:
    last = num_shards - 1
    return [("forward", i) for i in range(last)] + [("backward", i) for i in range(last, -1, -1)]
