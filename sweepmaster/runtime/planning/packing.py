"""Harmony's balanced-time packing of layers into shards, and the plan of given cut points.

* :func:`estimate_partition` packs layers from a
  :class:`~sweepmaster.runtime.planning.profile.ModelProfile` (Harmony, Li et al. VLDB 2022,
  Algorithm 2, balanced-time packing): the fewest shards that fit, then the fastest slowest one,
  by dynamic programming over cut points, for several prefetch reserves, keeping the lowest
  estimated step time. Each shard runs the largest microbatch (halving from the batch) that each
  of its layers fits alone: small microbatches never buy fewer shards.
* :func:`make_plan` builds the :class:`~sweepmaster.runtime.planning.plans.JobPlan` of cut
  points (this packer's, those of Hydra's pilot pass in
  :mod:`~sweepmaster.runtime.planning.pilot`, or a caller's): each shard's bytes, its tasks'
  peaks with the next shard's parameters prefetched (double buffering) where they fit, its swap
  volume and estimated seconds.

Shard costs come from :mod:`~sweepmaster.runtime.planning.shard_costs`. A pipeline of a job's
shards over several devices is packed by the same packer
(:mod:`~sweepmaster.runtime.planning.pipeline_plan`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.plans import (
    JobPlan,
    LayerTooLargeError,
    ShardPlan,
    prefetch_fits,
)
from sweepmaster.runtime.planning.profile import ModelProfile
from sweepmaster.runtime.planning.shard_costs import PassBytes, _Costs, _plain_bytes
from sweepmaster.runtime.planning.task_bytes import steady_task_bytes, task_order, task_peak
from sweepmaster.runtime.planning.update_site import update_cost
from sweepmaster.workload.spec import OptimizerSpec

__all__ = ["copy_bytes_per_s", "estimate_partition", "make_plan", "prefetch_candidates"]

#: Host <-> device copy bandwidth assumed for step-time estimates (bytes/s): CPU memcpy of a
#: virtual device (fresh pages), and pinned PCIe copies of a GPU.
_COPY_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 12.0e9}


def copy_bytes_per_s(device_type: str) -> float:
    """Host <-> device copy bandwidth (bytes/s) step-time estimates assume for a device type.

    ``"cuda"``: pinned PCIe copies of a GPU; anything else: a virtual device's CPU memcpy.
    """
    return _COPY_BYTES_PER_S.get(device_type, _COPY_BYTES_PER_S["cpu"])


#: Fractions of the budget tried as the prefetch reserve.
_RESERVE_FRACTIONS = (0.0, 0.125, 0.25, 0.375)


def estimate_partition(
    profile: ModelProfile, optimizer: OptimizerSpec, budget_bytes: int, device_type: str = "cpu",
    pass_bytes: PassBytes | None = None, prefetch_margin: float = 0.0,
) -> tuple[list[int], list[int]]:
    """Balanced-time packing of layers into shards that fit (Harmony Algorithm 2, see module doc).

    Returns cut points ``[0, c1, ..., num_layers]`` and each shard's microbatch size;
    ``device_type`` (``"cpu"`` or ``"cuda"``) sets the copy bandwidth of the step-time estimate,
    whose copies count what ``pass_bytes`` adds to each candidate shard and whose prefetches
    keep ``prefetch_margin`` (the plan's, :func:`make_plan`).

    Raises:
        LayerTooLargeError: A layer alone does not fit, even one block at a time.
    """
    costs = _Costs(profile, optimizer, pass_bytes)
    num_layers = len(profile.layers)
    for index in range(num_layers):
        if costs.rows_that_fit(index, index + 1, budget_bytes) is None:
            need = costs.peak(index, index + 1, 1)
            raise LayerTooLargeError(profile.layers[index].name, need, budget_bytes)
    best: tuple[float, list[int], list[int]] | None = None
    for fraction in _RESERVE_FRACTIONS:
        reserve = int(budget_bytes * fraction)
        packed = _pack(costs, num_layers, budget_bytes - reserve, reserve)
        if packed is None:
            continue
        cuts, rows = packed
        step_s = _step_seconds(costs, cuts, rows, budget_bytes, device_type,
                               prefetch_margin=prefetch_margin)
        if best is None or step_s < best[0]:
            best = (step_s, cuts, rows)
    assert best is not None  # reserve 0 always packs: every single layer fits
    return best[1], best[2]


def make_plan(
    profile: ModelProfile, optimizer: OptimizerSpec, cuts: Sequence[int], device: Device,
    method: str = "estimate", microbatch_sizes: Sequence[int] | None = None,
    budget_bytes: int | None = None, pass_bytes: PassBytes | None = None,
    prefetch_margin: float = 0.0, update_on: str = "auto",
) -> JobPlan:
    """Build the :class:`JobPlan` of ``profile`` cut at ``cuts`` ``[0, c1, ..., num_layers]``.

    ``microbatch_sizes`` are each shard's blocks per pass; default as :func:`estimate_partition`
    chooses (halving from ``profile.microbatch_size``), else the largest that fits, or 1.
    ``budget_bytes`` defaults to the device's; ``method`` is recorded in the plan;
    ``pass_bytes`` fills in each shard's pass bytes, counted in its swap volume and seconds.
    ``prefetch_margin``: the plan's :attr:`~JobPlan.prefetch_margin`, which its prefetch
    choices keep (:meth:`~JobPlan.prefetch_fits`). ``update_on``: where the updates run
    (:attr:`~JobPlan.update_on`): ``"auto"`` chooses by
    :func:`~sweepmaster.runtime.planning.update_site.update_cost`, ``"device"`` or
    ``"host"`` force it.

    Raises:
        ValueError: ``update_on`` is not one of ``"auto"``, ``"device"``, ``"host"``.
    """
    costs = _Costs(profile, optimizer, pass_bytes)
    budget = device.budget_bytes if budget_bytes is None else budget_bytes
    cuts = list(cuts)
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    if microbatch_sizes is None:
        rows = [
            costs.shard_rows(start, stop, budget) or costs.rows_that_fit(start, stop, budget) or 1
            for start, stop in spans
        ]
    else:
        rows = list(microbatch_sizes)
    shards = _shards(costs, cuts, rows)
    prefetch = _prefetch_flags(costs, shards, budget, prefetch_margin)
    order = task_order(len(shards))
    peaks = [task_peak(shards, kind, i, None) for kind, i in order]
    nexts = [shards[i].param_bytes for _, i in order[1:]] + [0]
    peak = max(p + (n if f else 0) for p, n, f in zip(peaks, nexts, prefetch, strict=True))
    plain = _plain_bytes(profile, optimizer)
    step_s = _step_seconds(costs, cuts, rows, budget, device.torch_device.type, shards,
                           prefetch_margin)
    update = update_cost(shards, optimizer, device.torch_device.type, update_on)
    return JobPlan(
        device=device.name, budget_bytes=budget, batch_size=profile.batch_size,
        microbatch_size=profile.microbatch_size, plain_bytes=plain, spill=plain > budget,
        shards=tuple(shards), prefetch=tuple(prefetch), peak_bytes=peak,
        num_tasks_per_step=2 * len(shards) - 1,
        swap_bytes_per_step=sum(steady_task_bytes(shards, optimizer.grad_clip is not None,
                                                  profile.batch_size,
                                                  host_update=update.update_on == "host")),
        step_s=step_s, method=method, grad_clip=optimizer.grad_clip is not None,
        prefetch_margin=prefetch_margin, update_on=update.update_on,
    )


def _shards(costs: _Costs, cuts: list[int], rows: list[int]) -> tuple[ShardPlan, ...]:
    """The shards ``[cuts[i], cuts[i + 1])`` running ``rows[i]``-block microbatches."""
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    last = len(spans) - 1
    full = costs.layers(1)  # boundary bytes are linear in rows: minibatch = B x 1 block
    shards = tuple(
        ShardPlan(
            index=index, start=start, stop=stop,
            layer_names=tuple(layer.name for layer in costs.profile.layers[start:stop]),
            microbatch_size=size, param_bytes=costs.param_bytes(start, stop),
            owned_param_bytes=costs.owned_bytes(start, stop),
            optimizer_bytes=costs.optimizer_bytes(start, stop),
            num_owned_params=len(costs._owned(start, stop)),
            input_bytes=full[start].input_bytes * costs.profile.batch_size,
            output_bytes=full[stop - 1].output_bytes * costs.profile.batch_size,
            borrowed_params=costs.borrowed_params(start, stop, cuts),
            contribution_bytes=costs.contribution_bytes(start, stop),
            activation_bytes=sum(costs.profile.layer(i, size).saved_bytes
                                 for i in range(start, stop)),
            forward_peak_bytes=(0 if index == last
                                else costs.task_peak("forward", start, stop, size)),
            backward_peak_bytes=costs.task_peak("backward", start, stop, size),
            forward_s=0.0 if index == last else costs.forward_s(start, stop),
            backward_s=costs.backward_s(start, stop),
        )
        for index, ((start, stop), size) in enumerate(zip(spans, rows, strict=True))
    )
    return shards if costs.pass_bytes is None else tuple(map(costs.pass_bytes, shards))

def _prefetch_flags(
    costs: _Costs, shards: Sequence[ShardPlan], budget: int, margin: float
) -> list[bool]:
    """Whether each task of a step may prefetch the next one's parameters within the budget.

    By the rule the job applies when it runs (:func:`prefetch_fits`, with its plan's margin,
    beside the task's planned peak).
    """
    order = task_order(len(shards))
    cuts = [shard.start for shard in shards] + [shards[-1].stop]
    flags = []
    for position, disjoint in enumerate(_disjoint_nexts(costs._names, cuts)):
        kind, shard = order[position]
        _, next_shard = order[(position + 1) % len(order)]
        peak = task_peak(shards, kind, shard, None)
        following = shards[next_shard].param_bytes
        flags.append(disjoint and prefetch_fits(peak, following, budget, margin))
    return flags


def _disjoint_nexts(names: Callable[[int, int], set[str]], cuts: Sequence[int]) -> list[bool]:
    """Per task of a step, whether the next task's shard shares no trainable parameter with it.

    ``names(start, stop)``: the trainable parameters of layers ``[start, stop)``. ``False`` for
    the last task: the next is the next step's first (same shard or shares state).
    """
    order = task_order(len(cuts) - 1)
    disjoint = []
    for (_, shard), (_, next_shard) in itertools.pairwise(order):
        ours = names(cuts[shard], cuts[shard + 1])
        disjoint.append(not ours & names(cuts[next_shard], cuts[next_shard + 1]))
    return [*disjoint, False]


def prefetch_candidates(plan: JobPlan, profile: ModelProfile) -> list[bool]:
    """Per task of a step (``plan.task_order()``), whether the next shard may prefetch at all.

    It may when it shares no trainable parameter with the task's shard (a tied one: the task
    updates it). ``profile``: the one ``plan`` was made from (a stacked plan's: the stacked
    profile).
    """
    cuts = [shard.start for shard in plan.shards] + [plan.shards[-1].stop]

    def names(start: int, stop: int) -> set[str]:
        return {name for layer in profile.layers[start:stop] for name in layer.param_names}

    return _disjoint_nexts(names, cuts)


class _Packable(Protocol):
    """The items ``[start, stop)`` :func:`_pack` packs, with their bytes and seconds.

    Layers into shards (:class:`_Costs`), or shards into a pipeline's packs
    (:mod:`~sweepmaster.runtime.planning.pipeline_plan`).
    """

    def shard_rows(self, start: int, stop: int, limit: int) -> int | None: ...

    def param_bytes(self, start: int, stop: int) -> int: ...

    def forward_s(self, start: int, stop: int) -> float: ...

    def backward_s(self, start: int, stop: int) -> float: ...


def _pack(
    costs: _Packable, num_layers: int, limit: int, reserve: int
) -> tuple[list[int], list[int]] | None:
    """Cut points (and microbatch sizes) of the fewest shards that fit, then the fastest.

    A shard fits when, at some microbatch size, its peak is at most ``limit`` and, when reserving
    for prefetch, its parameters are at most ``reserve``. Among partitions with the fewest shards,
    the one whose slowest shard is fastest. ``None`` if no partition fits.
    """
    inf = (math.inf, math.inf)
    best: list[tuple[float, float]] = [(0.0, 0.0)] + [inf] * num_layers
    back = [0] * (num_layers + 1)
    back_rows = [0] * (num_layers + 1)
    for stop in range(1, num_layers + 1):
        for start in range(stop - 1, -1, -1):
            if best[start] == inf:
                continue
            rows = costs.shard_rows(start, stop, limit)
            if rows is None:
                break  # longer shards only grow
            if reserve and costs.param_bytes(start, stop) > reserve:
                continue
            seconds = costs.forward_s(start, stop) + costs.backward_s(start, stop)
            candidate = (best[start][0] + 1, max(best[start][1], seconds))
            if candidate < best[stop]:
                best[stop] = candidate
                back[stop] = start
                back_rows[stop] = rows
    if best[num_layers] == inf:
        return None
    cuts = [num_layers]
    rows_list = []
    while cuts[-1] > 0:
        rows_list.append(back_rows[cuts[-1]])
        cuts.append(back[cuts[-1]])
    return cuts[::-1], rows_list[::-1]


def _step_seconds(
    costs: _Costs, cuts: list[int], rows: list[int], budget: int, device_type: str,
    shards: Sequence[ShardPlan] | None = None, prefetch_margin: float = 0.0,
) -> float:
    """Estimated seconds of one spilled step: compute plus copies not hidden by prefetch.

    ``shards``: the shards of ``cuts`` if made already; ``prefetch_margin``: the plan's.
    """
    bandwidth = copy_bytes_per_s(device_type)
    order = task_order(len(cuts) - 1)
    if shards is None:
        shards = _shards(costs, cuts, rows)
    flags = _prefetch_flags(costs, shards, budget, prefetch_margin)
    swaps = steady_task_bytes(shards, costs.optimizer.grad_clip is not None, costs.batch_size)
    total = 0.0
    hidden = 0.0  # compute time of the previous task that can hide this one's promotion
    for position, (kind, shard) in enumerate(order):
        start, stop = cuts[shard], cuts[shard + 1]
        if kind == "forward":
            compute = costs.forward_s(start, stop)
        else:
            compute = costs.backward_s(start, stop)
        promote = costs.param_bytes(start, stop) / bandwidth
        other = swaps[position] / bandwidth - promote
        total += compute + other + max(0.0, promote - hidden)
        hidden = compute if flags[position] else 0.0
    return total
