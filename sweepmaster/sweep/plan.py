"""Plan a sweep without training: its jobs, and how each one trains on the devices.

What ``sweepmaster plan`` prints and what ``sweepmaster launch`` checks before it trains. A sweep's
configurations are grouped into jobs by their plan key
(:func:`~sweepmaster.runtime.planning.partition.plan_cache_key`: the architecture key of
:mod:`sweepmaster.workload.architecture`, i.e. model config, dtype, batch ``B`` and block length
``T``, plus the optimizer's kind): every trial of a job trains the same way, so one plan per job
and device budget tells how the whole sweep trains. Each job is planned with
:func:`~sweepmaster.runtime.planning.partition.cached_plan` (Harmony-style balanced packing,
Hydra's spilling), through the storage's partition cache when its database exists; ``plan`` never
creates or changes a database (``read_only=True``: the caches are read, never written).

On two or more devices of a class, a spilled job also says how it pipelines
(:class:`PlannedPipeline`, Harmony PP): when runnable jobs are fewer than free devices,
Sharded-LRTF may run its steps over several devices, one pack of shards each
(:func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_packs`), or wrap-around over fewer
devices than its packs (:func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_wrap`): a
layout per count of devices it may take, each with the predicted step time and host <-> device
and device <-> device bytes per step
(:func:`~sweepmaster.runtime.scheduling.pipeline.pipeline_step`, the simulator's cost model).

With ``resources.fusion`` on, each job also says how its trials fuse
(:class:`PlannedFusion`): the fusion degree K (``auto``: from the storage's fusion cache, or
"not measured" -- ``plan`` measures only when asked, ``measure_fusion=True`` /
``sweepmaster plan --measure-fusion``, since measuring trains a few steps of K = 1, 2, 4, ...
models), and for a grid the sizes of the fused arrays its cells form, K at a time (which cells
share an array follows the order Optuna's grid sampler hands them out at launch). Trials that
spill fuse into spilled fused arrays: each size of array is planned as launch plans it
(:class:`PlannedArray`: stacked shards and the memory plan of their activations), once per
architecture, K and class of devices, its memory plan kept in the partition cache beside a
single job's (:func:`~sweepmaster.runtime.planning.memplan.memory_plan_key`).

Which configurations are looked at:

* grid sampler: every cell of the grid;
* other samplers: the base configuration (the file's values, constants applied), then every value
  of each sampled parameter that changes the plan key (categorical values; int ranges of up to
  :data:`MAX_VALUES_PER_PARAMETER` values; the bounds of wider int and of float ranges), all
  combinations of them when there are at most :data:`MAX_COMBINATIONS`, else one parameter at a
  time. :attr:`SweepPlan.notes` says what was planned.

Example:
    >>> sweep_plan = plan_sweep(load_sweep_config("examples/spill-cpu.yaml"))  # doctest: +SKIP
    >>> [(job.label, job.spill, len(job.plan.shards)) for job in sweep_plan.jobs]  # doctest: +SKIP
    [('', True, 3)]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import sqlalchemy.exc
import torch
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from sqlalchemy.engine import make_url

from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.search_space import MAX_GRID_CELLS, parameter_sets
from sweepmaster.config.train_specs import TokenData, TrialSpecs, widest_member
from sweepmaster.errors import ConfigError, DeviceError, StorageError
from sweepmaster.runtime.devices.device import Device, parse_devices
from sweepmaster.runtime.planning import fusion_degree
from sweepmaster.runtime.planning.fusion_degree import (
    FusionCache,
    FusionDegrees,
    FusionMeasurement,
    auto_degrees,
    bounded_degrees,
    measure_fusion,
)
from sweepmaster.runtime.planning.memplan import MemoryPlan, cached_memory_plan, plan_memory
from sweepmaster.runtime.planning.packing import copy_bytes_per_s
from sweepmaster.runtime.planning.partition import (
    PlanCache,
    cached_plan,
    device_kind,
    plan_cache_key,
    plan_job,
)
from sweepmaster.runtime.planning.pipeline_plan import pipeline_shape
from sweepmaster.runtime.planning.plans import JobPlan, LayerTooLargeError
from sweepmaster.runtime.planning.profile import estimate_plain_bytes
from sweepmaster.runtime.scheduling.pipeline import (
    PipelineShape,
    choose_packs,
    pipeline_step,
    pipeline_unload,
)
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_shards import plan_stacked
from sweepmaster.workload import TrainSpec
from sweepmaster.workload.architecture import architecture_key
from sweepmaster.workload.text import cached_tokenizer

__all__ = [
    "MAX_COMBINATIONS",
    "MAX_VALUES_PER_PARAMETER",
    "PlannedArray",
    "PlannedFusion",
    "PlannedJob",
    "PlannedPipeline",
    "PlannedPipelineLayout",
    "SweepPlan",
    "open_devices",
    "open_fusion_cache",
    "open_plan_cache",
    "pipeline_shape",
    "plan_sweep",
]

#: An int parameter with more values than this is probed at its bounds only.
MAX_VALUES_PER_PARAMETER = 16
#: Combinations of plan-changing parameters planned at most (else one parameter at a time).
MAX_COMBINATIONS = 64


@dataclass(frozen=True)
class PlannedFusion:
    """How the trials of one job fuse on one class of devices (``resources.fusion``).

    Attributes:
        k: The fusion degree (1: each trial trains alone), or ``None``: ``auto`` and no
            measurement is cached (launch measures it).
        source: ``"off"``, ``"unfusable"``, ``"spills"``, ``"fixed"``, ``"capped"``,
            ``"measured"`` (measured by this plan), ``"cached"`` or ``"unmeasured"``.
        note: The choice in words.
        array_sizes: For a grid: the members of each fused array the job's cells form, K at a
            time (e.g. ``(4, 4, 1)``: the last cell trains alone); empty for other samplers or
            K = 1.
        arrays: For trials that spill and fuse: each size of spilled fused array they form
            (K, then the smaller arrays of a grid), largest first, with its stacked shards and
            memory plan.
    """

    k: int | None
    source: str
    note: str
    array_sizes: tuple[int, ...] = ()
    arrays: tuple[PlannedArray, ...] = ()


@dataclass(frozen=True)
class PlannedArray:
    """One size of spilled fused array a job's trials form on one class of devices.

    Attributes:
        num_members: K, its members (> 1).
        stacked_plan: The K members' stacked shards
            (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`).
        memory_plan: The keep / swap / recompute plan of their activations launch would use
            (:func:`~sweepmaster.runtime.training.fused_memplan.plan_stacked_memory`, cached
            beside the stacked shards in the partition cache), or ``None``: no plan fits, every
            activation is recomputed (Hydra).
    """

    num_members: int
    stacked_plan: JobPlan
    memory_plan: MemoryPlan | None


@dataclass(frozen=True)
class PlannedPipelineLayout:
    """One way a spilled job runs pipelined: its packs over some devices (Harmony PP).

    Attributes:
        devices: The device of each pack, in pack order (names): one pack per device, or,
            wrap-around, pack p on device p mod D of the D devices it takes (a layout planned
            for D), which swap their packs in turn.
        packs: The shards of each pack.
        runnable: ``(fewest, most)`` runnable jobs (this one included) for which Sharded-LRTF
            gives it this layout when every device is free and it has the longest remaining
            time: it takes up to ``ceil(devices / runnable)`` devices.
        step_s: Estimated seconds of a pipelined step, packs held, boundary copies p2p.
        host_bytes_per_step: Host <-> device bytes per step (the token ids, and wrap-around the
            packs' swaps; bytes).
        p2p_bytes_per_step: Device <-> device bytes per step (boundary activations, their
            gradients, tied parameters; bytes).
        host_bytes_per_step_without_p2p: Host <-> device bytes per step when the boundary
            copies go through the host (bytes).
        load_bytes: Host -> device bytes of loading the packs when a placement starts; the same
            go back when it ends (bytes).
    """

    devices: tuple[str, ...]
    packs: tuple[tuple[int, ...], ...]
    runnable: tuple[int, int]
    step_s: float
    host_bytes_per_step: int
    p2p_bytes_per_step: int
    host_bytes_per_step_without_p2p: int
    load_bytes: int


@dataclass(frozen=True)
class PlannedPipeline:
    """How a spilled job pipelines over a class of devices when jobs are fewer than devices.

    Attributes:
        num_microbatches: M, microbatches per minibatch flowing through the packs.
        layouts: Each layout Sharded-LRTF gives it for some count of runnable jobs while
            every device is free, fewest devices first: of the layouts that fit that many
            devices the one whose step is predicted shortest, where that is no longer than
            ``shard_step_s`` (:func:`~sweepmaster.runtime.scheduling.pipeline.choose_packs`).
            Empty: no pack layout fits the budget, or none is predicted as fast.
        shape: What the policy and the simulator are given.
        shard_step_s: Estimated seconds of its step as shard tasks on one device (the plan's
            ``step_s``: compute, and the copies prefetch does not hide, at the same copy
            bandwidth as the layouts' ``step_s``), what a pipelined step must not exceed; 0:
            not known.
    """

    num_microbatches: int
    layouts: tuple[PlannedPipelineLayout, ...]
    shape: PipelineShape | None
    shard_step_s: float = 0.0


@dataclass(frozen=True)
class PlannedJob:
    """One job of a sweep, planned for one class of devices (same kind and budget).

    Attributes:
        number: The job's number, 1-based, in order of first appearance.
        key: Its plan key (:func:`~sweepmaster.runtime.planning.partition.plan_cache_key`).
        architecture_key: Its architecture key.
        params: What sets it apart from the sweep's other jobs: dotted path -> value (empty when
            the sweep has one job).
        configs: The parameter sets (grid cells, or probed configurations) that map to it.
        devices: Names of the devices it was planned for.
        budget_bytes: Their budget (bytes).
        plain_bytes: Estimated peak of plain training on one device (bytes).
        plan: The shard plan; ``None`` on the host CPU (never spills) or when ``error`` is set.
        cached: Whether ``plan`` came from the storage's partition cache.
        error: Why the job cannot train on these devices (a layer too large), else ``None``.
        fusion: How its trials fuse (``None`` when ``resources.fusion`` is ``off``).
        memory_plan: A spilled job's keep / swap / recompute plan of its activations
            (mu-TWO), as launch uses it; ``None`` when the job does not spill or when no plan
            fits (launch then recomputes every activation, as Hydra does).
        pipeline: How a spilled job of two or more shards pipelines over two or more devices
            of the class; ``None`` otherwise.
    """

    number: int
    key: str
    architecture_key: str
    params: dict[str, Any]
    configs: tuple[dict[str, Any], ...]
    devices: tuple[str, ...]
    budget_bytes: int
    plain_bytes: int
    plan: JobPlan | None
    cached: bool = False
    error: str | None = None
    fusion: PlannedFusion | None = None
    memory_plan: MemoryPlan | None = None
    pipeline: PlannedPipeline | None = None

    @property
    def spill(self) -> bool:
        """Whether the job spills (its plain footprint exceeds a metered device's budget)."""
        return self.plan is not None and self.plan.spill

    @property
    def label(self) -> str:
        """``params`` as ``"n_layer=12, batch_size=8"`` (last part of each path)."""
        return ", ".join(f"{path.rsplit('.', 1)[-1]}={value}"
                         for path, value in self.params.items())


@dataclass(frozen=True)
class SweepPlan:
    """How a sweep's jobs train on the devices; built by :func:`plan_sweep`, never trains.

    Attributes:
        name: The sweep's name.
        source: The sweep.yaml it came from.
        sampler: The study's sampler (``grid``, ``tpe``, ...).
        devices: The devices planned for, by name.
        num_configs: Configurations looked at (grid cells or probes).
        jobs: One entry per job and device class, in job order.
        notes: What was planned and what was left out, in words.
        cache: The storage whose partition cache was used, or ``None``.
        num_cache_hits: Plans read from the cache.
        num_cache_saved: Plans written to the cache.
        fusion: ``resources.fusion``: ``"auto"``, ``"off"`` or K.
    """

    name: str
    source: str
    sampler: str
    devices: tuple[str, ...]
    num_configs: int
    jobs: tuple[PlannedJob, ...]
    notes: tuple[str, ...]
    cache: str | None
    num_cache_hits: int = 0
    num_cache_saved: int = 0
    fusion: str | int = "off"

    @property
    def num_jobs(self) -> int:
        """Distinct jobs (a job planned for two device classes counts once)."""
        return len({job.number for job in self.jobs})


def open_devices(config: SweepConfig, devices: str | None = None,
                 device_memory: str | int | None = None) -> list[Device]:
    """Open the devices of a sweep: ``devices`` / ``device_memory`` or its ``resources``.

    Args:
        config: The sweep.
        devices: A device spec overriding ``resources.devices`` (the CLI's ``--devices``).
        device_memory: A budget cap overriding ``resources.device_memory``.

    Returns:
        The devices.

    Raises:
        DeviceError: A device is not on this machine (e.g. ``cuda:1`` with one GPU), or the spec
            is invalid; the message names the file or option and the key.
    """
    spec = devices if devices is not None else config.resources.devices
    memory = device_memory if device_memory is not None else config.resources.device_memory
    where = "--devices" if devices is not None else f"{config.source}: resources.devices"
    try:
        return parse_devices(spec, memory)
    except ValueError as err:
        raise DeviceError(f"{where}: {err}") from None


def open_plan_cache(storage: str, *,
                    read_only: bool = False) -> tuple[PlanCache | None, str]:
    """The partition cache of a storage, if its database exists at head; never creates one.

    Args:
        storage: A storage URL.
        read_only: Open the database read-only and never write to it: new plans are not kept.

    Returns:
        ``(cache, note)``: the cache (or ``None``) and a few words on why it is (not) used.
    """
    from sweepmaster.store.partitions import StorePlanCache

    engine, note = _open_store(storage, read_only)
    if engine is None:
        return None, note
    cache = StorePlanCache(engine)
    return (_ReadOnlyPlanCache(cache) if read_only else cache), note


def open_fusion_cache(storage: str, *,
                      read_only: bool = False) -> tuple[FusionCache | None, str]:
    """The fusion-degree cache of a storage, if its database exists at head; never creates one.

    Returns:
        ``(cache, note)``, as :func:`open_plan_cache`.
    """
    from sweepmaster.store.fusion import StoreFusionCache

    engine, note = _open_store(storage, read_only)
    if engine is None:
        return None, note
    cache = StoreFusionCache(engine)
    return (_ReadOnlyFusionCache(cache) if read_only else cache), note


class _ReadOnlyPlanCache:
    """A partition cache that is read and never written (``plan``)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.num_saved = 0

    @property
    def num_hits(self) -> int:
        return int(self._cache.num_hits)

    def get(self, key: str, budget_bytes: int, device_kind: str) -> JobPlan | None:
        return self._cache.get(key, budget_bytes, device_kind)  # type: ignore[no-any-return]

    def put(self, key: str, budget_bytes: int, device_kind: str, plan: JobPlan) -> None:
        pass

    def get_memory_plan(self, key: str, budget_bytes: int, device_kind: str) -> MemoryPlan | None:
        return self._cache.get_memory_plan(  # type: ignore[no-any-return]
            key, budget_bytes, device_kind)

    def put_memory_plan(self, key: str, budget_bytes: int, device_kind: str,
                        plan: MemoryPlan) -> None:
        pass


class _ReadOnlyFusionCache:
    """A fusion-degree cache that is read and never written (``plan``)."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.num_saved = 0

    @property
    def num_hits(self) -> int:
        return int(self._cache.num_hits)

    def get(self, key: str, budget_bytes: int, device_kind: str) -> Any:
        return self._cache.get(key, budget_bytes, device_kind)

    def put(self, key: str, budget_bytes: int, device_kind: str, measurements: Any) -> None:
        pass


def _open_store(storage: str, read_only: bool = False) -> tuple[Any, str]:
    """An engine on a storage whose database exists at head (else ``None``), and a note."""
    from sweepmaster.store import create_store_engine, current_revision, head_revision
    from sweepmaster.store.engine import create_read_only_engine, masked_url

    shown = masked_url(storage)
    try:
        url = make_url(storage)
    except sqlalchemy.exc.ArgumentError:
        return None, f"not used: invalid storage URL {shown}"
    if url.get_backend_name() == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            return None, f"not used: {shown} is not a database file"
        if not Path(database).is_file():
            return None, f"not used: no database at {shown} (plan creates none)"
    try:
        engine = create_read_only_engine(storage) if read_only else create_store_engine(storage)
        revision = current_revision(engine)
    except (StorageError, sqlalchemy.exc.DBAPIError) as err:
        return None, f"not used: {err}".splitlines()[0]
    if revision != head_revision():
        return None, (f"not used: {shown} has no sweepmaster tables at revision "
                      f"{head_revision()} (sweepmaster db upgrade creates them)")
    return engine, f"{shown}" + (" (read only)" if read_only else "")


def plan_sweep(config: SweepConfig, *, devices: str | None = None,
               device_memory: str | int | None = None, storage: str | None = None,
               use_cache: bool = True, measure_fusion: bool = False,
               read_only: bool = False) -> SweepPlan:
    """Plan every job of a sweep on its devices (see the module doc); trains nothing.

    Args:
        config: The validated sweep.
        devices: A device spec overriding ``resources.devices``.
        device_memory: A budget cap overriding ``resources.device_memory``.
        storage: Storage URL whose partition and fusion caches to use; default
            ``config.storage``.
        use_cache: Use (and fill) the partition and fusion caches when the database exists.
        measure_fusion: With ``resources.fusion: auto``, measure the fusion degrees the cache
            lacks on the devices (trains a few steps of K = 1, 2, 4, ... models; saved to the
            cache when the database exists, unless ``read_only``) instead of reporting them as
            not measured.
        read_only: Read the caches but never write to the database (``sweepmaster plan``):
            it is opened read-only, and new plans and measurements are not kept.

    Returns:
        The plan.

    Raises:
        DeviceError: A device is missing, or one of the sweep's jobs has a layer that fits none
            of the devices (the message names the file, the job, the layer, its bytes and the
            budget).
        DataError: The tokenizer cannot be loaded.
    """
    opened = open_devices(config, devices, device_memory)
    cache, cache_note = (open_plan_cache(storage or config.storage, read_only=read_only)
                         if use_cache else (None, "not used"))
    fusion_cache, _ = (open_fusion_cache(storage or config.storage, read_only=read_only)
                       if use_cache and config.resources.fusion != "off" else (None, ""))
    fusion = _FusionPlanner(config, FusionDegrees(config.resources.fusion, fusion_cache),
                            measure_fusion, cache)
    specs = TrialSpecs(config, _StandInData())
    probes, notes = _configurations(config, specs)
    jobs: dict[str, list[tuple[dict[str, Any], TrainSpec]]] = {}
    for params in probes:
        try:
            spec = specs(params)
        except ConfigError as err:
            notes.append(f"skipped an invalid configuration {_words(params)}: {err.expected}")
            continue
        key = plan_cache_key(spec) or f"unkeyed-{len(jobs)}"
        jobs.setdefault(key, []).append((params, spec))
    labels = _labels([[params for params, _ in members] for members in jobs.values()])
    planned = []
    for number, ((key, members), label) in enumerate(zip(jobs.items(), labels, strict=True), 1):
        spec = members[0][1]
        configs = tuple(params for params, _ in members)
        planned += _plan_job(config, number, key, label, configs, spec, opened, cache, fusion)
    hits = getattr(cache, "num_hits", 0)
    saved = getattr(cache, "num_saved", 0)

    def counts(num_read: int, num_written: int) -> str:
        """How a cache was used: a read-only one is never written, so only reads count."""
        return f", {num_read} read" if read_only else f" ({num_read} read, {num_written} written)"

    notes.append(f"partition cache: {cache_note}"
                 + (counts(hits, saved) if cache is not None else ""))
    if fusion_cache is not None:
        fusion_hits, fusion_saved = (getattr(fusion_cache, name, 0)
                                     for name in ("num_hits", "num_saved"))
        notes.append(f"fusion cache: {cache_note}{counts(fusion_hits, fusion_saved)}")
    return SweepPlan(
        name=config.name, source=config.source, sampler=config.study.sampler.type,
        devices=tuple(d.name for d in opened), num_configs=len(probes), jobs=tuple(planned),
        notes=tuple(notes), cache=cache_note if cache is not None else None,
        num_cache_hits=hits, num_cache_saved=saved, fusion=config.resources.fusion,
    )


# --- configurations ----------------------------------------------------------------------------

def _configurations(config: SweepConfig,
                    specs: TrialSpecs) -> tuple[list[dict[str, Any]], list[str]]:
    """Parameter sets to plan, and notes on what was planned."""
    if config.study.sampler.type == "grid":
        cells, _ = parameter_sets(config.grid_space(), MAX_GRID_CELLS)
        return cells, [f"grid: all {len(cells)} configurations"]
    notes = []
    base = _plan_key(specs, {})
    varying: dict[str, list[Any]] = {}
    for path, dist in config.search_space().items():
        values, how = _probe_values(dist)
        changes = [v for v in values if _plan_key(specs, {path: v}) not in (base, None)]
        if changes:
            varying[path] = values
            notes.append(f"{path} changes the job: planned at {how}")
    sampler = config.study.sampler.type
    if not varying:
        notes.insert(0, f"{sampler} sampler: no sampled parameter changes the job; planned the "
                     "base configuration")
        return [{}], notes
    probes, every = parameter_sets(varying, MAX_COMBINATIONS)
    combos = math.prod(len(values) for values in varying.values())
    if every:
        notes.insert(0, f"{sampler} sampler: planned all {combos} combinations of the "
                     "parameters that change the job (others at the file's values)")
        return probes, notes
    notes.insert(0, f"{sampler} sampler: {combos} combinations are too many; planned the base "
                 "configuration and each parameter that changes the job alone")
    return [{}, *probes], notes


def _probe_values(dist: Any) -> tuple[list[Any], str]:
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices), "each of its values"
    if isinstance(dist, IntDistribution):
        count = (dist.high - dist.low) // dist.step + 1
        if count <= MAX_VALUES_PER_PARAMETER:
            return list(range(dist.low, dist.high + 1, dist.step)), "each of its values"
        return [dist.low, dist.high], f"its bounds {dist.low} and {dist.high} only"
    assert isinstance(dist, FloatDistribution)
    return [dist.low, dist.high], f"its bounds {dist.low:g} and {dist.high:g} only"


class _StandInData:
    """Token data of the shapes launch gives, for planning: zeros ``(B, T)``.

    Only shapes matter for planning; the vocabulary is the tokenizer's, as at launch.
    """

    def __init__(self) -> None:
        self._vocab: dict[Path, int] = {}

    def __call__(self, trial: SweepConfig) -> TokenData:
        tokenizer = trial.tokenizer_snapshot().path
        if tokenizer not in self._vocab:
            self._vocab[tokenizer] = len(cached_tokenizer(tokenizer))
        blocks_BT = torch.zeros((trial.train.batch_size, trial.data.block_size),
                                dtype=torch.int64)
        return TokenData(blocks_BT, None, self._vocab[tokenizer])


def _plan_key(specs: TrialSpecs, params: Mapping[str, Any]) -> str | None:
    """The plan key of ``params``, or ``None`` for an invalid parameter set."""
    try:
        return plan_cache_key(specs(params))
    except ConfigError:
        return None


def _labels(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per job, the parameters constant within it that differ between jobs."""
    if len(groups) <= 1:
        return [{} for _ in groups]
    paths = list(dict.fromkeys(path for group in groups for params in group for path in params))
    labels: list[dict[str, Any]] = [{} for _ in groups]
    for path in paths:
        values = [{repr(p.get(path)) for p in group} for group in groups]
        if all(len(v) == 1 for v in values) and len({next(iter(v)) for v in values}) > 1:
            for label, group in zip(labels, groups, strict=True):
                label[path] = group[0].get(path)
    return labels


def _words(params: Mapping[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "(base)"


# --- planning ----------------------------------------------------------------------------------

def _device_classes(devices: list[Device]) -> Iterator[list[Device]]:
    """Devices grouped by kind and budget (plans are equal within a group), in order."""
    groups: dict[tuple[str, bool, int], list[Device]] = {}
    for device in devices:
        metered = device.meter is not None
        budget = device.budget_bytes if metered else 0  # the host's free RAM moves
        groups.setdefault((device_kind(device), metered, budget), []).append(device)
    yield from groups.values()


def _plan_job(config: SweepConfig, number: int, key: str, label: dict[str, Any],
              configs: tuple[dict[str, Any], ...], spec: TrainSpec, devices: list[Device],
              cache: PlanCache | None, fusion: _FusionPlanner) -> list[PlannedJob]:
    arch = architecture_key(spec)
    planned = []
    errors = []
    for group in _device_classes(devices):
        device = group[0]
        names = tuple(d.name for d in group)
        base = PlannedJob(number=number, key=key, architecture_key=arch, params=label,
                          configs=configs, devices=names, budget_bytes=device.budget_bytes,
                          plain_bytes=0, plan=None)
        if device.meter is None:  # the host CPU: one shard, in place; spilling cannot help
            planned.append(replace(base, plain_bytes=estimate_plain_bytes(spec),
                                   fusion=fusion.plan(spec, device, None, len(configs))))
            continue
        hits = getattr(cache, "num_hits", 0)
        try:
            plan = cached_plan(spec, device, cache)
        except LayerTooLargeError as err:
            errors.append(err)
            planned.append(replace(base, plain_bytes=estimate_plain_bytes(spec), error=str(err)))
            continue
        cached = getattr(cache, "num_hits", 0) > hits
        planned.append(replace(base, plain_bytes=plan.plain_bytes, plan=plan, cached=cached,
                               fusion=fusion.plan(spec, device, plan, len(configs)),
                               memory_plan=_memory_plan(spec, plan, device, cache),
                               pipeline=_pipeline(plan, group)))
    if errors and len(errors) == len(planned):
        what = f"job {number} {_words(label)}" if label else "the model"
        raise DeviceError(f"{config.source}: {what}: {errors[0]} "
                          "(resources.devices, resources.device_memory; --devices, "
                          "--device-memory)") from errors[0]
    return planned


def _pipeline(plan: JobPlan, group: list[Device]) -> PlannedPipeline | None:
    """How a spilled job pipelines over a class of devices (see :class:`PlannedPipeline`)."""
    shape = pipeline_shape(plan, len(group)) if plan.spill else None
    if shape is None:
        return None
    bandwidth = copy_bytes_per_s(group[0].torch_device.type)
    # its step as shard tasks at the same copy bandwidth: compute plus what prefetch leaves
    shard_step_s = plan.step_s
    # Sharded-LRTF gives the longest of R runnable jobs k = ceil(D / R) of D free devices: k for
    # R in ceil(D / k) .. ceil(D / (k - 1)) - 1; choose_packs gives each k its layout, if any is
    # predicted as fast as the shard tasks
    chosen: list[tuple[tuple[int, ...], int, int, int]] = []  # cuts, devices, fewest, most k
    for spare in range(2, len(group) + 1):
        cuts = choose_packs(shape, spare, step_s=shard_step_s, host_bytes_per_s=bandwidth,
                            p2p_bytes_per_s=bandwidth)
        if cuts is None:
            continue
        taken = min(len(cuts) - 1, spare)  # one pack per device, or wrap-around over all k
        if chosen and chosen[-1][:2] == (cuts, taken):
            chosen[-1] = (cuts, taken, chosen[-1][2], spare)
        else:
            chosen.append((cuts, taken, spare, spare))
    planned = []
    for cuts, num_devices, fewest, most in chosen:
        spans = (-(-len(group) // most), -(-len(group) // (fewest - 1)) - 1)
        if spans[0] > spans[1]:  # no R gives it these k: only when some devices are busy
            continue
        step = pipeline_step(shape, cuts, host_bytes_per_s=bandwidth, p2p_bytes_per_s=bandwidth,
                             num_devices=num_devices)
        hosted = pipeline_step(shape, cuts, p2p=False, num_devices=num_devices)
        packs = tuple(tuple(range(a, b)) for a, b in zip(cuts, cuts[1:], strict=False))
        planned.append(PlannedPipelineLayout(
            devices=tuple(group[i % num_devices].name for i in range(len(packs))),
            packs=packs,
            runnable=spans,
            step_s=step.seconds,
            host_bytes_per_step=step.host_to_device_bytes + step.device_to_host_bytes,
            p2p_bytes_per_step=step.p2p_bytes,
            host_bytes_per_step_without_p2p=hosted.host_to_device_bytes
            + hosted.device_to_host_bytes,
            load_bytes=sum(pipeline_unload(shape, cuts, num_devices=num_devices)[1]),
        ))
    return PlannedPipeline(shape.num_microbatches, tuple(planned), shape, shard_step_s)


def _memory_plan(spec: TrainSpec, plan: JobPlan, device: Device,
                 cache: PlanCache | None) -> MemoryPlan | None:
    """The swap / recompute plan launch would use for a spilled job (cached beside its plan)."""
    if not plan.spill:
        return None
    return cached_memory_plan(cache, plan_cache_key(spec), device_kind(device), plan,
                              functools.partial(plan_memory, spec, plan, device=device))


# --- fusion ------------------------------------------------------------------------------------

class _NotMeasured(Exception):
    """``auto`` needs a measurement that ``plan`` was not asked to make."""


class _FusionPlanner:
    """How a job's trials fuse: :class:`FusionDegrees` as launch uses it; measures if asked."""

    def __init__(self, config: SweepConfig, degrees: FusionDegrees, measure: bool,
                 cache: PlanCache | None) -> None:
        self.config = config
        self.grid = config.study.sampler.type == "grid"
        self.degrees = degrees
        self.measure = measure
        self.cache = cache
        #: Per (plan key, device kind, budget, K): a spilled fused array, planned once.
        self.arrays: dict[tuple[str, str, int, int], PlannedArray] = {}

    def plan(self, spec: TrainSpec, device: Device, plan: JobPlan | None,
             num_configs: int) -> PlannedFusion | None:
        """The job's fusion on ``device`` (``plan``: its plan there; ``None`` on the host).

        Sized like launch sizes it: for the widest trial of the job's group
        (:func:`~sweepmaster.config.train_specs.widest_member`).
        """
        if self.degrees.mode == "off":
            return None
        widest = widest_member(self.config, spec)
        if widest is not spec and plan is not None:
            plan = plan_job(widest, device)
        spec = widest
        if plan is None and FusionDegrees.entry(spec, device) is not None:
            plan = plan_job(spec, device)  # the host: not cached, its budget (free RAM) moves

        def measure(spec: TrainSpec, ks: list[int],
                    budget_bytes: int | None) -> list[FusionMeasurement]:
            if not self.measure:
                raise _NotMeasured
            return measure_fusion(spec, device, ks, budget_bytes=budget_bytes)

        try:
            choice = self.degrees.choose(spec, plan, device, plan is not None and plan.spill,
                                         measure, functools.partial(plan_stacked, spec,
                                                                    device=device))
        except _NotMeasured:
            assert plan is not None
            ks, _ = bounded_degrees(auto_degrees(plan, device.budget_bytes,
                                                 device.meter is not None),
                                    plan.step_s, spec.total_steps,
                                    fusion_degree.FUSION_MEASURE_SHARE)
            return PlannedFusion(None, "unmeasured", "not measured: launch measures K = "
                                 f"{', '.join(map(str, ks))} on {device.name} "
                                 "(or plan --measure-fusion)")
        sizes: tuple[int, ...] = ()
        if self.grid and choice.k > 1:
            sizes = tuple(min(choice.k, num_configs - start)
                          for start in range(0, num_configs, choice.k))
        arrays: tuple[PlannedArray, ...] = ()
        if choice.stacked_plan is not None:
            ks = sorted({choice.k, *(size for size in sizes if size > 1)}, reverse=True)
            arrays = tuple(self.array(spec, device, k, choice.stacked_plan if k == choice.k
                                      else None) for k in ks)
        return PlannedFusion(choice.k, choice.source, choice.note, sizes, arrays)

    def array(self, spec: TrainSpec, device: Device, k: int,
              stacked: JobPlan | None) -> PlannedArray:
        """A spilled fused array of K members of ``spec`` on ``device``, as launch plans it.

        Its stacked shards (``stacked``, else planned) and their memory plan, read from the
        partition cache or planned (and kept there unless read only); once per plan key,
        device class and K.
        """
        key = plan_cache_key(spec)
        entry = None if key is None else (key, device_kind(device), device.budget_bytes, k)
        if entry is not None and entry in self.arrays:
            return self.arrays[entry]
        if stacked is None:
            stacked = plan_stacked(spec, k, device=device)
        memory = cached_memory_plan(
            self.cache, key, device_kind(device), stacked,
            functools.partial(plan_stacked_memory, spec, k, stacked, device=device),
            num_members=k) if stacked.spill else None
        array = PlannedArray(k, stacked, memory)
        if entry is not None:
            self.arrays[entry] = array
        return array
