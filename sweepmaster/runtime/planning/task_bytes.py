"""The bytes each shard task of a job moves between host and device, and its planned peak.

Hydra's shard tasks (Nagrecha & Kumar 2022) promote a shard's parameters and optimizer state
before they run and demote what changed after; boundaries, gradients, tied-gradient
contributions, a fused array's dropout noise and LoRA scalings go with them. This module counts
those bytes per task (:func:`shard_task_bytes`, what a
:class:`~sweepmaster.runtime.planning.plans.JobPlan` reports as
:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`: the swap volume the simulator,
the policy's chains and the executor's residency cache compare with what a run measures) and
gives a training task's planned peak (:func:`task_peak`), the one rule the planner, the memory
planner, the running jobs and the policy read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sweepmaster.runtime.planning.memplan import ShardMemoryPlan
    from sweepmaster.runtime.planning.plans import ShardPlan

__all__ = [
    "TaskBytes", "shard_task_bytes", "state_fits", "steady_task_bytes", "task_order", "task_peak",
]


@dataclass(frozen=True)
class TaskBytes:
    """Bytes one shard task moves between host and device.

    See :meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`.

    Attributes:
        shard_bytes: The shard's bytes promoted at its start unless the device holds the shard
            already: its parameters, and its optimizer state when the task before kept that
            there (``kept_bytes``).
        state_bytes: That optimizer state (bytes of ``shard_bytes``; 0 when none was kept).
        promote_bytes: Every other host -> device byte: boundaries and their gradients, token
            ids, tied-gradient contributions, optimizer state, a deferred update's inputs, a
            fused array's dropout noise and LoRA scalings
            (:attr:`~sweepmaster.runtime.planning.plans.ShardPlan.noise_bytes`,
            :attr:`~sweepmaster.runtime.planning.plans.ShardPlan.scaling_bytes`).
        demote_bytes: Every device -> host byte the task moves at its end whether or not the
            shard stays: boundaries and their gradients, tied-gradient contributions, gradient
            norms, the clip coefficient, optimizer state that goes home, a deferred update's
            parameters.
        kept_bytes: What the shard keeps on the device after the task when it stays for its
            job's next task (same shard): its parameters, and its optimizer state when that
            task updates it too (a job of one shard between its steps). 0 after an update
            on the host (ZeRO-Offload): the device copy is stale, the next task promotes it.
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


def shard_task_bytes(
    shards: Sequence[ShardPlan], grad_clip: bool, batch_size: int, num_steps: int,
    first_step: int, eval_rows: int = 0, eval_every: int | None = None,
    activations: Sequence[ShardMemoryPlan] | None = None, limit_bytes: int = 0,
    num_members: int = 1, host_update: bool = False,
) -> list[TaskBytes]:
    """Bytes of each shard task, per step, in task order (:class:`TaskBytes`).

    What :meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes` returns (its arguments
    are documented there); also the plan's steady-state swap volume (:func:`steady_task_bytes`).
    ``limit_bytes``: 0 keeps no optimizer state with a shard. ``host_update``: the
    just-in-time updates run on the host (ZeRO-Offload,
    :mod:`~sweepmaster.runtime.planning.update_site`): a backward task demotes its owned
    gradients instead of moving optimizer state and writing parameters back, and its shard
    does not stay on the device (its parameters change on the host).

    Raises:
        ValueError: ``activations`` are for another number of shards.
    """
    last = len(shards) - 1
    if activations is not None and len(activations) != len(shards):
        raise ValueError(f"activations of {len(activations)} shards, the plan has {len(shards)}")
    updated = [first_step > 0] * len(shards)  # optimizer state exists (made by the first step)
    pending = [False] * len(shards)  # gradients on the host, update deferred (grad_clip)
    state_kept = [False] * len(shards)  # the state stayed on the device with the kept shard
    coef = 4 * num_members if grad_clip else 0  # the fp32 clip coefficient, per member
    order = task_order(len(shards))

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

    def state_fits_at(i: int) -> bool:
        """Whether shard ``i``'s state fits beside its backward task (then it stays)."""
        return state_fits(shards, i, activations, limit_bytes)

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
            offloaded = False  # updated on the host: the shard leaves the device
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
            state_stays = stays and following == ("backward", i) and state_fits_at(i)
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
                elif shard.num_owned_params and host_update:  # ZeRO-Offload's host step
                    down += shard.owned_param_bytes  # the gradients; the state never moves
                    offloaded, state_stays = True, False  # the device copy is stale now
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
            kept = 0 if offloaded else (
                shard.param_bytes + (shard.optimizer_bytes if state_stays else 0))
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


def task_peak(shards: Sequence[ShardPlan], kind: str, shard: int,
              activations: Sequence[ShardMemoryPlan] | None) -> int:
    """Planned device peak of the training task ``(kind, shard)`` (bytes).

    What :meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_peak_bytes` returns (the rule
    is documented there); also the planner's, before its plan is made.

    Raises:
        ValueError: ``kind`` is neither ``"forward"`` nor ``"backward"``, or ``activations``
            are for another number of shards.
    """
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


def state_fits(shards: Sequence[ShardPlan], shard: int,
               activations: Sequence[ShardMemoryPlan] | None, limit_bytes: int) -> bool:
    """Whether ``shard``'s backward task's planned peak plus its optimizer state fit."""
    peak = task_peak(shards, "backward", shard, activations)
    return peak + shards[shard].optimizer_bytes <= limit_bytes


def steady_task_bytes(
    shards: Sequence[ShardPlan], grad_clip: bool, batch_size: int,
    activations: Sequence[ShardMemoryPlan] | None = None, host_update: bool = False,
) -> list[int]:
    """Bytes each shard task of a steady-state step moves, in task order (no shard resident).

    :meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes` of the middle of three
    steps of ``batch_size`` blocks: the plan's swap volume per step (``host_update``: with
    the updates on the host).
    """
    per_step = 2 * len(shards) - 1
    three = shard_task_bytes(shards, grad_clip, batch_size, 3, 1, activations=activations,
                             host_update=host_update)
    middle = three[per_step : 2 * per_step]
    return [t.shard_bytes + t.promote_bytes + t.demote_bytes + t.write_back_bytes
            for t in middle]


def task_order(num_shards: int) -> list[tuple[str, int]]:
    """A step's tasks of a job of ``num_shards`` shards, as ``(kind, shard)``.

    Forward of ``0..S-2``, then backward of ``S-1..0`` (the last shard's forward runs in its
    backward task).
    """
    last = num_shards - 1
    return [("forward", i) for i in range(last)] + [("backward", i) for i in range(last, -1, -1)]
