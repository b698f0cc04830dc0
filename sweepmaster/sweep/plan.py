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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.search_space import MAX_GRID_CELLS, parameter_sets
from sweepmaster.config.train_specs import TokenData, TrialSpecs
from sweepmaster.errors import ConfigError, DeviceError
from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.fusion_degree import FusionDegrees
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
from sweepmaster.runtime.planning.update_site import update_cost, with_update_on
from sweepmaster.runtime.scheduling.pipeline import choose_packs, pipeline_step, pipeline_unload
from sweepmaster.store.cache_counts import CacheCounts
from sweepmaster.sweep.plan_fusion import FusionPlanner
from sweepmaster.sweep.plan_results import (
    PlannedArray,
    PlannedFusion,
    PlannedJob,
    PlannedPipeline,
    PlannedPipelineLayout,
    SweepPlan,
)
from sweepmaster.sweep.plan_sources import open_devices, open_fusion_cache, open_plan_cache
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
    fusion = FusionPlanner(config, FusionDegrees(config.resources.fusion, fusion_cache),
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
    plan_counts = _counts(cache)
    hits, saved = plan_counts.num_hits, plan_counts.num_saved

    def counts(num_read: int, num_written: int) -> str:
        """How a cache was used: a read-only one is never written, so only reads count."""
        return f", {num_read} read" if read_only else f" ({num_read} read, {num_written} written)"

    notes.append(f"partition cache: {cache_note}"
                 + (counts(hits, saved) if cache is not None else ""))
    if fusion_cache is not None:
        fusion_counts = _counts(fusion_cache)
        notes.append(f"fusion cache: {cache_note}"
                     f"{counts(fusion_counts.num_hits, fusion_counts.num_saved)}")
    return SweepPlan(
        name=config.name, source=config.source, sampler=config.study.sampler.type,
        devices=tuple(d.name for d in opened), num_configs=len(probes), jobs=tuple(planned),
        notes=tuple(notes), cache=cache_note if cache is not None else None,
        num_cache_hits=hits, num_cache_saved=saved, fusion=config.resources.fusion,
    )


# --- configurations ----------------------------------------------------------------------------

def _counts(cache: object) -> CacheCounts:
    """A store cache's counts (all 0 without a cache, or for a cache that counts nothing)."""
    counts = getattr(cache, "counts", None)
    return counts if isinstance(counts, CacheCounts) else CacheCounts()


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
              cache: PlanCache | None, fusion: FusionPlanner) -> list[PlannedJob]:
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
            plain_bytes = estimate_plain_bytes(spec)
            if plain_bytes > device.budget_bytes:
                try:  # as the executor plans it: a layer past the host's free memory fails
                    plan_job(spec, device)
                except LayerTooLargeError as err:
                    errors.append(err)
                    planned.append(replace(base, plain_bytes=plain_bytes, error=str(err)))
                    continue
            planned.append(replace(base, plain_bytes=plain_bytes,
                                   fusion=fusion.plan(spec, device, None, len(configs))))
            continue
        hits = _counts(cache).num_hits
        try:
            plan = with_update_on(cached_plan(spec, device, cache), spec.optimizer,
                                  config.resources.update_on)
        except LayerTooLargeError as err:
            errors.append(err)
            planned.append(replace(base, plain_bytes=estimate_plain_bytes(spec), error=str(err)))
            continue
        cached = _counts(cache).num_hits > hits
        planned.append(replace(base, plain_bytes=plan.plain_bytes, plan=plan, cached=cached,
                               fusion=fusion.plan(spec, device, plan, len(configs)),
                               memory_plan=_memory_plan(spec, plan, device, cache),
                               pipeline=_pipeline(plan, group),
                               update=update_cost(plan.shards, spec.optimizer,
                                                  device.torch_device.type,
                                                  config.resources.update_on)
                               if plan.spill else None))
    if errors and len(errors) == len(planned):
        what = f"job {number} {_words(label)}" if label else "the model"
        raise DeviceError(f"{config.source}: {what}: {errors[0]} "
                          "(resources.devices, resources.device_memory; --devices, "
                          "--device-memory)") from errors[0]
    return planned


def _pipeline(plan: JobPlan, group: list[Device]) -> PlannedPipeline | None:
    """How a spilled job pipelines over a class of devices (see :class:`PlannedPipeline`).

    ``None`` for a job that updates on the host (ZeRO-Offload): it is never pipelined.
    """
    pipelines = plan.spill and plan.update_on == "device"
    shape = pipeline_shape(plan, len(group)) if pipelines else None
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


