"""Cut a job's layers into shards whose working sets fit a device budget.

A shard is a contiguous range of layers. Its shard tasks (see
:mod:`~sweepmaster.runtime.training.spill`) hold, at their peak:

* forward task: parameters + one microbatch's input + the largest layer transient (no grad);
* backward task: parameters + gradients + the boundary input + the shard's recompute activations
  for one microbatch (everything its layers save for backward) + the backward transient; then, for
  the just-in-time update, parameters + gradients + optimizer state + the step's transient;
* plus, when the next task's shard is prefetched (double buffering), that shard's parameters.

Two partitioners produce the cut points:

* :func:`estimate_partition` packs layers from a
  :class:`~sweepmaster.runtime.planning.profile.ModelProfile` (Harmony, Li et al. VLDB 2022,
  Algorithm 2, balanced-time layer packing): among contiguous partitions whose every shard fits,
  the fewest shards, then the smallest slowest shard, by dynamic programming over cut points; tried
  with several prefetch reserves, keeping the partition with the lowest estimated step time. Each
  shard runs the largest microbatch (halving from the batch size) that each of its layers fits
  alone, so e.g. only a vocabulary-sized head runs in small microbatches, and small microbatches
  never buy fewer shards.
* :func:`pilot_partition` is Hydra's pilot pass (Nagrecha & Kumar 2022, Algorithm 1): grow the
  current shard one layer at a time and run a real forward, backward and optimizer-state
  allocation of it on the device under the budget; when that runs out of memory, cut before the
  layer.

:func:`plan_job` profiles, partitions and returns a :class:`JobPlan` with everything
``sweepmaster plan`` prints: shards, their bytes and times, shard tasks and swap volume per step.
A plan serializes with :meth:`JobPlan.to_json` (no architecture key inside: the caller keys it).

:func:`cached_plan` is :func:`plan_job` behind a :class:`PlanCache` (the store's partition table
implements it): plans are kept per (:func:`plan_cache_key`, budget, :func:`device_kind`), so an
architecture is profiled and partitioned once per budget, across processes and launches.

Example:
    >>> plan = plan_job(spec, parse_devices("cpu:1x64MiB")[0])  # doctest: +SKIP
    >>> plan.spill, len(plan.shards), plan.num_tasks_per_step  # doctest: +SKIP
    (True, 4, 7)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from sweepmaster.errors import SweepmasterError
from sweepmaster.runtime.devices.device import Device, VirtualDevice
from sweepmaster.runtime.devices.meter import format_bytes
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
    "JobPlan",
    "LayerTooLargeError",
    "PlanCache",
    "ShardPlan",
    "TaskBytes",
    "cached_plan",
    "device_kind",
    "estimate_partition",
    "make_plan",
    "pilot_partition",
    "pipeline_packs",
    "plan_cache_key",
    "plan_job",
]

#: Host <-> device copy bandwidth assumed for step-time estimates (bytes/s): CPU memcpy of a
#: virtual device (fresh pages), and pinned PCIe copies of a GPU.
_COPY_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 12.0e9}
#: Fractions of the budget tried as the prefetch reserve.
_RESERVE_FRACTIONS = (0.0, 0.125, 0.25, 0.375)
#: Bumped whenever :class:`JobPlan`'s fields or the partitioner's choices change, so plans cached
#: by an older version are not reused (part of :func:`plan_cache_key`).
PLAN_FORMAT_VERSION = 3


class LayerTooLargeError(SweepmasterError, ValueError):
    """One layer alone does not fit the device budget.

    A :class:`~sweepmaster.errors.SweepmasterError` (the CLI prints its one-line message and
    exits with code 2) and, for older callers, a ``ValueError``.

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


@dataclass(frozen=True)
class ShardPlan:
    """One shard: layers ``[start, stop)`` and its estimated costs.

    Attributes:
        index: Position of the shard (0 = input side).
        start: First layer.
        stop: One past the last layer.
        layer_names: Names of its layers.
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
        forward_s: Seconds of its forward task over the minibatch.
        backward_s: Seconds of its backward task (recompute, backward, update) over the minibatch.
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

    @property
    def task_peak_bytes(self) -> int:
        """The larger of its two task peaks (bytes)."""
        return max(self.forward_peak_bytes, self.backward_peak_bytes)


@dataclass(frozen=True)
class TaskBytes:
    """Bytes one shard task moves between host and device (see :meth:`JobPlan.task_bytes`).

    Attributes:
        shard_bytes: The shard's parameters, promoted at its start unless the device holds the
            shard already (bytes).
        promote_bytes: Every other host -> device byte: boundary activations and their
            gradients, token ids, tied-gradient contributions, optimizer state, and for a
            deferred update the gradients, the clip coefficient and its shard's parameters
            (bytes).
        demote_bytes: Every device -> host byte: boundary activations and their gradients,
            tied-gradient contributions, gradient norms, the clip coefficient, optimizer state
            and the parameters an update changed (bytes).
    """

    shard_bytes: int
    promote_bytes: int
    demote_bytes: int


class SwappedActivations(Protocol):
    """Activation bytes a memory plan moves for one shard per step (mu-TWO's swaps).

    :class:`~sweepmaster.runtime.planning.memplan.ShardMemoryPlan` is one;
    :meth:`JobPlan.task_bytes` reads it.
    """

    @property
    def offload_bytes(self) -> int:
        """Device -> host bytes: in the forward task (the last shard: its backward task)."""
        ...

    @property
    def fetch_bytes(self) -> int:
        """Host -> device bytes, in the backward task (the shard input included)."""
        ...


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

    def num_microbatches(self, shard: int) -> int:
        """Microbatches per minibatch of one shard."""
        return math.ceil(self.batch_size / self.shards[shard].microbatch_size)

    def task_order(self) -> list[tuple[str, int]]:
        """``(kind, shard)`` of one step's shard tasks, in dependency order."""
        return _order(len(self.shards))

    def task_bytes(
        self,
        num_steps: int,
        *,
        first_step: int = 0,
        eval_rows: int = 0,
        eval_every: int | None = None,
        activations: Sequence[SwappedActivations] | None = None,
    ) -> list[TaskBytes]:
        """Host <-> device bytes of each shard task of ``num_steps`` steps, in task order.

        The one account of a spilled job's transfers: the policy's chain
        (:func:`~sweepmaster.runtime.execution.jobs.shard_chain`), and so the simulator, reads it,
        and it equals what :class:`~sweepmaster.runtime.training.spill.SpilledJob` moves (its
        ``swap_bytes`` and its devices' :class:`~sweepmaster.runtime.devices.device.TransferStats`)
        under Hydra's recompute of every activation (no memory plan) and under a memory plan
        (``activations``), with at most one later shard borrowing each tied parameter, when
        every shard 0 whose next task is its own stays resident. An evaluation pass runs in the
        task after the step that makes it due (the last task after the last step), and after
        the last step the last task applies the updates ``grad_clip`` deferred; a pass applies
        those of the shards it visits.

        Args:
            num_steps: Steps of the chain.
            first_step: Steps done before (a resumed job): its optimizer state exists already
                and its step-0 evaluation is done.
            eval_rows: Blocks of the evaluation set (0: no evaluation). Blocks are as long as
                the training blocks.
            eval_every: Evaluate every this many steps besides step 0 and the end; ``None``:
                only those.
            activations: Per shard, the activation bytes its memory plan swaps
                (``MemoryPlan.shards``); ``None``: Hydra's recompute, no activation moves.
                Offloads count in the forward task (the last shard: its backward task),
                fetches in the backward task, even a first fetch issued early, during the
                job's previous task; a planned backward task (not the last shard's) fetches
                its input as its first layer's checkpoint or swapped activation instead of
                promoting it.

        Returns:
            One :class:`TaskBytes` per task: forward of shards ``0..S-2`` then backward of
            ``S-1..0``, per step.
        """
        return _task_bytes(self.shards, self.grad_clip, num_steps, first_step, eval_rows,
                           eval_every, self.batch_size, activations)

    def step_swap_bytes(self, activations: Sequence[SwappedActivations] | None = None) -> int:
        """Host <-> device bytes of a steady-state step, no shard resident (bytes).

        Args:
            activations: As in :meth:`task_bytes`.
        """
        return sum(_steady_task_bytes(self.shards, self.grad_clip, activations))

    def to_json(self) -> str:
        """Serialize to a JSON string, e.g. to cache it (see :meth:`from_json`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        shards = tuple(
            ShardPlan(**{**s, "layer_names": tuple(s["layer_names"])}) for s in data.pop("shards")
        )
        return cls(shards=shards, prefetch=tuple(data.pop("prefetch")), **data)


def plan_job(
    spec: TrainSpec,
    device: Device,
    *,
    microbatch_size: int | None = None,
    method: str = "estimate",
    measure: bool = False,
    profile: ModelProfile | None = None,
) -> JobPlan:
    """Profile a job and partition it for a device's budget; never trains.

    Args:
        spec: The job.
        device: The device (its ``budget_bytes`` is the budget).
        microbatch_size: The largest blocks per layer pass; default ``spec.batch_size``.
        method: ``"estimate"`` (:func:`estimate_partition`) or ``"pilot"``
            (:func:`pilot_partition`, runs real passes on ``device`` at ``microbatch_size``).
        measure: Time layers with a real pass (see ``profile_model``).
        profile: A profile to reuse (e.g. from a cache) instead of profiling.

    Returns:
        The plan; ``plan.spill`` says whether the job needs spilling at all.

    Raises:
        LayerTooLargeError: A layer alone does not fit the budget, even one block at a time.
        ValueError: Bad ``method`` or ``microbatch_size``.
    """
    if method not in ("estimate", "pilot"):
        raise ValueError(f"method must be 'estimate' or 'pilot', got {method!r}")
    if profile is None:
        profile = profile_model(spec, microbatch_size, measure=measure, device=device)
    budget = device.budget_bytes
    if method == "pilot" and _plain_bytes(profile, spec.optimizer) > budget:
        fits = pilot_pass(spec, device, profile.microbatch_size)
        names = [layer.name for layer in profile.layers]
        cuts = pilot_partition(len(profile.layers), fits, names, budget)
        rows = [profile.microbatch_size] * (len(cuts) - 1)
    else:
        cuts, rows = estimate_partition(profile, spec.optimizer, budget, device.torch_device.type)
    return make_plan(profile, spec.optimizer, cuts, device, method=method, microbatch_sizes=rows)


class PlanCache(Protocol):
    """Where plans are kept across processes, keyed by (plan key, budget, device kind).

    Contract: :meth:`get` returns ``None`` for a miss (also for an entry it cannot read);
    :meth:`put` of an entry that exists already keeps one entry and does not raise, even when
    several processes put the same entry at once. Both may be called from any thread.
    :class:`sweepmaster.store.partitions.StorePlanCache` keeps them in the ``sm_partitions``
    table; a dict-backed class satisfies the protocol in tests.
    """

    def get(self, key: str, budget_bytes: int, device_kind: str) -> JobPlan | None:
        """Return the plan stored for the entry, or ``None``.

        Args:
            key: :func:`plan_cache_key` of the job.
            budget_bytes: The device budget (bytes) it was planned for.
            device_kind: :func:`device_kind` of the device it was planned for.
        """
        ...

    def put(self, key: str, budget_bytes: int, device_kind: str, plan: JobPlan) -> None:
        """Store ``plan`` for the entry (an existing entry is kept; see the class doc)."""
        ...


def plan_cache_key(
    spec: TrainSpec, microbatch_size: int | None = None, method: str = "estimate"
) -> str | None:
    """The key a job's plan is cached under: what its shards depend on, besides the device.

    The :func:`~sweepmaster.workload.architecture.architecture_key` of the job at its batch size
    (model config, dtype, ``B``, ``T``), then the microbatch limit, what of the optimizer changes
    bytes (AdamW or SGD, SGD momentum, clipping), the partitioner and
    :data:`PLAN_FORMAT_VERSION`, e.g. ``"3f9c0e1d2b4a5c6d/mb8/adamw/estimate/p2"`` (at most
    64 characters).

    Args:
        spec: The job.
        microbatch_size: The largest blocks per layer pass (``plan_job``'s); ``None``: the batch.
        method: ``"estimate"`` or ``"pilot"``.

    Returns:
        The key, or ``None`` when the model has no stable identity (a factory without an
        ``architecture_key`` attribute): such a plan is not cached.

    Raises:
        DataError: The config of a pretrained model cannot be loaded.
    """
    try:
        arch = architecture_key(spec)
    except ValueError:
        return None
    opt = spec.optimizer
    optimizer = opt.name + ("+momentum" if opt.name == "sgd" and opt.momentum > 0 else "")
    optimizer += "+clip" if opt.grad_clip is not None else ""
    rows = microbatch_size or spec.batch_size
    return f"{arch}/mb{rows}/{optimizer}/{method}/p{PLAN_FORMAT_VERSION}"


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
    spec: TrainSpec,
    device: Device,
    cache: PlanCache | None,
    *,
    microbatch_size: int | None = None,
    method: str = "estimate",
) -> JobPlan:
    """:func:`plan_job`, consulting ``cache`` first and filling it on a miss.

    A cached plan is returned for ``device`` (its ``device`` field renamed): devices of one kind
    and budget share plans. Plans that fail (:class:`LayerTooLargeError`) are not cached.

    Example:
        >>> plan = cached_plan(spec, device, StorePlanCache(engine))  # doctest: +SKIP

    Args:
        spec: The job.
        device: The device (its ``budget_bytes`` is the budget).
        cache: Where plans are kept, or ``None`` to always plan.
        microbatch_size: As :func:`plan_job`.
        method: As :func:`plan_job`.

    Returns:
        The plan, from the cache or fresh.

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
    num_layers: int,
    fits: Callable[[int, int], int],
    layer_names: Sequence[str],
    budget_bytes: int,
) -> list[int]:
    """Hydra's pilot-pass partitioner (Algorithm 1) over a ``fits(start, stop)`` oracle.

    Grow the current shard layer by layer; ``fits(start, stop)`` runs a pilot pass of layers
    ``[start, stop)`` on the device and returns its peak bytes, or raises
    ``torch.OutOfMemoryError`` when they do not fit. On OOM the shard is cut before the layer.

    Args:
        num_layers: Layers of the model.
        fits: The oracle, ``(start, stop) -> peak bytes``.
        layer_names: Names for the error message.
        budget_bytes: The budget, for the error message.

    Returns:
        Cut points ``[0, c1, ..., num_layers]``.

    Raises:
        LayerTooLargeError: A single layer runs out of memory.
    """
    cuts = [0]
    start = 0
    for stop in range(1, num_layers + 1):
        try:
            fits(start, stop)
        except torch.OutOfMemoryError:
            if stop - 1 == start:
                raise LayerTooLargeError(
                    layer_names[start], budget_bytes + 1, budget_bytes
                ) from None
            cuts.append(stop - 1)
            start = stop - 1
            try:
                fits(start, stop)
            except torch.OutOfMemoryError:
                raise LayerTooLargeError(
                    layer_names[start], budget_bytes + 1, budget_bytes
                ) from None
    cuts.append(num_layers)
    return cuts


def estimate_partition(
    profile: ModelProfile, optimizer: OptimizerSpec, budget_bytes: int, device_type: str = "cpu"
) -> tuple[list[int], list[int]]:
    """Balanced-time packing of layers into shards that fit (Harmony Algorithm 2, see module doc).

    Args:
        profile: The per-layer profile.
        optimizer: The job's optimizer (state size, clipping).
        budget_bytes: The device budget.
        device_type: ``"cpu"`` or ``"cuda"`` (copy bandwidth of the step-time estimate).

    Returns:
        Cut points ``[0, c1, ..., num_layers]`` and each shard's microbatch size.

    Raises:
        LayerTooLargeError: A layer alone does not fit, even one block at a time.
    """
    costs = _Costs(profile, optimizer)
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
        step_s = _step_seconds(costs, cuts, rows, budget_bytes, device_type)
        if best is None or step_s < best[0]:
            best = (step_s, cuts, rows)
    assert best is not None  # reserve 0 always packs: every single layer fits
    return best[1], best[2]


def make_plan(
    profile: ModelProfile,
    optimizer: OptimizerSpec,
    cuts: Sequence[int],
    device: Device,
    method: str = "estimate",
    microbatch_sizes: Sequence[int] | None = None,
) -> JobPlan:
    """Build the :class:`JobPlan` of given cut points ``[0, c1, ..., num_layers]``.

    Args:
        profile: The per-layer profile.
        optimizer: The job's optimizer.
        cuts: Cut points.
        device: The device planned for.
        method: Recorded in the plan.
        microbatch_sizes: Blocks per pass of each shard; default: as ``estimate_partition``
            chooses (halving from ``profile.microbatch_size``), else the largest that fits, or 1.
    """
    costs = _Costs(profile, optimizer)
    budget = device.budget_bytes
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
    prefetch = _prefetch_flags(costs, cuts, rows, budget)
    order = _order(len(shards))
    peaks = [costs.task_peak(kind, cuts[i], cuts[i + 1], rows[i]) for kind, i in order]
    nexts = [costs.param_bytes(cuts[i], cuts[i + 1]) for _, i in order[1:]] + [0]
    peak = max(p + (n if f else 0) for p, n, f in zip(peaks, nexts, prefetch, strict=True))
    plain = _plain_bytes(profile, optimizer)
    return JobPlan(
        device=device.name,
        budget_bytes=budget,
        batch_size=profile.batch_size,
        microbatch_size=profile.microbatch_size,
        plain_bytes=plain,
        spill=plain > budget,
        shards=tuple(shards),
        prefetch=tuple(prefetch),
        peak_bytes=peak,
        num_tasks_per_step=2 * len(shards) - 1,
        swap_bytes_per_step=sum(_steady_task_bytes(shards, optimizer.grad_clip is not None)),
        step_s=_step_seconds(costs, cuts, rows, budget, device.torch_device.type, shards),
        method=method,
        grad_clip=optimizer.grad_clip is not None,
    )


def _task_bytes(
    shards: Sequence[ShardPlan],
    grad_clip: bool,
    num_steps: int,
    first_step: int,
    eval_rows: int = 0,
    eval_every: int | None = None,
    batch_size: int = 1,
    activations: Sequence[SwappedActivations] | None = None,
) -> list[TaskBytes]:
    """See :meth:`JobPlan.task_bytes`; also the plan's steady-state swap volume."""
    last = len(shards) - 1
    if activations is not None and len(activations) != len(shards):
        raise ValueError(f"activations of {len(activations)} shards, the plan has {len(shards)}")
    updated = [first_step > 0] * len(shards)  # optimizer state exists (made by the first step)
    pending = [False] * len(shards)  # gradients on the host, update deferred (grad_clip)
    coef = 4 if grad_clip else 0  # the fp32 clip coefficient

    def rows(minibatch_bytes: int) -> int:
        """Bytes of the evaluation set's blocks of a boundary (``minibatch_bytes`` per batch)."""
        return minibatch_bytes * eval_rows // batch_size

    def update(i: int, clip: bool) -> tuple[int, int]:
        """(promoted, demoted) bytes of shard ``i``'s update: state in, state and params out."""
        shard = shards[i]
        state_in = shard.optimizer_bytes if updated[i] else 0
        updated[i] = True
        return state_in + (coef if clip else 0), shard.optimizer_bytes + shard.owned_param_bytes

    def deferred(i: int) -> tuple[int, int]:
        """Apply shard ``i``'s pending update: its gradients come back, then the update."""
        if not pending[i]:
            return 0, 0
        pending[i] = False
        up, down = update(i, True)
        return shards[i].owned_param_bytes + up, down

    def evaluation(kept: bool) -> tuple[int, int, int]:
        """(shard 0's promote, other promoted, demoted) bytes of an evaluation pass.

        ``kept``: shard 0 stays resident from the task before (the last task's own pass).
        """
        up = down = 0
        for i, shard in enumerate(shards):
            u, d = deferred(i) if i > 0 else (0, 0)
            up += u + (shard.param_bytes if i > 0 else 0)
            down += d
            up += rows(shard.input_bytes)
            if i < last:
                down += rows(shard.output_bytes)
            elif i > 0:
                up += rows(shards[0].input_bytes)  # ids for the loss
        return (0 if kept else shards[0].param_bytes), up, down

    out = []
    total = first_step + num_steps
    due = eval_rows > 0 and first_step == 0  # step 0's evaluation runs before the first task
    for done in range(first_step + 1, total + 1):
        for kind, i in _order(len(shards)):
            shard = shards[i]
            shard_bytes, up, down = shard.param_bytes, 0, 0
            if due and (kind, i) == _order(len(shards))[0]:  # the pass runs in this task first
                shard_bytes, up, down = evaluation(False)
                up += shard.param_bytes  # then its own shard again
                due = False
            u, d = deferred(i) if i > 0 else (0, 0)
            up, down = up + u, down + d
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
                down += shard.borrowed_bytes
                up += shard.contribution_bytes
                if shard.num_owned_params and not grad_clip:
                    u, d = update(i, False)
                    up, down = up + u, down + d
                elif shard.num_owned_params:
                    down += 4 * shard.num_owned_params  # fp32 norms
                    if i > 0:
                        down += shard.owned_param_bytes  # gradients wait on the host
                        pending[i] = True
                    else:
                        u, d = update(i, True)
                        up, down = up + u, down + d + coef
            out.append(TaskBytes(shard_bytes, up, down))
        due = eval_rows > 0 and (done == total or (eval_every is not None
                                                    and done % eval_every == 0))
    if out and due:  # the last task runs the last evaluation, shard 0 still resident
        _, u, d = evaluation(True)
        out[-1] = TaskBytes(out[-1].shard_bytes, out[-1].promote_bytes + u,
                            out[-1].demote_bytes + d)
    elif out and grad_clip:  # the last task applies the deferred updates after the last step
        up, down = out[-1].promote_bytes, out[-1].demote_bytes
        for i in range(1, len(shards)):
            u, d = deferred(i)
            up, down = up + shards[i].param_bytes + u, down + d
        out[-1] = TaskBytes(out[-1].shard_bytes, up, down)
    return out


def _steady_task_bytes(
    shards: Sequence[ShardPlan],
    grad_clip: bool,
    activations: Sequence[SwappedActivations] | None = None,
) -> list[int]:
    """Bytes each task of a steady-state step moves (no shard stays resident), in task order."""
    per_step = 2 * len(shards) - 1
    three = _task_bytes(shards, grad_clip, 3, 1, activations=activations)
    middle = three[per_step : 2 * per_step]
    return [t.shard_bytes + t.promote_bytes + t.demote_bytes for t in middle]


def _shards(costs: _Costs, cuts: list[int], rows: list[int]) -> tuple[ShardPlan, ...]:
    """The shards ``[cuts[i], cuts[i + 1])`` running ``rows[i]``-block microbatches."""
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    last = len(spans) - 1
    full = costs.layers(1)  # boundary bytes are linear in rows: minibatch = B x 1 block
    shards = []
    for index, ((start, stop), size) in enumerate(zip(spans, rows, strict=True)):
        shards.append(
            ShardPlan(
                index=index,
                start=start,
                stop=stop,
                layer_names=tuple(layer.name for layer in costs.profile.layers[start:stop]),
                microbatch_size=size,
                param_bytes=costs.param_bytes(start, stop),
                owned_param_bytes=costs.owned_bytes(start, stop),
                optimizer_bytes=costs.optimizer_bytes(start, stop),
                num_owned_params=len(costs._owned(start, stop)),
                input_bytes=full[start].input_bytes * costs.profile.batch_size,
                output_bytes=full[stop - 1].output_bytes * costs.profile.batch_size,
                borrowed_bytes=costs.borrowed_bytes(start, stop),
                contribution_bytes=costs.contribution_bytes(start, stop),
                activation_bytes=sum(
                    costs.profile.layer(i, size).saved_bytes for i in range(start, stop)
                ),
                forward_peak_bytes=0 if index == last else costs.task_peak(
                    "forward", start, stop, size
                ),
                backward_peak_bytes=costs.task_peak("backward", start, stop, size),
                forward_s=0.0 if index == last else costs.forward_s(start, stop),
                backward_s=costs.backward_s(start, stop),
            )
        )
    return tuple(shards)


def _order(num_shards: int) -> list[tuple[str, int]]:
    last = num_shards - 1
    return [("forward", i) for i in range(last)] + [("backward", i) for i in range(last, -1, -1)]


def _plain_bytes(profile: ModelProfile, optimizer: OptimizerSpec) -> int:
    return plain_footprint_bytes(
        profile.param_bytes, profile.plain_activation_peak_bytes, optimizer,
        sum(profile.frozen_param_bytes.values()),
    )


class _Costs:
    """Bytes and seconds of candidate shards ``[start, stop)`` on ``rows``-block microbatches."""

    def __init__(self, profile: ModelProfile, optimizer: OptimizerSpec) -> None:
        self.profile = profile
        self.optimizer = optimizer
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
            self._layers[rows] = tuple(
                self.profile.layer(i, rows) for i in range(self.num_layers)
            )
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
        owned = self._owned(start, stop)
        if not owned or (self.optimizer.grad_clip is not None and start > 0):
            return compute
        biggest = max(self.profile.param_bytes[n] for n in owned)
        transient = max(self.contribution_bytes(start, stop), 2 * biggest)
        update = params + grads + self.optimizer_bytes(start, stop) + transient
        return max(compute, update)

    def task_peak(self, kind: str, start: int, stop: int, rows: int) -> int:
        clip = self.optimizer.grad_clip is not None and start > 0
        if kind == "forward":
            peak = self.forward_peak(start, stop, rows)
            return max(peak, self._deferred_update_peak(start, stop)) if clip else peak
        peak = self.backward_peak(start, stop, rows)
        if clip and stop == self.num_layers:
            peak = max(peak, self._deferred_update_peak(start, stop))
        return peak

    def _deferred_update_peak(self, start: int, stop: int) -> int:
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
        layers = self.layers(rows)
        return self.scale(rows) * sum(layer.forward_s for layer in layers[start:stop])

    def backward_s(self, start: int, stop: int) -> float:
        rows = self.profile.microbatch_size
        layers = self.layers(rows)
        return self.scale(rows) * sum(
            layer.forward_s + layer.backward_s for layer in layers[start:stop]
        )


def _prefetch_flags(costs: _Costs, cuts: list[int], rows: list[int], budget: int) -> list[bool]:
    """Whether each task of a step may prefetch the next one's parameters within the budget."""
    order = _order(len(cuts) - 1)
    flags = []
    for position, (kind, shard) in enumerate(order):
        if position + 1 == len(order):
            flags.append(False)  # next is the next step's first task: same shard or shares state
            continue
        _, next_shard = order[position + 1]
        start, stop = cuts[shard], cuts[shard + 1]
        next_start, next_stop = cuts[next_shard], cuts[next_shard + 1]
        disjoint = not costs._names(start, stop) & costs._names(next_start, next_stop)
        need = costs.task_peak(kind, start, stop, rows[shard])
        need += costs.param_bytes(next_start, next_stop)
        flags.append(disjoint and need <= budget)
    return flags


def pipeline_packs(
    seconds: Sequence[float], resident_bytes: Sequence[int], budget_bytes: int, max_devices: int
) -> list[tuple[int, ...]]:
    """Pack layouts of a job's shards for a pipeline over 2..``max_devices`` devices.

    Harmony's balanced-time packing (Li et al. VLDB 2022, Algorithm 2) with shards as the items:
    for each device count k, contiguous packs whose resident bytes each fit the budget, at most
    k of them, whose slowest pack is fastest. It is the partitioner's own packer (fewest packs
    that fit, then the fastest slowest pack) with a cap on a pack's seconds beside the budget:
    the smallest cap (bisected over the packs' possible seconds) at which the fewest packs are
    at most k.

    Args:
        seconds: Each shard's seconds per step (forward + backward), ``(S,)``.
        resident_bytes: Each shard's bytes while resident in the pipeline, ``(S,)``; a pack's
            are their sum.
        budget_bytes: A device's budget (bytes).
        max_devices: Devices a pipeline may take.

    Returns:
        The distinct layouts of at least two packs, each as cut points ``(0, c1, ..., S)``,
        fewest packs first (empty when none fits).
    """
    num_shards = len(seconds)
    prefix = [0.0, *itertools.accumulate(seconds)]
    caps = sorted({prefix[b] - prefix[a] for a in range(num_shards)
                   for b in range(a + 1, num_shards + 1)})
    layouts: list[tuple[int, ...]] = []
    for devices in range(2, max_devices + 1):
        low, high, found = 0, len(caps) - 1, None
        while low <= high:  # the fewest packs only fall as the cap grows
            mid = (low + high) // 2
            packed = _pack(_PackTimes(prefix, resident_bytes, caps[mid]), num_shards,
                           budget_bytes, 0)
            if packed is not None and len(packed[0]) - 1 <= devices:
                found, high = tuple(packed[0]), mid - 1
            else:
                low = mid + 1
        if found is not None and len(found) > 2 and found not in layouts:
            layouts.append(found)
    return layouts


class _PackTimes:
    """Shards as the items :func:`_pack` packs: a pack fits its budget and a cap on seconds."""

    def __init__(self, prefix_s: list[float], resident_bytes: Sequence[int], cap_s: float) -> None:
        self.prefix_s = prefix_s
        self.prefix_bytes = [0, *itertools.accumulate(resident_bytes)]
        self.cap_s = cap_s

    def shard_rows(self, start: int, stop: int, limit: int) -> int | None:
        fits = self.prefix_bytes[stop] - self.prefix_bytes[start] <= limit
        return 1 if fits and self.forward_s(start, stop) <= self.cap_s else None

    def param_bytes(self, start: int, stop: int) -> int:
        return self.prefix_bytes[stop] - self.prefix_bytes[start]

    def forward_s(self, start: int, stop: int) -> float:
        return self.prefix_s[stop] - self.prefix_s[start]

    def backward_s(self, start: int, stop: int) -> float:
        return 0.0


def _pack(
    costs: _Costs | _PackTimes, num_layers: int, limit: int, reserve: int
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
    costs: _Costs,
    cuts: list[int],
    rows: list[int],
    budget: int,
    device_type: str,
    shards: Sequence[ShardPlan] | None = None,
) -> float:
    """Estimated seconds of one spilled step: compute plus copies not hidden by prefetch.

    ``shards``: the shards of ``cuts`` if made already.
    """
    bandwidth = _COPY_BYTES_PER_S.get(device_type, _COPY_BYTES_PER_S["cpu"])
    order = _order(len(cuts) - 1)
    flags = _prefetch_flags(costs, cuts, rows, budget)
    if shards is None:
        shards = _shards(costs, cuts, rows)
    swaps = _steady_task_bytes(shards, costs.optimizer.grad_clip is not None)
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
