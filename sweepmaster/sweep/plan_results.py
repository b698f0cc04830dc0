"""What a plan of a sweep says: :class:`SweepPlan`, its jobs and how they spill, pipeline and fuse.

Built by :func:`~sweepmaster.sweep.plan.plan_sweep`; printed by ``sweepmaster plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.planning.update_site import UpdateCost
from sweepmaster.runtime.scheduling.pipeline import PipelineShape

__all__ = [
    "PlannedArray", "PlannedFusion", "PlannedJob", "PlannedPipeline", "PlannedPipelineLayout",
    "SweepPlan",
]



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
        update: A spilled job's update on the device against on the host (ZeRO-Offload):
            bytes and seconds of each and why its plan's
            :attr:`~sweepmaster.runtime.planning.plans.JobPlan.update_on` is where it is;
            ``None`` when the job does not spill.
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
    update: UpdateCost | None = None

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
