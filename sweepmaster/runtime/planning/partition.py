"""Cut a job's layers into shards whose working sets fit a device budget.

A shard is a contiguous range of layers. At their peak its tasks
(:mod:`~sweepmaster.runtime.training.spill`) hold: forward, parameters + one microbatch's input +
the largest layer transient (no grad); backward, parameters + gradients + the boundary input + the
shard's recompute activations of one microbatch + the backward transient, then for the
just-in-time update parameters + gradients + optimizer state + the step's transient; plus the next
shard's parameters while they are prefetched (double buffering). Two partitioners cut:

* :func:`estimate_partition` packs layers from a
  :class:`~sweepmaster.runtime.planning.profile.ModelProfile` (Harmony, Li et al. VLDB 2022,
  Algorithm 2, balanced-time packing): the fewest shards that fit, then the fastest slowest one,
  by dynamic programming over cut points, for several prefetch reserves, keeping the lowest
  estimated step time. Each shard runs the largest microbatch (halving from the batch) that each
  of its layers fits alone: small microbatches never buy fewer shards.
* :func:`pilot_partition` is Hydra's pilot pass (Nagrecha & Kumar 2022, Algorithm 1): grow the
  shard a layer at a time, really training it on the device under the budget; cut before the
  layer that runs out of memory.

:func:`plan_job` profiles and partitions into a
:class:`~sweepmaster.runtime.planning.plans.JobPlan` (what ``sweepmaster plan`` prints);
:func:`cached_plan` keeps plans in a :class:`PlanCache` per (:func:`plan_cache_key`, budget,
:func:`device_kind`), across processes and launches. A pipeline of a job's shards over several
devices is packed by the same packer (:mod:`~sweepmaster.runtime.planning.pipeline_plan`).

Example:
    >>> plan = plan_job(spec, parse_devices("cpu:1x64MiB")[0])  # doctest: +SKIP
    >>> plan.spill, len(plan.shards), plan.num_tasks_per_step  # doctest: +SKIP
    (True, 4, 7)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from sweepmaster.runtime.devices.device import Device, VirtualDevice
from sweepmaster.runtime.planning.plans import (
    JobPlan,
    KeyedCache,
    LayerTooLargeError,
    ShardPlan,
    _order,
    prefetch_fits,
    steady_task_bytes,
)
from sweepmaster.runtime.planning.profile import (
    LayerProfile,
    ModelProfile,
    optimizer_state_bytes,
    pilot_pass,
    plain_footprint_bytes,
    profile_model,
)
from sweepmaster.workload.architecture import architecture_key
from sweepmaster.workload.spec import OptimizerSpec, TrainSpec

__all__ = [
    "PlanCache", "cached_plan", "device_kind", "estimate_partition", "make_plan", "optimizer_key",
    "pilot_partition", "plan_cache_key", "plan_job", "prefetch_candidates",
]

#: Host <-> device copy bandwidth assumed for step-time estimates (bytes/s): CPU memcpy of a
#: virtual device (fresh pages), and pinned PCIe copies of a GPU.
_COPY_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 12.0e9}
#: Fractions of the budget tried as the prefetch reserve.
_RESERVE_FRACTIONS = (0.0, 0.125, 0.25, 0.375)
#: Bumped whenever :class:`JobPlan`'s fields or the partitioner's choices change, so plans cached
#: by an older version are not reused (part of :func:`plan_cache_key`).
PLAN_FORMAT_VERSION = 5

#: Fills in what each pass of a shard promotes besides its boundaries (a fused array's dropout
#: noise and LoRA scalings: :attr:`ShardPlan.noise_bytes`, :attr:`ShardPlan.scaling_bytes`).
PassBytes = Callable[[ShardPlan], ShardPlan]


def plan_job(
    spec: TrainSpec, device: Device, *, microbatch_size: int | None = None,
    method: str = "estimate", measure: bool = False, profile: ModelProfile | None = None,
    budget_bytes: int | None = None, whole: bool = False,
) -> JobPlan:
    """Profile a job and partition it for a device's budget; never trains.

    A job whose plain footprint fits the budget is one shard holding the whole model at
    ``microbatch_size`` (S = 1: it stays resident between its steps); a larger one is cut into
    the fewest shards that fit.

    Args:
        spec: The job.
        device: The device (its ``budget_bytes`` is the budget).
        microbatch_size: The largest blocks per layer pass; default ``spec.batch_size``.
        method: ``"estimate"`` (:func:`estimate_partition`) or ``"pilot"``
            (:func:`pilot_partition`, runs real passes on ``device`` at ``microbatch_size``).
        measure: Time layers with a real pass (see ``profile_model``).
        profile: A profile to reuse (e.g. from a cache) instead of profiling.
        budget_bytes: Plan for this budget instead of the device's (bytes), e.g. the smaller
            one the executor re-plans a job for after it ran out of memory; ``"estimate"`` only.
        whole: One shard holding the whole model whatever the budget (a job that must not
            spill; on a metered device it runs out of memory if it does not fit).

    Raises:
        LayerTooLargeError: A layer alone does not fit the budget, even one block at a time.
        ValueError: Bad ``method`` or ``microbatch_size``.
    """
    if method not in ("estimate", "pilot"):
        raise ValueError(f"method must be 'estimate' or 'pilot', got {method!r}")
    if budget_bytes is not None and method != "estimate":
        raise ValueError("budget_bytes needs method='estimate' (a pilot pass runs on the device)")
    if profile is None:
        profile = profile_model(spec, microbatch_size, measure=measure, device=device)
    budget = device.budget_bytes if budget_bytes is None else budget_bytes
    if whole or _plain_bytes(profile, spec.optimizer) <= budget:
        cuts, rows = [0, len(profile.layers)], [profile.microbatch_size]
    elif method == "pilot":
        fits = pilot_pass(spec, device, profile.microbatch_size)
        names = [layer.name for layer in profile.layers]
        cuts = pilot_partition(len(profile.layers), fits, names, budget)
        rows = [profile.microbatch_size] * (len(cuts) - 1)
    else:
        cuts, rows = estimate_partition(profile, spec.optimizer, budget, device.torch_device.type)
    return make_plan(profile, spec.optimizer, cuts, device, method=method, microbatch_sizes=rows,
                     budget_bytes=budget)


#: Plans per (:func:`plan_cache_key`, budget, :func:`device_kind`);
#: :class:`sweepmaster.store.partitions.StorePlanCache` keeps them in ``sm_partitions``.
PlanCache = KeyedCache[JobPlan]


def plan_cache_key(
    spec: TrainSpec, microbatch_size: int | None = None, method: str = "estimate"
) -> str | None:
    """The key a job's plan is cached under: what its shards depend on, besides the device.

    The :func:`~sweepmaster.workload.architecture.architecture_key` of the job (model config,
    dtype, ``B``, ``T``), the microbatch limit (``plan_job``'s; ``None``: the batch),
    :func:`optimizer_key`, the partitioner (``method``) and :data:`PLAN_FORMAT_VERSION`, e.g.
    ``"3f9c0e1d2b4a5c6d/mb8/adamw/estimate/p2"`` (at most 64 characters); ``None`` when the
    model has no stable identity (a factory without an ``architecture_key``): not cached.

    Raises:
        DataError: The config of a pretrained model cannot be loaded.
    """
    try:
        arch = architecture_key(spec)
    except ValueError:
        return None
    rows = microbatch_size or spec.batch_size
    return f"{arch}/mb{rows}/{optimizer_key(spec.optimizer)}/{method}/p{PLAN_FORMAT_VERSION}"


def optimizer_key(opt: OptimizerSpec) -> str:
    """What of an optimizer changes bytes and time, e.g. ``"adamw"``, ``"sgd+momentum+clip"``."""
    key = opt.name + ("+momentum" if opt.name == "sgd" and opt.momentum > 0 else "")
    return key + ("+clip" if opt.grad_clip is not None else "")


def device_kind(device: Device) -> str:
    """What kind of hardware a device is, for the plan cache (at most 32 characters).

    ``"cpu"`` for the host and virtual devices (the budget is the rest of the key), or
    ``"cuda:<GPU name>"``, e.g. ``"cuda:NVIDIA H100 80GB HBM3"``: step-time estimates come from
    the device's calibrated speed, so GPUs of different models do not share plans.
    """
    if isinstance(device, VirtualDevice) or device.torch_device.type == "cpu":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_name(device.torch_device)}"[:32]


def cached_plan(
    spec: TrainSpec, device: Device, cache: PlanCache | None, *,
    microbatch_size: int | None = None, method: str = "estimate",
) -> JobPlan:
    """:func:`plan_job`, consulting ``cache`` (``None``: always plan) and filling it on a miss.

    A cached plan is returned for ``device`` (its ``device`` field renamed): devices of one kind
    and budget share plans. Plans that fail (:class:`LayerTooLargeError`) are not cached.

    Example:
        >>> plan = cached_plan(spec, device, StorePlanCache(engine))  # doctest: +SKIP

    Raises:
        LayerTooLargeError: A layer alone does not fit the budget.
        UnsupportedModelError: The model cannot be split into layers.
        DataError: The config of a pretrained model cannot be loaded.
    """
    key = plan_cache_key(spec, microbatch_size, method) if cache is not None else None
    if cache is None or key is None:
        return plan_job(spec, device, microbatch_size=microbatch_size, method=method)
    kind, budget = device_kind(device), device.budget_bytes
    plan = cache.get(key, budget, kind)
    if plan is not None:
        return dataclasses.replace(plan, device=device.name)
    plan = plan_job(spec, device, microbatch_size=microbatch_size, method=method)
    cache.put(key, budget, kind, plan)
    return plan


def pilot_partition(
    num_layers: int, fits: Callable[[int, int], int], layer_names: Sequence[str],
    budget_bytes: int,
) -> list[int]:
    """Hydra's pilot-pass partitioner (Algorithm 1): cut points ``[0, c1, ..., num_layers]``.

    Grow the current shard layer by layer; ``fits(start, stop)`` runs a pilot pass of layers
    ``[start, stop)`` on the device and returns its peak bytes, or raises
    ``torch.OutOfMemoryError``: then the shard is cut before the layer. ``layer_names`` and
    ``budget_bytes`` are for the error message.

    Raises:
        LayerTooLargeError: A single layer runs out of memory.
    """
    cuts = [0]
    for stop in range(1, num_layers + 1):
        for start in sorted({cuts[-1], stop - 1}):  # grow the shard, else cut before the layer
            try:
                fits(start, stop)
                break
            except torch.OutOfMemoryError:
                continue
        else:
            raise LayerTooLargeError(layer_names[stop - 1], budget_bytes + 1, budget_bytes)
        if start > cuts[-1]:
            cuts.append(start)
    return [*cuts, num_layers]


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
    prefetch_margin: float = 0.0,
) -> JobPlan:
    """Build the :class:`JobPlan` of ``profile`` cut at ``cuts`` ``[0, c1, ..., num_layers]``.

    ``microbatch_sizes`` are each shard's blocks per pass; default as :func:`estimate_partition`
    chooses (halving from ``profile.microbatch_size``), else the largest that fits, or 1.
    ``budget_bytes`` defaults to the device's; ``method`` is recorded in the plan;
    ``pass_bytes`` fills in each shard's pass bytes, counted in its swap volume and seconds.
    ``prefetch_margin``: the plan's :attr:`~JobPlan.prefetch_margin`, which its prefetch
    choices keep (:meth:`~JobPlan.prefetch_fits`).
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
    prefetch = _prefetch_flags(costs, cuts, rows, budget, prefetch_margin)
    order = _order(len(shards))
    peaks = [costs.task_peak(kind, cuts[i], cuts[i + 1], rows[i]) for kind, i in order]
    nexts = [costs.param_bytes(cuts[i], cuts[i + 1]) for _, i in order[1:]] + [0]
    peak = max(p + (n if f else 0) for p, n, f in zip(peaks, nexts, prefetch, strict=True))
    plain = _plain_bytes(profile, optimizer)
    step_s = _step_seconds(costs, cuts, rows, budget, device.torch_device.type, shards,
                           prefetch_margin)
    return JobPlan(
        device=device.name, budget_bytes=budget, batch_size=profile.batch_size,
        microbatch_size=profile.microbatch_size, plain_bytes=plain, spill=plain > budget,
        shards=tuple(shards), prefetch=tuple(prefetch), peak_bytes=peak,
        num_tasks_per_step=2 * len(shards) - 1,
        swap_bytes_per_step=sum(steady_task_bytes(shards, optimizer.grad_clip is not None,
                                                  profile.batch_size)),
        step_s=step_s, method=method, grad_clip=optimizer.grad_clip is not None,
        prefetch_margin=prefetch_margin,
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
            borrowed_bytes=costs.borrowed_bytes(start, stop),
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


def _plain_bytes(profile: ModelProfile, optimizer: OptimizerSpec) -> int:
    return plain_footprint_bytes(
        profile.param_bytes, profile.plain_activation_peak_bytes, optimizer,
        sum(profile.frozen_param_bytes.values()),
    )


class _Costs:
    """Bytes and seconds of candidate shards ``[start, stop)`` on ``rows``-block microbatches."""

    def __init__(self, profile: ModelProfile, optimizer: OptimizerSpec,
                 pass_bytes: PassBytes | None = None) -> None:
        self.profile = profile
        self.optimizer = optimizer
        self.pass_bytes = pass_bytes
        self.num_layers = len(profile.layers)
        self.batch_size = profile.batch_size
        self.row_options = sorted(
            {max(1, math.ceil(profile.microbatch_size / 2**k)) for k in range(32)}, reverse=True
        )
        self._layers: dict[int, tuple[LayerProfile, ...]] = {}
        self._shard_rows: dict[tuple[int, int, int], int | None] = {}
        self.first_use: dict[str, int] = {}
        self.last_use: dict[str, int] = {}
        for index, layer in enumerate(profile.layers):
            for name in layer.param_names:
                self.first_use.setdefault(name, index)
                self.last_use[name] = index

    def layers(self, rows: int) -> tuple[LayerProfile, ...]:
        if rows not in self._layers:
            self._layers[rows] = tuple(self.profile.layer(i, rows) for i in range(self.num_layers))
        return self._layers[rows]

    def scale(self, rows: int) -> float:
        """Microbatch -> minibatch factor."""
        return self.batch_size / rows

    def _names(self, start: int, stop: int) -> set[str]:
        layers = self.profile.layers
        return {name for layer in layers[start:stop] for name in layer.param_names}

    def _owned(self, start: int, stop: int) -> list[str]:
        return [n for n in self._names(start, stop) if start <= self.first_use[n]]

    def param_bytes(self, start: int, stop: int) -> int:
        """Parameters the shard holds while resident, trainable and frozen (bytes)."""
        frozen = {name for layer in self.profile.layers[start:stop]
                  for name in layer.frozen_param_names}
        return self.grad_bytes(start, stop) + sum(
            self.profile.frozen_param_bytes[n] for n in frozen)

    def grad_bytes(self, start: int, stop: int) -> int:
        """Trainable parameters the shard uses, i.e. its gradients (bytes)."""
        return sum(self.profile.param_bytes[n] for n in self._names(start, stop))

    def owned_bytes(self, start: int, stop: int) -> int:
        return sum(self.profile.param_bytes[n] for n in self._owned(start, stop))

    def optimizer_bytes(self, start: int, stop: int) -> int:
        sizes = self.profile.param_bytes
        owned = self._owned(start, stop)
        return sum(optimizer_state_bytes(sizes[n], self.optimizer) for n in owned)

    def contribution_bytes(self, start: int, stop: int) -> int:
        """Gradient contributions to owned parameters from later shards (bytes)."""
        sizes = self.profile.param_bytes
        return sum(sizes[n] for n in self._owned(start, stop) if self.last_use[n] >= stop)

    def borrowed_bytes(self, start: int, stop: int) -> int:
        sizes = self.profile.param_bytes
        return sum(sizes[n] for n in self._names(start, stop) if self.first_use[n] < start)

    def forward_peak(self, start: int, stop: int, rows: int) -> int:
        layers = self.layers(rows)
        transient = max(
            (layers[i].input_bytes if i > start else 0) + layers[i].forward_peak_bytes
            for i in range(start, stop)
        )
        return self.param_bytes(start, stop) + layers[start].input_bytes + transient

    def backward_peak(self, start: int, stop: int, rows: int) -> int:
        layers = self.layers(rows)
        params = self.param_bytes(start, stop)
        grads = self.grad_bytes(start, stop)
        accumulated = grads if math.ceil(self.batch_size / rows) > 1 else 0
        saved = 0
        compute = 0
        for i in range(start, stop):
            compute = max(compute, saved + layers[i].train_forward_peak_bytes + accumulated)
            saved += layers[i].saved_bytes
        later_grads = 0
        for i in range(stop - 1, start - 1, -1):
            saved -= layers[i].saved_bytes
            incoming = layers[i].output_bytes if i < self.num_layers - 1 else 0
            grads_alive = accumulated or later_grads
            compute = max(compute, saved + layers[i].backward_peak_bytes + incoming + grads_alive)
            later_grads += sum(self.profile.param_bytes[n] for n in layers[i].param_names)
        compute += params + layers[start].input_bytes
        if self.optimizer.grad_clip is not None and start > 0:
            return compute
        return max(compute, self.update_peak(start, stop))

    def update_peak(self, start: int, stop: int) -> int:
        """Just-in-time update: parameters, gradients, state, the step's transient (0: none)."""
        owned = self._owned(start, stop)
        if not owned:
            return 0
        transient = max(self.contribution_bytes(start, stop),
                        2 * max(self.profile.param_bytes[n] for n in owned))
        return (self.param_bytes(start, stop) + self.grad_bytes(start, stop)
                + self.optimizer_bytes(start, stop) + transient)

    def task_peak(self, kind: str, start: int, stop: int, rows: int) -> int:
        clip = self.optimizer.grad_clip is not None and start > 0
        if kind == "forward":
            peak = self.forward_peak(start, stop, rows)
            return max(peak, self.deferred_update_peak(start, stop)) if clip else peak
        peak = self.backward_peak(start, stop, rows)
        if clip and stop == self.num_layers:
            peak = max(peak, self.deferred_update_peak(start, stop))
        return peak

    def deferred_update_peak(self, start: int, stop: int) -> int:
        """An update ``grad_clip`` deferred: its gradients come back (0: nothing to update)."""
        owned = self._owned(start, stop)
        if not owned:
            return 0
        biggest = max(self.profile.param_bytes[n] for n in owned)
        return (
            self.param_bytes(start, stop)
            + self.owned_bytes(start, stop)
            + self.optimizer_bytes(start, stop)
            + 2 * biggest
        )

    def peak(self, start: int, stop: int, rows: int) -> int:
        """Largest task peak of a shard, whether or not it is the last one."""
        return max(
            self.task_peak("forward", start, stop, rows),
            self.task_peak("backward", start, stop, rows),
        )

    def rows_that_fit(self, start: int, stop: int, limit: int) -> int | None:
        """The largest microbatch (from the halving ladder) whose peak fits ``limit``."""
        for rows in self.row_options:
            if self.peak(start, stop, rows) <= limit:
                return rows
        return None

    def shard_rows(self, start: int, stop: int, limit: int) -> int | None:
        """A shard's microbatch: the largest each of its layers fits alone, if the shard fits.

        Microbatches stay as large as the layers allow (small ones run slower than FLOPs say);
        a shard only packs more layers at that size.
        """
        key = (start, stop, limit)
        if key not in self._shard_rows:
            rows = min(self._layer_rows(i, limit) or 0 for i in range(start, stop))
            fits = rows > 0 and self.peak(start, stop, rows) <= limit
            self._shard_rows[key] = rows if fits else None
        return self._shard_rows[key]

    def _layer_rows(self, index: int, limit: int) -> int | None:
        key = (index, index + 1, limit)
        if key not in self._shard_rows:
            self._shard_rows[key] = self.rows_that_fit(index, index + 1, limit)
        return self._shard_rows[key]

    def forward_s(self, start: int, stop: int) -> float:
        rows = self.profile.microbatch_size
        return self.scale(rows) * sum(layer.forward_s for layer in self.layers(rows)[start:stop])

    def backward_s(self, start: int, stop: int) -> float:
        rows = self.profile.microbatch_size
        return self.scale(rows) * sum(
            layer.forward_s + layer.backward_s for layer in self.layers(rows)[start:stop]
        )


def _prefetch_flags(
    costs: _Costs, cuts: list[int], rows: list[int], budget: int, margin: float
) -> list[bool]:
    """Whether each task of a step may prefetch the next one's parameters within the budget.

    By the rule the job applies when it runs (:func:`prefetch_fits`, with its plan's margin).
    """
    order = _order(len(cuts) - 1)
    flags = []
    for position, disjoint in enumerate(_disjoint_nexts(costs._names, cuts)):
        kind, shard = order[position]
        _, next_shard = order[(position + 1) % len(order)]
        peak = costs.task_peak(kind, cuts[shard], cuts[shard + 1], rows[shard])
        following = costs.param_bytes(cuts[next_shard], cuts[next_shard + 1])
        flags.append(disjoint and prefetch_fits(peak, following, budget, margin))
    return flags


def _disjoint_nexts(names: Callable[[int, int], set[str]], cuts: Sequence[int]) -> list[bool]:
    """Per task of a step, whether the next task's shard shares no trainable parameter with it.

    ``names(start, stop)``: the trainable parameters of layers ``[start, stop)``. ``False`` for
    the last task: the next is the next step's first (same shard or shares state).
    """
    order = _order(len(cuts) - 1)
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
    bandwidth = _COPY_BYTES_PER_S.get(device_type, _COPY_BYTES_PER_S["cpu"])
    order = _order(len(cuts) - 1)
    flags = _prefetch_flags(costs, cuts, rows, budget, prefetch_margin)
    if shards is None:
        shards = _shards(costs, cuts, rows)
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
