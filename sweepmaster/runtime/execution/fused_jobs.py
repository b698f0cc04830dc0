"""Executor jobs of horizontal fusion: fused arrays, and the measurement of fusion degrees.

* :class:`SpilledFusedRun`: K same-architecture trials trained as one fused array (HFTA /
  mu-TWO) by stacked-shard tasks (:mod:`~sweepmaster.runtime.training.fused_spill`), scheduled
  like a :class:`~sweepmaster.runtime.execution.jobs.SpilledRun`. An array that fits its device
  is one stacked shard holding the whole array (S = 1,
  :func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`): one task per optimizer step,
  kept resident between its steps, so the policy (SHARP, Sharded-LRTF) interleaves its steps
  with other jobs' tasks; a larger one spills, its stacked shards promoted and demoted around
  their tasks, and is pipelined over several devices when the policy decides it (Harmony PP, its
  steps at which no member leaves or joins). Each member has its own future, resolved the moment
  it leaves the array (finished, pruned or failed) while the others go on; a failure of the
  whole array (out of memory, say) fails the members still in it (one that runs out of memory
  before its first step ends is re-planned with smaller stacked shards). The array refills:
  new members offered to it (:meth:`SpilledFusedRun.offer`) join at the next step boundary
  where a slot is free, up to the K its stacked plan holds, and its vacancy hook is called at
  each such boundary so that whoever decides what trains next can offer one.
* :class:`MeasureJob`: mu-TWO's sub-array selection
  (:func:`~sweepmaster.runtime.planning.fusion_degree.measure_fusion`) run as a job, so it has its
  device to itself: nothing else allocates or computes there while it measures.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import format_bytes
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.execution.attempts import AttemptCallbacks
from sweepmaster.runtime.execution.jobs import ExecutorJob, SpilledRun, TaskSink
from sweepmaster.runtime.execution.policy_chain import shard_chain
from sweepmaster.runtime.planning.fusion_degree import (
    MEASURE_STEPS_PER_K,
    FusionMeasurement,
    fused_bytes_estimate,
    measure_fusion,
)
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.workload.architecture import check_fusable
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = [
    "ArrayEstimate",
    "MeasureJob",
    "SpilledFusedRun",
    "VacancyHook",
    "check_fused_fits",
    "fused_name",
]

_log = logging.getLogger(__name__)

#: Called on the training thread at a step boundary where a fused array has free slots:
#: ``(job name, free slots, the array's steps so far)``. It may offer members
#: (:meth:`SpilledFusedRun.offer`, e.g. through ``ShardExecutor.join_fused``); they join as it
#: returns. Its last call has all K slots free: when it offers no one then, the array has ended
#: (a failed array gets that call too, and refuses offers).
VacancyHook = Callable[[str, int, int], None]

#: Estimates the fused array a member offered to it would make (:meth:`SpilledFusedRun.offer`): its
#: members and the members that left it -> its peak bytes, or ``None`` when it would not fit.
ArrayEstimate = Callable[[list[TrainSpec], list[TrainSpec]], "int | None"]

#: Longest default name of a fused array (the store's job columns hold 128 characters).
_MAX_NAME = 120


def check_fused_fits(specs: Sequence[TrainSpec], plan: JobPlan, device: Device,
                     measured: FusionMeasurement | None) -> None:
    """Check that ``specs`` may train fused on ``device``, each step's peak within its budget.

    The peak (bytes) is the measurement of K = ``len(specs)`` members when there is one, else
    the estimate from the member's ``plan``
    (:func:`~sweepmaster.runtime.planning.fusion_degree.fused_bytes_estimate`).

    Raises:
        ValueError: The members do not share one
            :func:`~sweepmaster.workload.architecture.fusion_group_key`, or they would not fit
            ``device`` together.
    """
    check_fusable(specs)
    k = len(specs)
    peak = measured.peak_bytes if measured is not None else fused_bytes_estimate(plan, k)
    if (measured is not None and not measured.fits) or peak > device.budget_bytes:
        budget = f"the {format_bytes(device.budget_bytes)} budget of {device.name}"
        # a measurement that ran out of memory has no peak to name
        why = (f"needs about {format_bytes(peak)}, more than {budget}"
               if peak > device.budget_bytes else f"ran out of {budget} when measured")
        raise ValueError(f"a fused array of {k} members {why}; fuse fewer "
                         "(Executor.fusion_choice says how many fit)")


def fused_name(specs: Sequence[TrainSpec]) -> str:
    """A fused array's default name: its members' names joined by ``+`` (shortened if long)."""
    name = "+".join(spec.name for spec in specs)
    return name if len(name) <= _MAX_NAME else f"{specs[0].name[:80]}+{len(specs) - 1} more"


class _Refills:
    """The refill side of a fused array in the executor: offers, free slots, the vacancy hook.

    Of :class:`SpilledFusedRun`: members offered (:meth:`offer`) wait until the worker running
    the array's task asks for them (:meth:`_refill`, the array's
    :data:`~sweepmaster.runtime.training.member_runs.RefillHook`) at a step boundary with free
    slots, after the vacancy hook had its say.
    """

    job_id: str
    specs: list[TrainSpec]
    members: list[AttemptCallbacks]
    futures: list[concurrent.futures.Future[TrainResult]]

    @property
    def receivers(self) -> list[AttemptCallbacks]:
        """The members' receivers."""
        return self.members

    @property
    def first_step_pending(self) -> bool:
        """No member has ended a step, and none has left (a fresh array would hold it again)."""
        pending: bool = super().first_step_pending  # type: ignore[misc]  # ExecutorJob's
        return pending and not any(f.done() for f in self.futures)

    def ended(self) -> None:
        """The vacancy hook hears that the array has ended, unless it did (a failed array)."""
        self._close()

    def _init_refills(self, num_slots: int, on_vacancy: VacancyHook | None) -> None:
        self._on_vacancy = on_vacancy
        self._num_slots = num_slots
        self._offers: list[tuple[TrainSpec, TrainCallbacks | None,
                                 concurrent.futures.Future[TrainResult]]] = []
        self._offers_lock = threading.Lock()
        self._closed = False  # takes no more offers
        self._left: set[int] = set()  # indices in specs of members that left (or never joined)
        self._array_step = 0

    def offer(self, spec: TrainSpec, callbacks: TrainCallbacks | None,
              future: concurrent.futures.Future[TrainResult],
              estimate: ArrayEstimate | None = None) -> bool:
        """Offer a member to join at the next step boundary with a free slot (thread-safe).

        The member is built as it would train alone and stacked into the array
        (:meth:`~sweepmaster.runtime.training.fused_members.StackedMembers.join`); ``future`` is
        resolved when it leaves, like a founding member's (a member that cannot join fails it
        alone).

        Args:
            spec: The member.
            callbacks: Its progress receiver.
            future: Resolved when it leaves the array.
            estimate: Checks the array it would make before it is taken (its members: those
                in it, those offered before, then ``spec``; and the members that left it, whose
                LoRA rank and adapter dropout still pad it -> the grown array's estimated peak
                bytes, or ``None`` when it would not fit). ``None``: no check.

        Returns:
            Whether the offer was taken: ``False`` once the array has no member left and took
            no offer (it ends), or when ``estimate`` refuses it (nothing changes). An offer
            taken but never joined (more offers than slots when the array ends) is failed by
            the executor with ``JobCancelledError``.
        """
        with self._offers_lock:
            if self._closed:
                return False
            if estimate is not None and estimate(*self._prospective(spec)) is None:
                return False
            self._offers.append((spec, callbacks, future))
            return True

    def _prospective(self, spec: TrainSpec) -> tuple[list[TrainSpec], list[TrainSpec]]:
        """The array's members if ``spec`` joined now, and those that left it (hold the lock)."""
        live = [s for i, s in enumerate(self.specs) if i not in self._left]
        left = [s for i, s in enumerate(self.specs) if i in self._left]
        return [*live, *(offered for offered, _, _ in self._offers), spec], left

    def _refill(self, free: int, array_step: int) -> list[tuple[TrainSpec, TrainCallbacks | None]]:
        """The :data:`~sweepmaster.runtime.training.member_runs.RefillHook` of the array."""
        self._array_step = array_step
        self._vacancy(free)
        with self._offers_lock:
            taken, self._offers = self._offers[:free], self._offers[free:]
            if not taken and free == self._num_slots:  # no member left: the array ends
                self._closed = True
            for spec, _, future in taken:
                self.specs.append(spec)
                self.futures.append(future)
        return [(spec, callbacks) for spec, callbacks, _ in taken]

    def _member_left(self, index: int) -> None:
        with self._offers_lock:
            self._left.add(index)

    def _vacancy(self, free: int) -> None:
        if self._on_vacancy is not None:
            try:
                self._on_vacancy(self.job_id, free, self._array_step)
            except Exception:  # whoever refills failed; the array runs on with fewer members
                _log.exception("the vacancy hook of fused array %s failed", self.job_id)

    def _close(self) -> None:
        """Take no more offers; unless the array ended by refusing none, the hook hears it.

        Its last call has all slots free (:data:`VacancyHook`): a failed array gets it too.
        """
        with self._offers_lock:
            ended, self._closed = self._closed, True
        if not ended:
            self._vacancy(self._num_slots)


class MeasureJob(ExecutorJob):
    """Measure the fusion degrees ``ks`` of one architecture on the device it is given.

    Its result is the list of
    :class:`~sweepmaster.runtime.planning.fusion_degree.FusionMeasurement` (increasing K); its task
    record has kind ``"measure"``.

    Args:
        job_id: The job's unique name in its executor.
        spec: A trial of the architecture.
        plan: Its plan (for the estimate of the measurement's seconds and the budget).
        on_task: Receives the job's task record.
        ks: The fusion degrees to measure.
        budget_bytes: The budget K members must fit (bytes), or ``None`` for the device's own
            (its meter, or the host's free RAM).
        microbatch_size: The executor's largest blocks per layer pass, which the arrays are
            planned and timed at (``None``: the batch).
    """


    def __init__(self, job_id: str, spec: TrainSpec, plan: JobPlan, on_task: TaskSink | None,
                 *, ks: Sequence[int], budget_bytes: int | None,
                 microbatch_size: int | None = None) -> None:
        self.ks = list(ks)
        self.budget_bytes = budget_bytes
        self.microbatch_size = microbatch_size
        self._result: list[FusionMeasurement] | None = None
        super().__init__(job_id, dataclasses.replace(spec, checkpoint_dir=None), plan, None,
                         on_task)

    def chain(self) -> JobSpec:
        """One ``"step"`` task of about ``17 * sum(ks)`` single-member steps."""
        seconds = MEASURE_STEPS_PER_K * sum(self.ks) * self.plan.step_s
        return JobSpec(self.job_id, (TaskSpec(self.job_id, 0, 0, "step", seconds, 0, 0),), 1)

    def run(self, task: TaskSpec, device: Device, *, prefetch: bool, prefetch_next: bool) -> None:
        """Measure on ``device`` (alone on it)."""
        start = time.time()
        try:
            self._result = measure_fusion(self.spec, device, self.ks,
                                          budget_bytes=self.budget_bytes,
                                          microbatch_size=self.microbatch_size)
        finally:
            self._record(device, 0, "measure", start, time.time(), 0, 0)

    @property
    def done(self) -> bool:  # noqa: D102
        return self._result is not None

    def result(self) -> Any:
        """The measurements, in increasing K."""
        assert self._result is not None, "the job has not run"
        return self._result

    def peak_bytes(self, task: TaskSpec) -> int:
        """The whole budget: nothing is prefetched beside a measurement."""
        return self.plan.budget_bytes


class SpilledFusedRun(_Refills, SpilledRun):
    """A fused array in the executor: one policy task per stacked training shard task.

    Scheduled like :class:`~sweepmaster.runtime.execution.jobs.SpilledRun` (SHARP, Sharded-LRTF),
    whose task handling it shares: its chain is Hydra's ``2S - 1`` tasks per step of the stacked
    plan, for the longest member's steps; evaluation tasks run on the same device right before
    the training task that follows them. Each member's future resolves as soon as it leaves the
    array (finished or pruned: its result; failed alone: its error); a failure of the whole
    array (out of memory) fails the members still in it, unless the array runs out of memory
    before its first step ends and none has left it: the executor then re-plans it with smaller
    stacked shards and restarts it (:meth:`replanned`). An array that fits its device is one
    stacked shard (S = 1): one task per step, the shard kept resident between them while the
    executor's residency cache keeps it (promoted once); on the host CPU nothing is copied.

    It refills: members offered (:meth:`offer`) join at the next step
    boundary with a free slot, on the worker running the array's task then
    (:meth:`~sweepmaster.runtime.training.fused_members.StackedMembers.join`), and its vacancy hook
    is called at each such boundary; the stacked plan holds the founding K, so at most K train
    at a time and a member wider than the plan is refused (:meth:`admits`). The policy's chain
    starts as the founders' and grows when a joiner trains past it (:meth:`grown_chain`).

    Pipelined (``pipeline_devices``; :meth:`run_pipelined`, shared with ``SpilledRun``): a step
    the policy pipelines runs the stacked packs over several devices; at a step boundary where
    a member leaves (ends, is pruned, fails alone), where one may join (a free slot) or where
    a member checkpoints, the packs go home first, so each pipelined step's members are fixed.

    Args:
        job_id: The array's unique name in its executor.
        specs: The members.
        plan: The stacked plan (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`).
        callbacks: One progress receiver (or ``None``) per member.
        on_task: Receives a :class:`~sweepmaster.runtime.events.TaskRecord` per shard
            task.
        futures: One future per member, in the order of ``specs``.
        on_vacancy: Called when members have left and slots are free (:data:`VacancyHook`).
        planned: The member ``plan`` was made for (see :class:`SpilledFusedJob`).
        memory_plan: Keep / swap / recompute of the stacked shards' activations (mu-TWO,
            :func:`~sweepmaster.runtime.training.fused_memplan.plan_stacked_memory` for ``plan``);
            ``None``: Hydra's recompute of every activation.
        pipeline_devices: Devices a step of it may be pipelined over (Harmony PP, as a
            :class:`~sweepmaster.runtime.execution.jobs.SpilledRun`'s; the shape's bytes are
            the stacked shards', K members'); 0 or 1: never.

    Raises:
        ValueError: See :class:`SpilledFusedJob`.
    """

    restarts = True

    def __init__(self, job_id: str, specs: Sequence[TrainSpec], plan: JobPlan,
                 callbacks: Sequence[TrainCallbacks | None], on_task: TaskSink | None, *,
                 futures: Sequence[concurrent.futures.Future[TrainResult]],
                 on_vacancy: VacancyHook | None = None,
                 planned: TrainSpec | None = None,
                 memory_plan: MemoryPlan | None = None, pipeline_devices: int = 0) -> None:
        if not len(specs) == len(callbacks) == len(futures):
            raise ValueError("a fused job needs one callback and one future per member")
        self.specs = list(specs)
        self.futures = list(futures)
        self.members = [AttemptCallbacks.of(c) for c in callbacks]
        self._init_refills(len(self.specs), on_vacancy)
        self.job = self.array = SpilledFusedJob(self.specs, plan, self.members,
                                                on_member_end=self._member_ended,
                                                refill=self._refill, planned=planned,
                                                memory_plan=memory_plan)
        self._pipeline_devices = pipeline_devices
        ExecutorJob.__init__(self, job_id, specs[0], plan, None, on_task)

    @property
    def planned_spec(self) -> TrainSpec:
        """The member the stacked plan was made for (see :class:`SpilledFusedJob`)."""
        return self.array.members.stacked.planned_spec

    def admits(self, members: list[TrainSpec], left: list[TrainSpec]) -> int | None:
        """The :data:`ArrayEstimate` of the array: its planned peak, ``None`` past the plan.

        ``members`` (those in the array, those offered, the new one) must be at most the K
        the stacked plan holds and each no wider than the member it was made for
        (:meth:`~sweepmaster.runtime.training.fused_members.StackedMembers.refusal`); ``left``
        does not matter (the plan keeps its width).
        """
        del left
        array = self.array
        held = array.members.stacked
        if len(members) > held.num_slots or any(held.refusal(s) is not None for s in members):
            return None
        return self.planned_peak_bytes

    def replanned(self, plan: JobPlan, memory_plan: MemoryPlan | None,
                  pipeline_devices: int = 0) -> SpilledFusedRun:
        """A fresh array of the same members on the stacked ``plan``.

        ``memory_plan`` (for ``plan``, or ``None``) plans its activations.
        """
        return SpilledFusedRun(self.job_id, self.specs, plan, self.members, self.on_task,
                               futures=self.futures, on_vacancy=self._on_vacancy,
                               planned=self.planned_spec, memory_plan=memory_plan,
                               pipeline_devices=pipeline_devices)

    def _member_ended(self, index: int, result: TrainResult | None,
                      error: Exception | None) -> None:
        self._member_left(index)
        future = self.futures[index]
        if error is not None:
            future.set_exception(error)
        else:
            assert result is not None
            future.set_result(dataclasses.replace(result, num_replans=self.num_replans))

    def chain(self) -> JobSpec:
        """Hydra's chain of the stacked shards, for the longest member's steps left.

        Members resumed from checkpoints train only their steps left (at least one step's
        tasks, which find nothing to do when every member resumed at its end). Members that
        join later lengthen it (:meth:`grown_chain`). With ``pipeline_devices``, its pipeline
        shape (the stacked plan's, for the K it was made for): a pipelined array sends its
        packs home at a step boundary where a member leaves, may join or checkpoints
        (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`), and its last
        pipelined step trains on to its end when members that joined lengthened it.
        Its evaluation passes (the K members' blocks at once) are the founders': at step 0,
        every ``eval_every`` steps when they share it, and at the end.
        """
        self._chain_steps = max(1, self.array.members.num_steps)
        eval_data = self.array.members.runs[0].eval_data
        periods = {spec.eval_every for spec in self.specs}
        chain = shard_chain(self.job_id, self.plan, self._chain_steps,
                            eval_rows=0 if eval_data is None else len(eval_data),
                            eval_every=periods.pop() if len(periods) == 1 else None,
                            memory_plan=self.array.memory_plan,
                            num_members=self.array.members.stacked.num_slots)
        return self._with_pipeline(chain, self.array.members.stacked.num_slots)

    def grown_chain(self) -> JobSpec | None:
        """The longer chain once a member that joined trains past the array's chain."""
        return self.chain() if self.array.members.num_steps > self._chain_steps else None

    @property
    def done(self) -> bool:  # noqa: D102
        return self.job.next_task() is None and not self.array.members.live

    def result(self) -> None:
        """``None``: the members' futures are resolved as they leave the array."""
        return None
