"""The shard executor: many jobs share few devices under SHARP, spilling those larger than one.

:class:`ShardExecutor` is the entry point below ``sweep.py`` and the Python API
(``sweepmaster.Executor.fit`` from an Optuna objective under ``study.optimize(n_jobs=K)``).
Jobs are submitted from any thread; one worker thread per device asks the scheduling policy
(default Sharded-LRTF, Hydra's SHARP: Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633)
for its next shard task whenever it is free, runs it, and reports it done:

* every job is planned (:func:`~sweepmaster.runtime.planning.partition.plan_job`) and trained by
  shard tasks (:class:`~sweepmaster.runtime.execution.jobs.SpilledRun`), which the policy
  interleaves with other jobs' tasks over all devices, so every device stays busy and jobs finish
  close together. A job whose estimated plain footprint fits its device is one shard (S = 1):
  one task per optimizer step, its weights and optimizer state kept resident between its steps
  (below); a larger one spills, its shards promoted and demoted around their tasks. On the host
  CPU (``"cpu"``, unmetered) nothing is copied: its transfers are in place
  (:attr:`~sweepmaster.runtime.devices.transfer.TransferEngine.in_place`);
* while a task runs, the shard of the task the policy's lookahead names for that device is
  promoted in the background when it fits beside the running task (Hydra's double buffering),
  whether it belongs to the same job or to another;
* a job that fails (out of memory, non-finite loss, a callback's exception, any fault while it
  is promoted, computed, updated, evaluated or prefetched, even beside another job's task) fails
  alone: its future holds the exception, what it held on any device is freed, and the device
  goes on with the other jobs;
* except a job whose own task runs out of device memory before its first optimizer step ends
  (plans are estimates: fragmentation, another process or a kernel's workspace can take what
  the plan counted on). Nothing of its trial has changed then that a fresh build from its spec
  does not reproduce, so it is re-planned with less memory and restarted from its spec under the
  same name and future: a job of one shard spills, a fused array spills as stacked
  shards, a spilled job gets more shards or smaller microbatches
  (:meth:`~sweepmaster.runtime.execution.replan.Replanner.replanned`), at most
  :data:`~sweepmaster.runtime.execution.replan.MAX_REPLANS` times. Its callbacks hear one
  :class:`~sweepmaster.runtime.events.ReplanEvent` per re-plan;
  after its first step an out-of-memory error fails it as any fault does;
* a shard whose job's next task is of the same shard stays resident on its device
  (:meth:`~sweepmaster.runtime.training.spill.SpilledJob.run`, ``keep``): no demote and no promote
  between them, and several jobs keep shards on one device at once while they fit. The executor's
  residency cache (:class:`~sweepmaster.runtime.scheduling.residency.Residency`, the rule the
  policies and the simulator follow too) evicts the least recently used of them before a task
  whose planned peak would not fit beside them; what changed is written back when a shard is
  evicted (so, also when its next task runs elsewhere, a checkpoint, the result). The policy's
  residency model is told what was not kept or was evicted
  (:meth:`~sweepmaster.runtime.scheduling.scheduler.Policy.evicted`);
* prefetch decisions read the planned peak of what a task really runs (its memory plan's when
  it has one: :meth:`~sweepmaster.runtime.execution.jobs.ExecutorJob.peak_bytes`) and count what
  other jobs keep on the device;
* K same-architecture trials may train as one fused array (:meth:`ShardExecutor.submit_fused`,
  HFTA / mu-TWO horizontal fusion): one job for the policy, one future per trial, planned as
  stacked shards of K members and trained by stacked-shard tasks the policy schedules like any
  job's (:class:`~sweepmaster.runtime.execution.fused_jobs.SpilledFusedRun`). An array that fits
  its device is one stacked shard (S = 1): one task per step, kept resident between its steps
  like a single job that fits; a larger one spills. :meth:`ShardExecutor.fusion_choice` says how
  many to fuse (``fusion="auto"`` measures it on a device, as a job of its own:
  :class:`~sweepmaster.runtime.execution.fused_jobs.MeasureJob`). An array refills: trials given
  to :meth:`ShardExecutor.join_fused` from its vacancy hook take the slots of members that left, up
  to the K of its stacked plan.

The same policy classes drive the simulator (:mod:`~sweepmaster.runtime.scheduling.simulate`), so a
simulated makespan and a real one come from the same scheduling code.

This module holds the executor's API of jobs, futures and workers; the plans it gives its jobs
(partitions, memory plans, stacked plans, fusion degrees, cached) are its base class
:class:`~sweepmaster.runtime.execution.job_plans.ExecutorPlans`, made by the one
:class:`~sweepmaster.runtime.execution.job_plans.PlanSettings` it builds from its arguments
(which re-planning reads too). The device workers' loop and their threads are
:mod:`~sweepmaster.runtime.execution.device_workers`, over the
:class:`~sweepmaster.runtime.execution.state.ExecutorState` they share with it, and re-planning
after running out of memory is :mod:`~sweepmaster.runtime.execution.replan`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from sweepmaster.runtime.devices.device import Device, executor_devices
from sweepmaster.runtime.events import TaskRecord, TrainCallbacks
from sweepmaster.runtime.execution.device_workers import DeviceWorkers, WorkerThreads
from sweepmaster.runtime.execution.fused_jobs import (
    MeasureJob,
    SpilledFusedRun,
    VacancyHook,
    check_fused_fits,
    fused_name,
)
from sweepmaster.runtime.execution.job_plans import ExecutorPlans, PlanSettings, SpillMode
from sweepmaster.runtime.execution.jobs import ExecutorJob, SpilledRun, TaskSink
from sweepmaster.runtime.execution.replan import MAX_REPLANS, Replanner
from sweepmaster.runtime.execution.state import ExecutorState, JobCancelledError
from sweepmaster.runtime.planning import fusion_degree as fd
from sweepmaster.runtime.planning.fusion_degree import FusionCache, FusionMeasurement
from sweepmaster.runtime.planning.partition import PlanCache, plan_job
from sweepmaster.runtime.scheduling.policies import ShardedLRTF, policy_names
from sweepmaster.runtime.scheduling.residency import Residency
from sweepmaster.runtime.scheduling.scheduler import Policy
from sweepmaster.runtime.training.fused_shards import stacked_spec
from sweepmaster.workload.architecture import check_fusable, fusion_group_key
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["MAX_REPLANS", "ShardExecutor", "JobCancelledError"]

#: What a job submitted after :meth:`ShardExecutor.close` is told.
_CLOSED = ("the Executor is closed (close() was called or its with-block ended); create a new "
           "Executor to train more jobs")


class ShardExecutor(ExecutorPlans):
    """The spilling shard executor: trains many jobs on fixed devices under SHARP; thread-safe.

    :meth:`submit` adds a job and returns a future of its result; :meth:`fit` submits and waits.
    So K threads calling ``fit`` at once (``study.optimize(objective, n_jobs=K)``) multiplex their
    K jobs on the devices. Callbacks run on the worker thread that runs the job's task.

    Every job trains by shard tasks on its plan, made for the smallest budget among the devices
    (so it may run on any): one shard holding the whole model when its estimated plain footprint
    fits (``spill="auto"``), else the fewest shards that fit. The host CPU device (``"cpu"``,
    unmetered) never spills: spilling into the memory it already uses cannot help; its jobs are
    one shard each and copy nothing. On a virtual device every task runs under the device's
    meter, so a job that does not fit gets ``torch.OutOfMemoryError``: in its first step it is
    re-planned with less memory and restarted (see the module doc), at most :data:`MAX_REPLANS`
    times and not with ``spill="never"``; later, or after that, it fails with the error. The
    numbers are always
    those of :func:`~sweepmaster.runtime.training.plain.train_plain` (checked by
    ``tests/runtime/training/test_conformance.py``).

    With several devices on the CPU (virtual devices ``cpu:Kx...``), torch's intra-op threads are
    split between them (``torch.set_num_threads(cores // K)``, at least 1), so K workers compute
    at once instead of competing for every core. The setting is process-wide: :meth:`close`
    (with ``wait``) restores the thread count it found.

    Example:
        >>> with ShardExecutor("cpu:2x256MiB") as executor:
        ...     futures = [executor.submit(spec) for spec in specs]  # doctest: +SKIP
        ...     results = [f.result() for f in futures]  # doctest: +SKIP

    Args:
        devices: A device spec for :func:`~sweepmaster.runtime.devices.device.parse_devices`
            (``"auto"``, ``"cpu"``, ``"cuda:0,cuda:1"``, ``"cpu:2x256MiB"``) or devices.
        device_memory: Cap on every device's budget (bytes or a size such as ``"8GiB"``); only
            with a spec string.
        spill: Which plan a job gets: ``"auto"`` (the partitioner's: one shard when the job
            fits, else spilled shards; one shard on the host CPU), ``"always"`` (the
            partitioner's, on the host CPU too) or ``"never"`` (one shard holding the whole
            model whatever the budget: a job that does not fit runs out of memory).
        microbatch_size: The largest blocks per layer pass when spilling (each shard uses the
            largest that fits); default the job's batch size.
        prefetch: Double-buffer shard promotion when spilling.
        policy: The scheduling policy's name (see
            :func:`~sweepmaster.runtime.scheduling.policies.policy_names`): ``"sharded-lrtf"``
            (default), ``"task-parallel-fifo"``, ``"round-robin"``, ``"random"``,
            ``"shortest-remaining"``, ``"model-parallel"``; or a fresh policy object for
            these devices (e.g. one that records its decisions).
        on_task: Receives a :class:`~sweepmaster.runtime.events.TaskRecord` per task run
            (the device timeline); called on worker threads, must be cheap.
        plan_cache: Where plans are kept across processes (e.g. the store's
            ``StorePlanCache``, which keeps the memory plans too); plans are always cached in
            memory as well.
        plan_activations: Plan keep / swap / recompute of each spilled job's activations
            under the budget (mu-TWO, :func:`~sweepmaster.runtime.planning.memplan.plan_memory`;
            a spilled fused array's stacked shards too, :meth:`memory_plan` with K);
            ``False``, or a shard no plan fits, recomputes every activation (Hydra).
        fusion: How many same-architecture trials :meth:`fusion_choice` fuses into one array:
            ``"off"`` (default: none), a fixed K (fewer where K do not fit a device), or
            ``"auto"`` (measured per architecture: mu-TWO's sub-array selection; see
            :mod:`~sweepmaster.runtime.planning.fusion_degree`). :meth:`submit_fused` fuses
            whatever it is given, whatever this says.
        fusion_cache: Where fusion measurements are kept across processes (e.g. the store's
            ``StoreFusionCache``); they are always kept in memory too.
        pipeline: When fewer jobs are ready than devices are free, let the policy run whole
            steps of a spilled job or array pipelined over several devices (Harmony PP:
            :class:`~sweepmaster.runtime.scheduling.policies.ShardedLRTF` with ``pipeline=True``,
            :class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`); only with the
            ``"sharded-lrtf"`` policy (or a policy object built to pipeline). A pipelined job
            evaluates and writes its checkpoints at the steps its shard tasks would.
        update_on: Where a spilled job's optimizer steps run: ``"auto"`` (default: where
            :func:`~sweepmaster.runtime.planning.update_site.update_cost` chooses, the job
            plan's :attr:`~sweepmaster.runtime.planning.plans.JobPlan.update_on`),
            ``"device"`` (Harmony's just-in-time update) or ``"host"`` (ZeRO-Offload: the step
            on the host copies, overlapped with the device's next task). A job that fits its
            device always updates there; a job that updates on the host is never pipelined.

    Raises:
        ValueError: The device spec, policy (name, or an object for other devices or with
            jobs) or fusion setting is invalid, or the device list is empty or repeats a device;
            ``device_memory`` is a string without a unit (``"512"``: write ``"512MiB"``; an
            int is a number of bytes) or comes with a device list; ``microbatch_size`` < 1;
            ``update_on`` is not ``"auto"``, ``"device"`` or ``"host"``.
        TypeError: ``devices`` is neither a spec string nor a sequence of devices.
    """

    def __init__(
        self,
        devices: str | Sequence[Device] = "auto",
        *,
        device_memory: str | int | None = None,
        spill: SpillMode = "auto",
        microbatch_size: int | None = None,
        prefetch: bool = True,
        policy: str | Policy = "sharded-lrtf",
        on_task: TaskSink | None = None,
        plan_cache: PlanCache | None = None,
        plan_activations: bool = True,
        fusion: fd.FusionMode = "off",
        fusion_cache: FusionCache | None = None,
        pipeline: bool = False,
        update_on: str = "auto",
    ) -> None:
        settings = PlanSettings(
            executor_devices(devices, device_memory),
            spill=spill, microbatch_size=microbatch_size, plan_activations=plan_activations,
            pipeline=pipeline, update_on=update_on)
        num_devices = len(settings.devices)
        policies = policy_names()
        if isinstance(policy, Policy):
            if policy.num_devices != num_devices or policy.job_ids():
                raise ValueError(f"a policy instance must be fresh and for {num_devices} "
                                 f"devices, got one for {policy.num_devices} with jobs "
                                 f"{policy.job_ids()}")
        elif policy not in policies:
            raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(policies)}")
        elif pipeline and policy != ShardedLRTF.name:
            raise ValueError(f"pipeline=True needs the {ShardedLRTF.name!r} policy, got "
                             f"{policy!r}")
        super().__init__(settings, plan_cache=plan_cache, fusion=fusion,
                         fusion_cache=fusion_cache)
        chosen: Policy
        if isinstance(policy, Policy):
            chosen = policy
        elif pipeline:
            chosen = ShardedLRTF(num_devices, device_bytes=self._device_bytes(), pipeline=True)
        else:
            chosen = policies[policy](num_devices, device_bytes=self._device_bytes())
        #: The jobs, the policy, the residency cache: what the device workers share with the API.
        self._state = ExecutorState(settings.devices, chosen, Residency(self._device_bytes()))
        self.policy_name = chosen.name
        self._task_listeners: list[TaskSink] = [on_task] if on_task is not None else []
        self._num_renamed = 0
        self._threads = WorkerThreads(
            DeviceWorkers(self._state, Replanner(settings, self._plan_memory), prefetch))

    @property
    def devices(self) -> list[Device]:
        """The devices jobs run on, in order."""
        return list(self._settings.devices)

    def add_task_listener(self, listener: TaskSink) -> None:
        """Also send each task's :class:`TaskRecord` to ``listener``."""
        with self._state.condition:
            self._task_listeners = [*self._task_listeners, listener]

    def remove_task_listener(self, listener: TaskSink) -> None:
        """Stop sending task records to ``listener`` (added by :meth:`add_task_listener`)."""
        with self._state.condition:
            self._task_listeners = [x for x in self._task_listeners if x is not listener]

    def submit(
        self, spec: TrainSpec, callbacks: TrainCallbacks | None = None
    ) -> concurrent.futures.Future[TrainResult]:
        """Add a job; it starts as soon as the policy gives it a device.

        Args:
            spec: The job. Its name labels its tasks (made unique among running jobs).
            callbacks: Its progress receiver (called on worker threads).

        Returns:
            A future of the job's result; its exception is the job's failure
            (``torch.OutOfMemoryError`` after its first step or its last re-plan,
            ``FloatingPointError``, :class:`JobCancelledError`, ...).

        Raises:
            RuntimeError: The executor is closed.
            LayerTooLargeError: The job must spill but one of its layers alone does not fit.
            ValueError: The spec is invalid.
            TypeError: ``spec`` is not a :class:`~sweepmaster.workload.spec.TrainSpec`.
        """
        self._check_open()
        _check_spec("spec", spec)
        job = self._make_job(spec, callbacks)
        future: concurrent.futures.Future[TrainResult] = _running_future()
        self._add(job, [future])
        return future

    def fit(self, spec: TrainSpec, callbacks: TrainCallbacks | None = None) -> TrainResult:
        """Train one job to its end, sharing the devices with every other submitted job.

        Args:
            spec: The job.
            callbacks: Its progress receiver (called on the worker threads).

        Returns:
            The job's result (``swap_bytes`` is 0 when it ran on the host CPU, which copies
            nothing; a job of one shard promotes it once while it stays resident).

        Raises:
            RuntimeError: The executor is closed.
            JobCancelledError: The executor closed before the job ended.
            torch.OutOfMemoryError: The job did not fit its device after its first step, or not
                even re-planned (see the class doc).
            LayerTooLargeError: The job must spill but one of its layers alone does not fit.
            FloatingPointError: The train loss became non-finite (see ``train_plain``).
        """
        return self.submit(spec, callbacks).result()

    def submit_fused(
        self,
        specs: Sequence[TrainSpec],
        callbacks: Sequence[TrainCallbacks | None] | None = None,
        *,
        name: str | None = None,
        on_vacancy: VacancyHook | None = None,
    ) -> list[concurrent.futures.Future[TrainResult]]:
        """Add K same-architecture trials as one fused array: one job, one future per trial.

        The array (HFTA / mu-TWO horizontal fusion) is one job for the policy: a chain of tasks
        over the K members' stacked shards (:meth:`stacked_plan`,
        :class:`~sweepmaster.runtime.execution.fused_jobs.SpilledFusedRun`), each under its
        device's meter. Each member ends with the result ``train_plain`` would give it alone
        (docs/design.md, "Fused arrays"; on CUDA, members with dropout draw their own random
        streams, see
        :mod:`~sweepmaster.runtime.training.fused_spill`), with its own events, metrics, pruning
        and checkpoint. Its future resolves as soon as it leaves the array, independently of the
        others, which go on with unchanged state:

        * finished or pruned by its callback: its :class:`~sweepmaster.workload.spec.\
TrainResult` (``pruned`` set; ``peak_device_bytes`` is the array's peak so far);
        * failed: its exception (``FloatingPointError`` for a non-finite loss, or what its
          callbacks or its checkpoint raised).

        Members that fit here (they do not spill alone, and K of them fit the device by
        :func:`~sweepmaster.runtime.execution.fused_jobs.check_fused_fits`) train as one stacked
        shard holding the whole array (S = 1): one task per step, which the policy interleaves
        with other jobs' tasks, the shard kept resident between them (promoted once while the
        residency cache keeps it; on the host CPU nothing is copied). Members that spill here
        train as a spilled fused array: the K members' stacked shards are promoted and demoted
        task by task, their activations planned by :meth:`memory_plan` for K. Both are
        planned for :meth:`fused_spec` (a clipping member if any, LoRA adapters padded to the
        largest rank of the members and of the member :meth:`fusion_choice` sized their group
        for, so that joiners as wide as that fit).

        A failure of the whole array (``torch.OutOfMemoryError``, say) fails the members still
        in it; :meth:`cancel` with the array's name cancels it. To stop one member, raise from
        its callbacks (it leaves the array) or prune it. One spec is submitted as a plain job.

        Refill: an array keeps its K slots busy when members leave. ``on_vacancy`` is called on
        the worker running the array's task at each step boundary where slots are free, with
        the array's name, the free slots and the array's steps; trials it hands to
        :meth:`join_fused` (at most that many) join the array right after it returns, each
        trained exactly as alone, up to the K its stacked plan was made for and no wider than
        the member it was planned for (see :meth:`join_fused`).

        Example:
            >>> futures = executor.submit_fused([spec_a, spec_b])  # doctest: +SKIP
            >>> [f.result().objective for f in futures]  # doctest: +SKIP
            [5.91, 6.02]

        Args:
            specs: The members, K >= 1, sharing one
                :func:`~sweepmaster.workload.architecture.fusion_group_key` (architecture key
                and optimizer kind).
            callbacks: One progress receiver (or ``None``) per member (called on the worker
                thread).
            name: The array's job name (made unique among running jobs; labels its task
                records); default the members' names joined by ``+``.
            on_vacancy: Called when members have left the array (see Refill above).

        Returns:
            One future per member, in the order of ``specs``.

        Raises:
            RuntimeError: The executor is closed.
            TypeError: ``specs`` is one spec, or holds something that is not a
                :class:`~sweepmaster.workload.spec.TrainSpec`.
            ValueError: No specs; a callback list of another length; members that cannot fuse
                (different architecture keys or optimizer kinds, a model without an
                architecture key: the message names the member and what differs); or K
                members that would not fit the device budget, each estimated as the widest of
                them and of the member :meth:`fusion_choice` sized their group for (see there
                for how many fit).
            LayerTooLargeError: A member must spill but one of its layers alone does not fit
                (:class:`~sweepmaster.runtime.training.fused_shards.StackedLayerTooLargeError`: one
                layer of K stacked members does not fit).
        """
        self._check_open()
        if isinstance(specs, TrainSpec):
            raise TypeError("submit_fused takes a sequence of TrainSpecs (the members), got one "
                            "TrainSpec; use submit for a single job")
        specs = list(specs)
        for index, spec in enumerate(specs):
            _check_spec(f"specs[{index}]", spec)
        members = list(callbacks) if callbacks is not None else [None] * len(specs)
        if not specs or len(members) != len(specs):
            raise ValueError(f"submit_fused needs specs and one callback per spec, got "
                             f"{len(specs)} specs and {len(members)} callbacks")
        if len(specs) > 1:
            check_fusable(specs)
        if len(specs) == 1:
            return [self.submit(specs[0], members[0])]
        planned = self.fused_spec(specs)
        spills = self._settings.spills(self.plan(stacked_spec(specs)))
        if not spills:  # K members that must fit the device together
            check_fused_fits(specs, self.plan(planned), self.planning_device,
                            self._fusion.known(planned, self.planning_device, len(specs)))
        plan = self.stacked_plan(planned, len(specs), whole=not spills)
        job_id = self._claim_name(name or fused_name(specs))
        futures: list[concurrent.futures.Future[TrainResult]] = [
            _running_future() for _ in specs
        ]
        try:
            job = SpilledFusedRun(
                job_id, specs, plan, members, self._record_task, futures=futures,
                on_vacancy=on_vacancy, planned=planned,
                memory_plan=self.memory_plan(planned, len(specs)) if spills else None,
                pipeline_devices=self._settings.pipeline_devices)
        except BaseException:
            with self._state.condition:
                self._state.names_in_use.discard(job_id)
            raise
        self._add(job, futures)
        return futures

    def join_fused(
        self, job_id: str, spec: TrainSpec, callbacks: TrainCallbacks | None = None
    ) -> concurrent.futures.Future[TrainResult] | None:
        """Refill: offer a trial to a running fused array; it joins at the next free slot.

        Call it from the array's ``on_vacancy`` hook (:meth:`submit_fused`) with at most as
        many trials as slots are free: they join at once. The trial trains in the array as it
        would alone (:meth:`~sweepmaster.runtime.training.fused_members.StackedMembers.join`) with
        its own events, pruning and checkpoint, and its future resolves when it leaves, like a
        founding member's.

        The array's stacked plan holds the K it was made for
        (:meth:`~sweepmaster.runtime.execution.fused_jobs.SpilledFusedRun.admits`): a trial past
        that K, or wider than the member it was planned for (:meth:`fused_spec`: a larger LoRA
        rank, or a first adapter dropout, say), is refused before anything changes, and the
        array goes on exactly as before. It can train in another array, or alone.

        Args:
            job_id: The array's name (what :meth:`submit_fused` named it).
            spec: The trial, of the array's
                :func:`~sweepmaster.workload.architecture.fusion_group_key`.
            callbacks: Its progress receiver (called on the worker thread).

        Returns:
            Its future, or ``None`` when the array does not take it: the array has ended (or is
            ending, with no member left), it is not a fused array, there is no such job, or the
            array grown by the trial would not fit its stacked plan.

        Raises:
            ValueError: ``spec`` cannot fuse with the array's members.
        """
        with self._state.condition:
            job = self._state.jobs.get(job_id)
        if not isinstance(job, SpilledFusedRun):
            return None
        if fusion_group_key(spec) != fusion_group_key(job.spec):
            raise ValueError(f"trial {spec.name!r} cannot join fused array {job_id!r}: "
                             "another architecture key or optimizer kind")
        future: concurrent.futures.Future[TrainResult] = _running_future()
        with self._state.condition:
            if self._state.jobs.get(job_id) is not job:
                return None
            if not job.offer(spec, callbacks, future, job.admits):
                return None
            self._state.futures[job_id].append(future)
        return future

    def _measure(self, spec: TrainSpec, ks: list[int],
                 budget_bytes: int | None) -> list[FusionMeasurement]:
        """Measure fusion degrees as a job (its device to itself) and wait for it."""
        key = fd.fusion_cache_key(spec) or spec.name
        job = MeasureJob(self._claim_name(f"measure-fusion-{key[:16]}"), spec, self.plan(spec),
                         self._record_task, ks=ks, budget_bytes=budget_bytes,
                         microbatch_size=self._settings.microbatch_size)
        future: concurrent.futures.Future[list[FusionMeasurement]] = _running_future()
        self._add(job, [future])
        return future.result()

    def cancel(self, job_id: str) -> bool:
        """Stop a job: it gets no further task; a task of it that runs now finishes first.

        Its future then fails with :class:`JobCancelledError`.

        Returns:
            Whether the job was still running or waiting.
        """
        with self._state.condition:
            if job_id not in self._state.jobs:
                return False
            self._state.policy.remove_job(job_id)
            running = {t.job_id for d in range(len(self._settings.devices))
                       if (t := self._state.policy.running(d)) is not None}
            if job_id in running:
                self._state.cancelled.add(job_id)  # its worker ends it after the task
            else:
                self._state.end(job_id, error=JobCancelledError(f"job {job_id!r} was cancelled"))
            self._state.condition.notify_all()
        self._state.hand_on_ended()
        return True

    def close(self, *, wait: bool = True, cancel: bool = False) -> None:
        """Refuse new jobs; by default let the submitted ones finish, then stop the workers.

        Args:
            wait: Block until the workers have stopped, then restore torch's intra-op thread
                count if the workers split it (see the class doc).
            cancel: Cancel every job first (running tasks finish; futures fail with
                :class:`JobCancelledError`).
        """
        if cancel:
            for job_id in list(self._state.jobs):
                self.cancel(job_id)
        with self._state.condition:
            self._state.closed = True
            self._state.condition.notify_all()
        if wait:
            self._threads.join()

    def __enter__(self) -> ShardExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(cancel=exc_type is not None)

    # ------------------------------------------------------------------ jobs

    def _claim_name(self, name: str) -> str:
        """``name``, or ``name#N`` if a job holds it; held until the job ends."""
        with self._state.condition:
            job_id = name
            while job_id in self._state.names_in_use:
                self._num_renamed += 1
                job_id = f"{name}#{self._num_renamed}"
            self._state.names_in_use.add(job_id)
        return job_id

    def _check_open(self) -> None:
        """Refuse a new job once :meth:`close` was called, before anything is planned."""
        if self._state.closed:
            raise RuntimeError(_CLOSED)

    def _add(self, job: ExecutorJob, futures: Sequence[concurrent.futures.Future[Any]]) -> None:
        """Hand a job and its futures to the policy (its name is claimed already)."""
        with self._state.condition:
            if self._state.closed:
                self._state.names_in_use.discard(job.job_id)
                raise RuntimeError(_CLOSED)
            self._state.jobs[job.job_id] = job
            self._state.futures[job.job_id] = list(futures)
            self._state.policy.add_job(job.chain())
            self._threads.start()
            self._state.condition.notify_all()

    def _make_job(self, spec: TrainSpec, callbacks: TrainCallbacks | None) -> ExecutorJob:
        """A job of ``spec``: shard tasks over the plan the ``spill`` setting gives it.

        A job that spills trains on :meth:`plan` (and :meth:`memory_plan`); any other on one
        shard holding the whole model (S = 1), which :meth:`plan` is already when the job fits.
        """
        job_id = self._claim_name(spec.name)
        try:
            plan = self.plan(spec)
            spills = self._settings.spills(plan)
            if not spills and len(plan.shards) > 1:  # ``spill="never"`` or the host CPU
                plan = plan_job(spec, self.planning_device, whole=True,
                                microbatch_size=self._settings.microbatch_size)
            return SpilledRun(job_id, spec, plan, callbacks, self._record_task,
                              memory_plan=self.memory_plan(spec) if spills else None,
                              pipeline_devices=self._settings.pipeline_devices)
        except BaseException:
            with self._state.condition:
                self._state.names_in_use.discard(job_id)
            raise

    def _record_task(self, record: TaskRecord) -> None:
        for listener in self._task_listeners:
            listener(record)

    def _device_bytes(self) -> list[int]:
        """Each device's budget (bytes): what its tasks and the shards kept there share."""
        return [device.budget_bytes for device in self._settings.devices]


def _running_future() -> concurrent.futures.Future[Any]:
    """A future in the running state (it cannot be cancelled; :meth:`ShardExecutor.cancel` can)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


def _check_spec(name: str, spec: Any) -> None:
    """Refuse what is not a :class:`TrainSpec` (its fields are checked when it is made)."""
    if not isinstance(spec, TrainSpec):
        raise TypeError(f"{name} must be a TrainSpec, got {type(spec).__name__}")
