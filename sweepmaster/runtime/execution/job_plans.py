"""The plans of an executor's jobs: made for its planning device, cached, and their fusion degrees.

:class:`PlanSettings` is how an executor plans its jobs (its devices, ``spill``, microbatches,
activation plans, pipelining), made once from its arguments and read by everything that plans:
:class:`ExecutorPlans`, the executor's jobs and re-planning
(:class:`~sweepmaster.runtime.execution.replan.Replanner`).

:class:`ExecutorPlans` is the planning half of the
:class:`~sweepmaster.runtime.executor.ShardExecutor`'s API (its base class): each job's
partition (:func:`~sweepmaster.runtime.planning.partition.plan_job`, Hydra), the keep / swap /
recompute plan of a spilled job's activations
(:func:`~sweepmaster.runtime.planning.memplan.plan_memory`, mu-TWO), the stacked plans of fused
arrays (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`) and how many trials to
fuse (:mod:`~sweepmaster.runtime.planning.fusion_degree`), each cached per architecture and
device. The executor adds the jobs, the devices' workers and the futures.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning import fusion_degree as fd
from sweepmaster.runtime.planning.fusion_degree import FusionCache, FusionChoice, FusionMeasurement
from sweepmaster.runtime.planning.memplan import MemoryPlan, cached_memory_plan, plan_memory
from sweepmaster.runtime.planning.partition import (
    PlanCache,
    cached_plan,
    device_kind,
    plan_cache_key,
)
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.planning.profile import ModelProfile, profile_model
from sweepmaster.runtime.planning.update_site import UPDATE_SITES, with_update_on
from sweepmaster.runtime.training.fused_memplan import plan_stacked_memory
from sweepmaster.runtime.training.fused_shards import plan_stacked, stacked_spec
from sweepmaster.workload.architecture import fusion_group_key
from sweepmaster.workload.spec import TrainSpec

__all__ = ["ExecutorPlans", "PlanSettings", "SpillMode"]

SpillMode = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """How an executor plans its jobs: its devices and its planning settings, made once.

    The :class:`~sweepmaster.runtime.executor.ShardExecutor` builds it from its arguments;
    its plans (:class:`ExecutorPlans`), its jobs and re-planning
    (:class:`~sweepmaster.runtime.execution.replan.Replanner`) all read this one object.

    Example:
        >>> from sweepmaster.runtime.devices.device import parse_devices
        >>> settings = PlanSettings(parse_devices("cpu:2x256MiB"), spill="always")
        >>> settings.planning_device.name, settings.pipeline_devices
        ('cpu:0', 0)

    Args:
        devices: The executor's devices, in order (at least one, each once; kept as a tuple).
            Plans are made for the smallest budget (:attr:`planning_device`).
        spill: As :class:`~sweepmaster.runtime.executor.ShardExecutor`'s: which plan a job
            gets (:meth:`spills`); with ``"never"`` no job is re-planned either.
        microbatch_size: As the executor's: the largest blocks per layer pass when spilling;
            ``None``: the job's batch size.
        plan_activations: As the executor's: plan keep / swap / recompute of a spilled job's
            activations (mu-TWO); ``False``: recompute every activation (Hydra).
        pipeline: As the executor's: a step of a spilled job or array may be pipelined over the
            devices (Harmony PP, :attr:`pipeline_devices`).
        update_on: As the executor's: where spilled jobs' optimizer steps run (:meth:`placed`).

    Raises:
        ValueError: The device list is empty or repeats a device, ``spill`` is not
            ``"auto"``, ``"always"`` or ``"never"``, ``microbatch_size`` is not an integer
            >= 1 or ``None``, or ``update_on`` is not ``"auto"``, ``"device"`` or ``"host"``.
    """

    devices: Sequence[Device]
    spill: SpillMode = "auto"
    microbatch_size: int | None = None
    plan_activations: bool = True
    pipeline: bool = False
    update_on: str = "auto"

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        if not devices:
            raise ValueError("an Executor needs at least one device")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct, got {[d.name for d in devices]}")
        if self.spill not in ("auto", "always", "never"):
            raise ValueError(f"spill must be 'auto', 'always' or 'never', got {self.spill!r}")
        size = self.microbatch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"microbatch_size must be an integer >= 1 or None, got {size!r}")
        if self.update_on not in UPDATE_SITES:
            raise ValueError(f"update_on must be one of {', '.join(UPDATE_SITES)}, got "
                             f"{self.update_on!r}")
        object.__setattr__(self, "devices", devices)  # frozen: a list given is not shared

    def placed(self, plan: JobPlan, spec: TrainSpec) -> JobPlan:
        """``plan`` with its optimizer steps where this executor runs them.

        ``update_on`` ``"auto"``: where the plan chose
        (:func:`~sweepmaster.runtime.planning.update_site.update_cost`), ``"device"`` or
        ``"host"``: there (:func:`~sweepmaster.runtime.planning.update_site.with_update_on`).
        A job that updates on the host is never pipelined (its chain has no pipeline shape).
        """
        return with_update_on(plan, spec.optimizer, self.update_on)

    @property
    def planning_device(self) -> Device:
        """The device jobs are planned for: the smallest budget, so a plan fits every device."""
        return min(self.devices, key=lambda d: d.budget_bytes)

    @property
    def metered(self) -> bool:
        """Whether every device is metered (none is the host CPU, ``"cpu"``)."""
        return all(device.meter is not None for device in self.devices)

    @property
    def pipeline_devices(self) -> int:
        """Devices a job's step may be pipelined over: all of them with ``pipeline``, else 0."""
        return len(self.devices) if self.pipeline else 0

    def spills(self, plan: JobPlan) -> bool:
        """Whether a job planned as ``plan`` trains by spilling here (the ``spill`` setting).

        ``"always"``: yes; ``"never"``: no; ``"auto"``: as ``plan`` says, except on the host
        CPU, where spilling into the memory it already uses cannot help.
        """
        if self.spill != "auto":
            return self.spill == "always"
        if not self.metered:
            return False  # the host CPU: spilling to the memory it uses cannot help
        return plan.spill


class ExecutorPlans(ABC):
    """The plans an executor gives its jobs, made for its planning device and cached.

    Args:
        settings: The executor's planning settings (its devices, ``spill``, microbatches,
            activation plans; plans are made for the smallest budget).
        plan_cache: As :class:`~sweepmaster.runtime.executor.ShardExecutor`'s.
        fusion: As the executor's.
        fusion_cache: As the executor's.

    Raises:
        ValueError: The fusion setting is invalid.
    """

    def __init__(self, settings: PlanSettings, *, plan_cache: PlanCache | None,
                 fusion: fd.FusionMode, fusion_cache: FusionCache | None) -> None:
        try:
            self._fusion = fd.FusionDegrees(fusion, fusion_cache, settings.microbatch_size)
        except ValueError as err:
            raise ValueError(f"fusion: {err}, got {fusion!r}") from None
        self._settings = settings
        self._plans: dict[tuple[str, str, int], JobPlan] = {}
        self._plan_cache = plan_cache
        self._memory_plans: dict[tuple[str, str, int, int], MemoryPlan | None] = {}
        self._stacked_plans: dict[tuple[str, str, int, bool], JobPlan] = {}
        self._stacked_profiles: dict[tuple[str, str], ModelProfile] = {}
        #: Per fusion group, the member its K was chosen for (:meth:`fusion_choice`).
        self._widths: dict[tuple[str, str], TrainSpec] = {}

    @property
    def fusion(self) -> fd.FusionMode:
        """The fusion setting: ``"auto"``, ``"off"`` or a fixed K."""
        return self._fusion.mode

    @property
    def planning_device(self) -> Device:
        """The device jobs are planned for: the smallest budget, so a plan fits every device."""
        return self._settings.planning_device

    def will_spill(self, spec: TrainSpec) -> bool:
        """Whether ``spec`` trains by spilling here (the ``spill`` setting of a ShardExecutor).

        Raises:
            LayerTooLargeError: A layer alone does not fit the planning device.
        """
        return self._settings.spills(self.plan(spec))

    def plan(self, spec: TrainSpec, device: Device | None = None) -> JobPlan:
        """Plan a job for a device (default :attr:`planning_device`) without training.

        Plans are cached per architecture and device (in ``plan_cache`` too for a metered
        device; the unmetered host CPU's budget is its free RAM, which moves, and it never
        spills: its plans are kept in memory only, one per architecture).

        Raises:
            LayerTooLargeError: A layer alone does not fit the device.
            UnsupportedModelError: The model cannot be split into layers.
        """
        device = device if device is not None else self.planning_device
        metered = device.meter is not None
        arch = plan_cache_key(spec, self._settings.microbatch_size)
        key = None if arch is None else (arch, device.name, device.budget_bytes if metered else 0)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            plan = self._settings.placed(
                cached_plan(spec, device, self._plan_cache if metered else None,
                            microbatch_size=self._settings.microbatch_size), spec)
            if key is not None:
                self._plans[key] = plan
        return plan

    def memory_plan(self, spec: TrainSpec, num_members: int = 1) -> MemoryPlan | None:
        """The swap / recompute plan of a spilled job's activations, or ``None`` (recompute all).

        Made for :attr:`planning_device` with no overlap assumed (a job alone), on the job's
        plan (:meth:`plan`) or, for K = ``num_members`` > 1, on K stacked members' plan
        (:meth:`stacked_plan`; ``spec`` the member it is made for,
        :func:`~sweepmaster.runtime.training.fused_shards.stacked_spec`: a spilled fused
        array, planned by :func:`~sweepmaster.runtime.training.fused_spill.\
plan_stacked_memory`; it bounds the array while fewer members train). Cached in memory per
        architecture, device, budget and K and, on a metered device, in ``plan_cache`` beside
        the partition it was made for
        (:func:`~sweepmaster.runtime.planning.memplan.cached_memory_plan`), so a later
        process reads it instead of tracing the shards again. ``None`` (Hydra's full recompute)
        when ``plan_activations`` is off, the job does not spill, or no plan fits.

        Raises:
            LayerTooLargeError: A layer alone does not fit the planning device
                (:class:`~sweepmaster.runtime.training.fused_shards.StackedLayerTooLargeError`:
                one layer of K members).
            ValueError: ``num_members`` < 1.
        """
        if num_members < 1:
            raise ValueError(f"num_members must be >= 1, got {num_members}")
        plan = self.plan(spec) if num_members == 1 else self.stacked_plan(spec, num_members)
        if not self._settings.plan_activations or not plan.spill:
            return None
        device = self.planning_device
        arch = plan_cache_key(spec, self._settings.microbatch_size)
        name = arch if arch is not None or num_members == 1 else spec.name  # as plans are kept
        key = None if name is None else (name, device.name, device.budget_bytes, num_members)
        if key is not None and key in self._memory_plans:
            return self._memory_plans[key]
        cache = self._plan_cache if device.meter is not None else None
        memory = cached_memory_plan(
            cache, arch, device_kind(device), plan,
            functools.partial(self._plan_memory, spec, num_members, plan),
            num_members=num_members)
        if key is not None:
            self._memory_plans[key] = memory
        return memory

    def _plan_memory(self, spec: TrainSpec, num_members: int, plan: JobPlan) -> MemoryPlan:
        """mu-TWO's plan of ``plan``'s activations on the planning device (K stacked members).

        Raises:
            MemoryPlanError: No plan fits.
        """
        device = self.planning_device
        if num_members == 1:
            return plan_memory(spec, plan, device=device)
        profile = self._stacked_profiles.get(
            (plan_cache_key(spec, self._settings.microbatch_size) or spec.name, device.name))
        return plan_stacked_memory(spec, num_members, plan, device=device, profile=profile)

    def fused_spec(self, specs: Sequence[TrainSpec]) -> TrainSpec:
        """The member a fused array of ``specs`` is estimated (spilled: planned) as.

        The widest of them and of the member :meth:`fusion_choice` sized their group for
        (:func:`~sweepmaster.runtime.training.fused_shards.stacked_spec`, that member first: an
        array within its width is estimated exactly as its K was chosen).
        """
        group = fusion_group_key(specs[0])
        width = self._widths.get(group) if group is not None else None
        return stacked_spec(list(specs) if width is None else [width, *specs])

    def stacked_plan(self, spec: TrainSpec, k: int, *, whole: bool = False) -> JobPlan:
        """The plan of K members of ``spec``'s architecture stacked (cached).

        One stacked shard holding the whole array when its plain footprint fits the planning
        device, or with ``whole`` (an array that must not spill), else the fewest stacked
        shards that fit (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`).

        Raises:
            StackedLayerTooLargeError: One layer of K members does not fit the planning device.
        """
        device, microbatch_size = self.planning_device, self._settings.microbatch_size
        key = (plan_cache_key(spec, microbatch_size) or spec.name, device.name, k, whole)
        plan = self._stacked_plans.get(key)
        if plan is None:
            profile = self._stacked_profiles.get(key[:2])
            if profile is None:  # one member's profile serves every K
                profile = profile_model(spec, microbatch_size, device=device)
                self._stacked_profiles[key[:2]] = profile
            plan = self._settings.placed(
                plan_stacked(spec, k, device, microbatch_size=microbatch_size,
                             profile=profile, whole=whole), spec)
            self._stacked_plans[key] = plan
        return plan

    def fusion_choice(self, spec: TrainSpec) -> FusionChoice:
        """How many trials of ``spec``'s architecture to fuse into one array here, and why.

        Per the ``fusion`` setting: ``"off"``: 1. A fixed K: K, or as many as fit the planning
        device by estimate (``"capped"``). ``"auto"``: the K with the most trials x tokens per
        second measured on a device (mu-TWO's sub-array selection), measured once per
        architecture, optimizer kind, device kind and budget and kept in ``fusion_cache``.
        Always 1 for a model without an architecture key. Trials that spill here fuse with a
        fixed K (as many as K whose stacked shards fit: a spilled fused array); ``"auto"``
        keeps them at 1 (it measures only arrays that fit a device).

        ``spec`` stands for every member an array of its group may hold, trials that join it
        later (refill) included: K is sized for K members as wide as ``spec``. A fused array
        is padded to its widest member (the largest LoRA rank, adapter dropout if any member
        drops, SGD momentum, clipping), so pass the widest trial the group can have: a sweep
        passes its trial with the largest ``model.peft.r``, ``model.peft.dropout`` and
        ``train.momentum`` its search space allows; for full fine-tuning with one optimizer
        setting any trial will do. Arrays of the group are then estimated at least that wide
        (:meth:`ShardExecutor.submit_fused`, :meth:`ShardExecutor.join_fused`; the last call's
        ``spec`` counts), so joiners
        within that width always fit, and a wider joiner is admitted only where the grown
        array's estimate fits. A spilled fused array is planned (stacked shards) and padded that
        wide from the start: joiners within the width fit its plan, wider ones are refused.

        A measurement runs as a job of its own (so it has its device to itself) and this call
        waits for it: call it from the thread that submits jobs, never from a callback.

        Raises:
            RuntimeError: The executor is closed and a measurement was needed.
            LayerTooLargeError: A layer of ``spec`` alone does not fit the devices.
            ValueError: No fusion degree fits the device (not even K = 1).
        """
        if self._fusion.mode == "off" or fd.fusion_cache_key(spec) is None:
            return self._fusion.choose(spec, None, self.planning_device, False, self._measure)
        plan = self.plan(spec)
        group = fusion_group_key(spec)
        if group is not None:
            self._widths[group] = spec
        return self._fusion.choose(spec, plan, self.planning_device, self._settings.spills(plan),
                                   self._measure, functools.partial(self.stacked_plan, spec))

    def fusion_degree(self, spec: TrainSpec) -> int:
        """``fusion_choice(spec).k``: how many trials of ``spec``'s architecture fuse here."""
        return self.fusion_choice(spec).k

    @abstractmethod
    def _measure(self, spec: TrainSpec, ks: list[int],
                 budget_bytes: int | None) -> list[FusionMeasurement]:
        """Measure fusion degrees ``ks`` of ``spec`` on a device with ``budget_bytes``; wait."""
