"""Swap-vs-recompute plan of each shard's saved activations under the device budget (mu-TWO).

Hydra recomputes every activation of a shard in its backward task, most of spilling's overhead.
mu-TWO (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) chooses per activation
between keeping it on the device, swapping it to the host (overlapped with independent compute)
and recomputing it, while a memory simulator keeps the peak in the budget. Here, per shard of a
spilled job (:class:`~sweepmaster.runtime.planning.plans.JobPlan`):

* A shard leaves the device between its tasks, so outside the last shard an activation is
  swapped (per activation) or recomputed (per layer, from its input checkpointed to the host).
  The last shard runs forward and backward in one task per microbatch: there *keep* is what
  autograd does anyway, and swap or recompute pay only when keeping does not fit.
* :func:`plan_memory` profiles the activations
  (:func:`~sweepmaster.runtime.planning.memprofile.profile_shards`) and runs mu-TWO's greedy
  (:func:`~sweepmaster.runtime.planning.memgreedy.greedy_shard_decisions`) per shard: while the
  simulated peak (:func:`~sweepmaster.runtime.planning.memsim.simulate_shard`, Alg. G) exceeds
  the budget, take the move that frees the most peak bytes per second of added time (swaps by
  inactive time, Alg. B; recomputes by bytes per second, Alg. C); then, in the same orders,
  accept every move that lowers the simulated time within the budget. The first fetch of a
  backward task hides behind ``overlap_s`` seconds of other jobs' tasks (SHARP) and, where it
  fits, the job's previous backward task (``SpilledJob.prefetch``); shards are planned last to
  first, so each knows the peak of the task before it. Predicted peaks stay 0.5% under the
  budget (the optimizer step's small transients are not modelled).
* :func:`~sweepmaster.runtime.planning.memplan_milp.optimal_shard_decisions` solves the same choice
  exactly (a MILP over the simulator's equations) as a reference.

Example:
    >>> plan = plan_job(spec, device)  # doctest: +SKIP
    >>> memory = plan_memory(spec, plan, device=device)  # doctest: +SKIP
    >>> result = train_spilled(spec, device, plan, memory_plan=memory)  # doctest: +SKIP
    >>> for row in memory.summary():  # doctest: +SKIP
    ...     print(row.shard, row.decisions, row.swapped_bytes, row.overhead_s)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.json_records import record_from_json, record_to_json
from sweepmaster.runtime.planning.memgreedy import MemoryPlanError, greedy_shard_decisions
from sweepmaster.runtime.planning.memprofile import (
    ShardMemoryProfile,
    TracedLayers,
    profile_shards,
)
from sweepmaster.runtime.planning.memsim import (
    LayerDecision,
    _kept_bytes,
    simulate_shard,
    stage_item_bytes,
)
from sweepmaster.runtime.planning.packing import prefetch_candidates
from sweepmaster.runtime.planning.plans import JobPlan, KeyedCache
from sweepmaster.runtime.planning.profile import ModelProfile, profile_model
from sweepmaster.runtime.planning.timing import measure_copy_bandwidth
from sweepmaster.workload.spec import TrainSpec

__all__ = [
    "MemoryPlanCache", "MemoryPlan", "MemoryPlanError", "MemoryPlanRow", "ShardMemoryPlan",
    "cached_memory_plan", "memory_plan_key", "plan_memory", "plan_shard",
]

Method = Literal["greedy", "optimal"]
#: Share of the budget kept free: the optimizer step's small transients (step counters, scalar
#: temporaries) that the analytic update peak leaves out (measured well below 0.5%).
_SAFETY_FRACTION = 0.005


def _limit(budget_bytes: int) -> int:
    return int(budget_bytes * (1 - _SAFETY_FRACTION))


@dataclass(frozen=True)
class ShardMemoryPlan:
    """The swap/recompute decisions of one shard and what they cost.

    Byte totals are per microbatch; seconds and swap bytes per optimizer step.

    Attributes:
        index: The shard index.
        last: Whether it is the last shard.
        layer_names: Its layers.
        decisions: One per layer.
        kept_bytes: Activation bytes kept on the device.
        swapped_bytes: Activation bytes swapped.
        recomputed_bytes: Activation bytes recomputed.
        peak_bytes: Predicted peak of its tasks, like ``forward_peak_bytes`` (0 for the last
            shard) and ``backward_peak_bytes`` of each.
        forward_s: Estimated seconds of its forward task, like ``backward_s``.
        overhead_s: Predicted seconds of recompute (``recompute_s``) and of compute waiting for
            activation copies (``stall_s``).
        full_recompute_s: Seconds Hydra's full recompute spends on this shard.
        offload_bytes: Activation bytes copied device -> host per step: in its forward task, or
            in the backward task of the last shard (which runs its forward there).
        fetch_bytes: Activation bytes copied host -> device per step, in its backward task (a
            recomputed first layer's checkpoint is the shard input: fetched, not promoted).
        early_fetch_bytes: Bytes of the backward task's first fetch that run during the job's
            previous task (``SpilledJob.prefetch``); 0 when it waits for its own task.
    """

    index: int
    last: bool
    layer_names: tuple[str, ...]
    decisions: tuple[LayerDecision, ...]
    kept_bytes: int
    swapped_bytes: int
    recomputed_bytes: int
    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_s: float
    backward_s: float
    overhead_s: float
    recompute_s: float
    stall_s: float
    full_recompute_s: float
    offload_bytes: int
    fetch_bytes: int
    early_fetch_bytes: int = 0

    @property
    def swap_bytes(self) -> int:
        """Activation bytes copied between host and device per step, either way (bytes)."""
        return self.offload_bytes + self.fetch_bytes

    @property
    def codes(self) -> str:
        """One letter per layer: ``K`` keep, ``S`` swap, ``R`` recompute, ``M`` mixed."""
        return "".join(decision.code for decision in self.decisions)


@dataclass(frozen=True)
class MemoryPlanRow:
    """One line of ``sweepmaster plan``'s swap/recompute table (see :meth:`MemoryPlan.summary`).

    Attributes as :class:`ShardMemoryPlan`'s, but ``shard`` (its index), ``layers`` (first and
    last layer name, e.g. ``"block.2-block.3"``) and ``decisions`` (its ``codes``).
    """

    shard: int
    layers: str
    decisions: str
    kept_bytes: int
    swapped_bytes: int
    recomputed_bytes: int
    peak_bytes: int
    overhead_s: float
    full_recompute_s: float


@dataclass(frozen=True)
class MemoryPlan:
    """A job's swap/recompute plan on one device (see the module doc).

    Attributes:
        device: Name of the device planned for.
        budget_bytes: The budget the shards' tasks stay within.
        bandwidth: Host <-> device copy bandwidth assumed (bytes/s).
        overlap_s: Seconds of independent compute assumed before each backward task.
        method: ``"greedy"`` (mu-TWO), ``"optimal"`` (MILP, last shard greedy) or ``"given"``
            (decisions passed in).
        shards: One plan per shard.
        peak_bytes: Predicted peak of the job (parameter prefetch of the next task included).
        prefetch: Per task of a step (``JobPlan.task_order``), whether the next task's
            parameters still fit beside it.
        step_s: Estimated seconds per step (the job plan's, with this plan's recompute).
        swap_bytes_per_step: Estimated host <-> device bytes per steady-state step.
    """

    device: str
    budget_bytes: int
    bandwidth: float
    overlap_s: float
    method: str
    shards: tuple[ShardMemoryPlan, ...]
    peak_bytes: int
    prefetch: tuple[bool, ...]
    step_s: float
    swap_bytes_per_step: int

    @property
    def limit_bytes(self) -> int:
        """The bytes predicted peaks stay within: the budget less a 0.5% safety margin."""
        return _limit(self.budget_bytes)

    def summary(self) -> tuple[MemoryPlanRow, ...]:
        """One row per shard: decisions, kept / swapped / recomputed bytes, peak, overhead."""
        rows = []
        for s in self.shards:
            names = s.layer_names
            span = names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"
            rows.append(MemoryPlanRow(
                shard=s.index, layers=span, decisions=s.codes, kept_bytes=s.kept_bytes,
                swapped_bytes=s.swapped_bytes, recomputed_bytes=s.recomputed_bytes,
                peak_bytes=s.peak_bytes, overhead_s=s.overhead_s,
                full_recompute_s=s.full_recompute_s))
        return tuple(rows)

    def to_json(self) -> str:
        """Serialize to a JSON string (see :meth:`from_json`)."""
        return record_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> MemoryPlan:
        """Inverse of :meth:`to_json` (:func:`~.json_records.record_from_json`)."""
        return record_from_json(cls, text)


@runtime_checkable
class MemoryPlanCache(Protocol):
    """Where swap / recompute plans are kept beside the partitions they were made for.

    Keyed like :class:`~sweepmaster.runtime.planning.partition.PlanCache` (plan key, budget, device
    kind); :class:`sweepmaster.store.partitions.StorePlanCache` keeps them in ``sm_partitions``.
    Both methods may be called from any thread; a miss or an unreadable entry is ``None``.
    """

    def get_memory_plan(self, key: str, budget_bytes: int, device_kind: str) -> MemoryPlan | None:
        """Return the memory plan stored for the entry, or ``None``."""
        ...

    def put_memory_plan(
        self, key: str, budget_bytes: int, device_kind: str, plan: MemoryPlan
    ) -> None:
        """Store ``plan`` for the entry (whose partition must be stored already)."""
        ...


def memory_plan_key(plan_key: str, num_members: int = 1) -> str:
    """The key a memory plan is kept under in a :class:`MemoryPlanCache`.

    A job's plan key (:func:`~sweepmaster.runtime.planning.partition.plan_cache_key`); for a
    spilled fused array of K > 1 stacked members, that key with ``"/x{K}"`` after it (e.g.
    ``"3f9c0e1d2b4a5c6d/mb8/adamw/estimate/p2/x4"``; a plan key has at most 54 characters for
    a microbatch limit under 10**5, so with K < 10**6 this stays within the store's 64): the
    entry then holds the stacked partition
    (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`) and its memory plan.

    Raises:
        ValueError: ``num_members`` < 1.
    """
    if num_members < 1:
        raise ValueError(f"num_members must be >= 1, got {num_members}")
    return plan_key if num_members == 1 else f"{plan_key}/x{num_members}"


def cached_memory_plan(
    cache: KeyedCache[JobPlan] | None, plan_key: str | None, device_kind: str, plan: JobPlan,
    make: Callable[[], MemoryPlan], *, num_members: int = 1,
) -> MemoryPlan | None:
    """``make()``'s memory plan of ``plan``, kept beside ``plan`` in ``cache``.

    Read from ``cache`` (when it is a :class:`MemoryPlanCache`) under
    :func:`memory_plan_key` of ``plan_key`` and K, ``plan.budget_bytes`` and ``device_kind``;
    on a miss made by ``make`` and stored there with ``plan`` as the entry's partition (kept if
    one is stored already), so a later process reads it instead of tracing the shards again.
    One code path for a single spilled job (K = 1, ``plan`` from
    :func:`~sweepmaster.runtime.planning.partition.cached_plan`) and a spilled fused array
    (K members, ``plan`` their stacked partition).

    Args:
        cache: The plan cache, or ``None`` (always ``make``).
        plan_key: The job's plan key, or ``None`` (a model without one: never cached).
        device_kind: :func:`~sweepmaster.runtime.planning.partition.device_kind` of the device.
        plan: The partition the memory plan is for (K members' stacked shards for K > 1).
        make: Plans the activations (:func:`plan_memory`, or
            :func:`~sweepmaster.runtime.training.fused_memplan.plan_stacked_memory`).
        num_members: K.

    Returns:
        The memory plan, or ``None`` when ``make`` raises :class:`MemoryPlanError` (no plan
        fits: every activation is recomputed).
    """
    store = cache if isinstance(cache, MemoryPlanCache) and plan_key is not None else None
    key = memory_plan_key(plan_key, num_members) if plan_key is not None else ""
    if store is not None:
        memory = store.get_memory_plan(key, plan.budget_bytes, device_kind)
        if memory is not None:
            return memory
    try:
        memory = make()
    except MemoryPlanError:
        return None
    if store is not None and cache is not None:
        cache.put(key, plan.budget_bytes, device_kind, plan)  # kept if stored already
        store.put_memory_plan(key, plan.budget_bytes, device_kind, memory)
    return memory


def plan_memory(
    spec: TrainSpec, plan: JobPlan, *, device: Device | None = None,
    profile: ModelProfile | None = None, bandwidth: float | None = None, overlap_s: float = 0.0,
    budget_bytes: int | None = None, method: Method = "greedy",
    decisions: Sequence[Sequence[LayerDecision]] | None = None,
    layers: TracedLayers | None = None,
) -> MemoryPlan:
    """Plan keep / swap / recompute for every shard of a spilled job (see the module doc).

    A spilled fused array is planned like any job: its stacked plan and stacked profile, and
    its stacked layers to trace (``layers``), so that bytes and seconds are the K members'.

    Args:
        spec: The job.
        plan: Its partition (``plan_job``).
        device: The device (its bandwidth is measured once per process); default the host CPU.
        profile: The job's layer profile, e.g. cached; default ``profile_model`` (FLOP times).
        bandwidth: Host <-> device copy bandwidth (bytes/s); default measured on ``device``.
        overlap_s: Seconds of other jobs' compute on the device that the first fetch of each
            backward task can hide behind (SHARP interleaving); 0 for a job alone.
        budget_bytes: The budget; default the plan's. Predicted peaks stay 0.5% below it.
        method: ``"greedy"`` (mu-TWO) or ``"optimal"`` (MILP per shard but the last; slow on
            many layers).
        decisions: Given decisions (per shard, per layer) to cost instead of planning, e.g. a
            cached plan's or an experiment's; they must fit the budget.
        layers: The layers to trace instead of ``spec``'s model
            (:class:`~sweepmaster.runtime.planning.memprofile.TracedLayers`: a fused array's
            stacked layers); ``profile`` must then be given.

    Raises:
        MemoryPlanError: A shard does not fit the budget whatever is swapped or recomputed
            (or with the given ``decisions``).
        ValueError: Bad ``method``, ``overlap_s`` or ``decisions``, or ``layers`` without
            ``profile``.
    """
    if method not in ("greedy", "optimal"):
        raise ValueError(f"method must be 'greedy' or 'optimal', got {method!r}")
    if overlap_s < 0:
        raise ValueError(f"overlap_s must be >= 0, got {overlap_s}")
    device = device if device is not None else Device("cpu")
    if profile is None:
        if layers is not None:
            raise ValueError("planning traced layers needs their profile")
        profile = profile_model(spec, plan.microbatch_size, device=device)
    if bandwidth is None:
        bandwidth = measure_copy_bandwidth(device)
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    limit = _limit(budget)
    shards = profile_shards(spec, plan, profile, device, layers=layers)
    if decisions is not None and len(decisions) != len(shards):
        raise ValueError(f"decisions for {len(decisions)} shards, the plan has {len(shards)}")
    order = plan.task_order()
    planned: list[ShardMemoryPlan | None] = [None] * len(shards)
    for shard in reversed(shards):  # each backward task follows the next shard's
        early = None
        if not shard.last:
            previous = planned[shard.index + 1]
            assert previous is not None
            position = order.index(("backward", shard.index + 1))
            params = plan.shards[shard.index].param_bytes if plan.prefetch[position] else 0
            headroom = limit - previous.backward_peak_bytes - params
            if headroom > 0:
                early = (previous.backward_s, headroom)
        chosen = None if decisions is None else decisions[shard.index]
        if chosen is None and method == "optimal" and not shard.last:
            from sweepmaster.runtime.planning.memplan_milp import optimal_shard_decisions

            chosen = optimal_shard_decisions(shard, limit, bandwidth, overlap_s, early)
        planned[shard.index] = plan_shard(shard, plan, limit, bandwidth, overlap_s, chosen, early)
    done = tuple(p for p in planned if p is not None)
    name = "given" if decisions is not None else method
    return _job_plan(plan, done, budget, bandwidth, overlap_s, name,
                     prefetch_candidates(plan, profile))


def plan_shard(
    shard: ShardMemoryProfile, plan: JobPlan, budget_bytes: int, bandwidth: float,
    overlap_s: float = 0.0, decisions: Sequence[LayerDecision] | None = None,
    early: tuple[float, int] | None = None,
) -> ShardMemoryPlan:
    """The plan of one shard: ``decisions`` if given, else the greedy's, with their costs.

    ``early``: seconds and spare bytes of the job's previous task, during which the backward
    task's first fetch may run (see ``simulate_shard``).

    Raises:
        MemoryPlanError: The shard does not fit ``budget_bytes``.
    """
    if decisions is None:
        decisions = greedy_shard_decisions(shard, budget_bytes, bandwidth, overlap_s, early)
    sim = simulate_shard(shard, decisions, bandwidth, overlap_s, early=early)
    if sim.peak_bytes > budget_bytes:
        raise MemoryPlanError(shard.index, sim.peak_bytes, budget_bytes)
    pairs = list(zip(shard.layers, decisions, strict=True))
    recomputed = sum(layer.saved_bytes for layer, d in pairs if d.recompute)
    kept = sum(_kept_bytes(layer, d) for layer, d in pairs if not d.recompute)
    swapped = sum(stage_item_bytes(layer, d, True) for layer, d in pairs if not d.recompute)
    shard_plan = plan.shards[shard.index]
    full = 0.0 if shard.last else shard.num_microbatches * sum(
        layer.forward_s for layer in shard.layers
    )
    return ShardMemoryPlan(
        index=shard.index, last=shard.last,
        layer_names=tuple(layer.name for layer in shard.layers), decisions=tuple(decisions),
        kept_bytes=kept, swapped_bytes=swapped, recomputed_bytes=recomputed,
        peak_bytes=sim.peak_bytes, forward_peak_bytes=sim.forward_peak_bytes,
        backward_peak_bytes=sim.backward_peak_bytes,
        forward_s=shard_plan.forward_s + sim.forward_stall_s,
        backward_s=shard_plan.backward_s - full + sim.recompute_s + sim.backward_stall_s,
        overhead_s=sim.recompute_s + sim.stall_s, recompute_s=sim.recompute_s,
        stall_s=sim.stall_s, full_recompute_s=full, offload_bytes=sim.offload_bytes,
        fetch_bytes=sim.fetch_bytes,
        early_fetch_bytes=(
            stage_item_bytes(shard.layers[-1], decisions[-1], shard.last) if sim.early_fetch
            else 0
        ),
    )


def _job_plan(
    plan: JobPlan, shards: tuple[ShardMemoryPlan, ...], budget: int, bandwidth: float,
    overlap_s: float, method: str, candidates: Sequence[bool],
) -> MemoryPlan:
    """Job totals: peak with parameter prefetch, step seconds, swap volume per step.

    ``candidates``: per task, whether the next shard may be prefetched beside it at all
    (:func:`~sweepmaster.runtime.planning.packing.prefetch_candidates`); it is where it fits
    beside this plan's peak, as the job decides (:meth:`JobPlan.prefetch_fits`).
    """
    order = plan.task_order()
    peaks = [plan.task_peak_bytes(kind, i, shards) for kind, i in order]
    nexts = [plan.shards[i].param_bytes for _, i in order[1:]] + [0]
    prefetch = tuple(
        flag and plan.prefetch_fits(peak, following, _limit(budget))
        for flag, peak, following in zip(candidates, peaks, nexts, strict=True)
    )
    peak = max(p + (n if f else 0) for p, n, f in zip(peaks, nexts, prefetch, strict=True))
    step_s = plan.step_s + sum(s.overhead_s - s.full_recompute_s for s in shards)
    return MemoryPlan(
        device=plan.device, budget_bytes=budget, bandwidth=bandwidth, overlap_s=overlap_s,
        method=method, shards=shards, peak_bytes=peak, prefetch=prefetch, step_s=step_s,
        swap_bytes_per_step=plan.step_swap_bytes(shards),
    )
