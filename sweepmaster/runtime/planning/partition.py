"""Plan a job for a device: profile, partition into shards, and keep the plan across launches.

:func:`plan_job` profiles a job (:mod:`~sweepmaster.runtime.planning.profile`) and cuts its
layers into shards whose working sets fit a device budget, into a
:class:`~sweepmaster.runtime.planning.plans.JobPlan` (what ``sweepmaster plan`` prints). Two
partitioners cut:

* :func:`~sweepmaster.runtime.planning.packing.estimate_partition`, Harmony's balanced-time
  packing (Li et al. VLDB 2022, Algorithm 2) from the profile's bytes and seconds;
* :func:`~sweepmaster.runtime.planning.pilot.pilot_partition`, Hydra's pilot pass (Nagrecha &
  Kumar 2022, Algorithm 1), really training candidate shards on the device under the budget.

:func:`cached_plan` keeps plans in a :class:`PlanCache` per (:func:`plan_cache_key`, budget,
:func:`device_kind`), across processes and launches.

Example:
    >>> plan = plan_job(spec, parse_devices("cpu:1x64MiB")[0])  # doctest: +SKIP
    >>> plan.spill, len(plan.shards), plan.num_tasks_per_step  # doctest: +SKIP
    (True, 4, 7)
"""

from __future__ import annotations

import dataclasses

import torch

from sweepmaster.runtime.devices.device import Device, VirtualDevice
from sweepmaster.runtime.planning.packing import estimate_partition, make_plan
from sweepmaster.runtime.planning.pilot import pilot_partition, pilot_pass
from sweepmaster.runtime.planning.plans import JobPlan, KeyedCache
from sweepmaster.runtime.planning.profile import ModelProfile, profile_model
from sweepmaster.runtime.planning.shard_costs import _plain_bytes
from sweepmaster.runtime.training.optimizers import optimizer_entry
from sweepmaster.workload.architecture import architecture_key
from sweepmaster.workload.spec import OptimizerSpec, TrainSpec

__all__ = [
    "PlanCache", "cached_plan", "device_kind", "optimizer_key", "plan_cache_key", "plan_job",
]

#: Bumped whenever :class:`JobPlan`'s fields or the partitioner's choices change, so plans cached
#: by an older version are not reused (part of :func:`plan_cache_key`).
PLAN_FORMAT_VERSION = 8


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
        method: ``"estimate"``
            (:func:`~sweepmaster.runtime.planning.packing.estimate_partition`) or ``"pilot"``
            (:func:`~sweepmaster.runtime.planning.pilot.pilot_partition`, runs real passes on
            ``device`` at ``microbatch_size``).
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
    momentum = "momentum" in optimizer_entry(opt.name).settings and opt.momentum > 0
    key = opt.name + ("+momentum" if momentum else "")
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
