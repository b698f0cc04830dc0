"""Device workers: one thread per device runs the shard tasks the policy gives it.

Each worker (:meth:`DeviceWorkers.work`) asks the scheduling policy (Hydra's SHARP: Nagrecha &
Kumar 2022, https://arxiv.org/abs/2110.08633) for its device's next shard task whenever the
device is free, makes room for it in the residency cache, runs it with the prefetch the policy's
lookahead names, reports it done and keeps or evicts its shard; a pipelined step (Harmony PP)
runs on the worker that asked. What the workers share with the executor's API is one
:class:`~sweepmaster.runtime.execution.state.ExecutorState`. What they guarantee (a fault fails
one job, double buffering, residency, re-planning after running out of memory) is listed in the
executor's module doc (:mod:`~sweepmaster.runtime.executor`). The threads themselves,
and the split of torch's intra-op threads among CPU devices while they run, are
:class:`WorkerThreads`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.execution.jobs import ExecutorJob, SpilledRun
from sweepmaster.runtime.execution.replan import Replanner
from sweepmaster.runtime.execution.state import ExecutorState, JobCancelledError, _released
from sweepmaster.runtime.scheduling.chains import TaskSpec
from sweepmaster.runtime.scheduling.pipeline import PipelineDecision
from sweepmaster.runtime.scheduling.residency import PEAK_MARGIN
from sweepmaster.workload.spec import TrainResult

__all__ = ["DeviceWorkers", "WorkerThreads"]


@dataclasses.dataclass(frozen=True)
class DeviceWorkers:
    """The loop each device's worker thread runs (:meth:`work`), over the executor's state.

    Args:
        state: What the executor and its workers share (guarded by its condition).
        replanner: How a job that ran out of memory in its first step is re-planned.
        prefetch: Promote the lookahead's next shard while a task runs (double buffering).
    """

    state: ExecutorState
    replanner: Replanner
    prefetch: bool

    def work(self, index: int) -> None:
        """One device's worker: run the tasks the policy gives it until the executor closes.

        A pipelined step the policy decides (:meth:`_run_pipelined`) runs on the worker that
        asked; the workers of its devices wait until it is done.

        No exception of a job ends the loop: a fault in any stage (discarding or making a
        prefetch, promote, compute, update, evaluation, a callback, out of memory) fails the
        job it belongs to, and the device goes on with the next task.
        """
        device = self.state.devices[index]
        while True:
            with self.state.condition:
                while True:
                    decision, task = None, None
                    if self.state.policy.pipelined(index) is None:
                        decision = self.state.policy.next_pipeline()
                        if decision is not None or (
                                task := self.state.policy.next_task(index)) is not None:
                            break
                    if self.state.closed and not self.state.jobs:
                        return
                    self.state.condition.wait()
                if task is not None:
                    job = self.state.jobs[task.job_id]
                    ahead = self.state.policy.lookahead(index) if self.prefetch else None
                    stale, self.state.prefetched_on[index] = self.state.prefetched_on[index], None
            if decision is not None:
                self._run_pipelined(decision)
                self.state.hand_on_ended()
                continue
            assert task is not None
            if stale is not None and stale is not job:
                # What it holds here must leave before this task, which plans the device as its
                # own; so wait for its lock. Its lock held elsewhere (its task on another
                # device, a prefetch there) would otherwise leave its copies here uncounted,
                # and nothing else frees them until it runs again.
                try:
                    with stale.lock:
                        stale.discard_prefetch(device)
                except BaseException as exc:  # the stale job fails, not this one
                    self.state.fail(stale, exc)
            self._make_room(index, job, task)
            error, result, measured_s, ended = self._run_task(index, device, job, task, ahead)
            restart = None
            if error is not None:  # planned here, not under the condition
                restart, error = self.replanner.replanned(job, error, device)
            with self.state.condition:
                last = self.state.policy.task_done(task, measured_s)
                key = (job.job_id, task.shard)
                if not ended and error is None and job.resident_shard(device) == task.shard:
                    self.state.residency.keep(index, key, job.resident_bytes(device))
                else:
                    self.state.residency.discard(index, key)
                    if not last:
                        self.state.policy.evicted(index, job.job_id, task.shard)
                cancelled = job.job_id in self.state.cancelled
                failed = self.state.failed.get(job.job_id)
                if error is None and failed is not None:
                    error, result = failed, None
                if ended or error is not None or cancelled:
                    if not last:
                        self.state.policy.remove_job(job.job_id)
                    if error is None and cancelled and result is None:
                        error = JobCancelledError(f"job {job.job_id!r} was cancelled")
                    if restart is not None and not cancelled and failed is None:
                        # the failed attempt's error and what its frames built (a fused array
                        # and its vmapped closures, say) can hold device memory in reference
                        # cycles: collect them before the new attempt allocates
                        error = None
                        gc.collect()
                        self._restart(job, restart, device)
                    else:
                        self.state.end(job.job_id, result=result, error=error)
                self.state.condition.notify_all()
            self.state.hand_on_ended()

    def _make_room(self, index: int, job: ExecutorJob, task: TaskSpec | None) -> None:
        """Evict what other jobs keep on device ``index`` until ``task`` fits beside the rest.

        The residency cache's rule
        (:meth:`~sweepmaster.runtime.scheduling.residency.Residency.make_room`) on the task's
        planned peak as the policies and the simulator see it (:meth:`~sweepmaster.runtime.\
scheduling.residency.Residency.task_peak_bytes`: the chain's, with the optimizer state kept
        beside it when this device holds its shard), so they keep and evict the same shards; a
        task of unknown peak (a fusion measurement, a pipelined step: ``None``) takes the device.
        Each evicted shard is written back by its job, under its lock; a fault there fails that
        job, not this one.
        """
        device = self.state.devices[index]
        with self.state.condition:
            peak = None if task is None else self.state.residency.task_peak_bytes(index, task)
            key = (job.job_id, 0 if task is None else task.shard)
            victims = self.state.residency.make_room(index, key, peak)
            for job_id, shard in victims:
                self.state.policy.evicted(index, job_id, shard)
            others = [self.state.jobs.get(job_id) for job_id, _ in victims]
        for other in others:
            if other is None or other is job:
                continue
            try:
                with other.lock:
                    other.evict(device)
            except BaseException as exc:  # that job fails, not this one
                self.state.fail(other, exc)

    def _run_pipelined(self, decision: PipelineDecision) -> None:
        """Run a pipelined step the policy decided (on the calling worker, the packs on theirs).

        Other jobs' shards prefetched or kept on the step's devices are freed first; a fault
        fails the job alone.
        """
        with self.state.condition:
            job = self.state.jobs[decision.job_id]
            assert isinstance(job, SpilledRun), "only spilled jobs have a pipeline shape"
            stale = [(d, self.state.prefetched_on[d]) for d in decision.devices]
            for d in decision.devices:
                self.state.prefetched_on[d] = None
        devices = [self.state.devices[d] for d in decision.devices]
        for index, other in stale:
            if other is not None and other is not job:
                try:
                    with other.lock:
                        other.discard_prefetch(self.state.devices[index])
                except BaseException as exc:
                    self.state.fail(other, exc)
        for index in decision.devices:
            self._make_room(index, job, None)
        error: BaseException | None = None
        result: Any = None
        with job.lock:
            try:
                job.run_pipelined(decision, devices)
                if job.done:
                    result = job.result()
            except BaseException as exc:  # the job fails alone
                error = _released(exc)
        with self.state.condition:
            last = self.state.policy.pipeline_done(decision)
            for device in job.pipeline_devices:  # its packs stay: freed before another job runs
                self.state.prefetched_on[self.state.devices.index(device)] = job
            failed = self.state.failed.get(job.job_id)
            if error is None and failed is not None:
                error, result = failed, None
            cancelled = job.job_id in self.state.cancelled
            if last or job.done or error is not None or cancelled:
                if not last:
                    self.state.policy.remove_job(job.job_id)
                if error is None and cancelled and result is None:
                    error = JobCancelledError(f"job {job.job_id!r} was cancelled")
                self.state.end(job.job_id, result=result, error=error)
            self.state.condition.notify_all()

    def _run_task(
        self, index: int, device: Device, job: ExecutorJob, task: TaskSpec, ahead: TaskSpec | None
    ) -> tuple[BaseException | None, Any, float, bool]:
        """Run ``task`` of ``job`` on ``device``, with the prefetch the lookahead ``ahead`` names.

        Returns:
            The job's error (or None), its result if the task ended it, the task's measured
            seconds and whether the job ended.
        """
        error: BaseException | None = None
        result: Any = None
        measured_s = 0.0
        with job.lock:
            with self.state.condition:
                failed = job.job_id in self.state.failed
            if failed:  # a fault elsewhere failed it while it waited for this device
                return None, None, 0.0, True
            start = time.perf_counter()
            if device.meter is not None:
                device.meter.shortfall_bytes = 0  # what this task's own refusal lacked, if any
            try:
                peak = job.peak_bytes(task)
                with self.state.condition:
                    kept = self.state.residency.kept_bytes(index, exclude=(job.job_id, task.shard))
                # what other jobs keep here leaves less for a prefetch of the job's own shards
                room = device.budget_bytes - kept - int(peak * (1 + PEAK_MARGIN))
                fits = kept == 0 or (ahead is not None and ahead.promote_bytes <= room)
                same_job = ahead is not None and ahead.job_id == job.job_id and fits
                other = False
                if ahead is not None and ahead.job_id != job.job_id:
                    other = self._prefetch_other(index, ahead.job_id, device, peak, kept)
                elif same_job:
                    with self.state.condition:
                        self.state.prefetched_on[index] = job  # its next shard is promoted here
                job.run(task, device, prefetch=not other and fits, prefetch_next=same_job)
            except BaseException as exc:  # the job fails alone (a callback's Ctrl-C too)
                error = _released(exc)
            measured_s = time.perf_counter() - start
            try:
                grown = None if error is not None or job.done else job.grown_chain()
                if grown is not None:  # a member joined: the policy schedules its steps too
                    with self.state.condition:
                        self.state.policy.extend_job(grown)
                    job.num_tasks = grown.num_tasks
                ended = error is not None or job.done or task.index == job.num_tasks - 1
                if error is None and ended:
                    result = job.result()  # may save its checkpoint; None: a fused array
                    if isinstance(result, TrainResult) and job.num_replans:
                        result = dataclasses.replace(result, num_replans=job.num_replans)
            except BaseException as exc:
                error, ended = _released(exc), True
        return error, result, measured_s, ended

    def _restart(self, job: ExecutorJob, replanned: ExecutorJob, device: Device) -> None:
        """Put ``replanned`` in ``job``'s place: its name, its futures (condition held).

        What ``job`` still holds on any device is freed first (and the CUDA allocator's cache
        of ``device`` emptied, so the new plan finds the memory the failed attempt held).
        """
        for index, prefetched in enumerate(self.state.prefetched_on):
            if prefetched is job:
                self.state.prefetched_on[index] = None
        self.state.residency.drop_job(job.job_id)
        with job.lock, contextlib.suppress(Exception):  # it never runs again
            job.release()
        if device.torch_device.type == "cuda":
            with torch.cuda.device(device.torch_device):
                torch.cuda.empty_cache()
        self.state.jobs[job.job_id] = replanned
        self.state.policy.add_job(replanned.chain())

    def _prefetch_other(self, index: int, job_id: str, device: Device, running_peak: int,
                        kept_bytes: int) -> bool:
        """Promote the lookahead job's next shard beside the task about to run (if it fits).

        ``running_peak`` is the running task's planned peak (bytes), from the plan its job runs
        (:meth:`~sweepmaster.runtime.execution.jobs.ExecutorJob.peak_bytes`); ``kept_bytes``
        what other jobs keep on the device (the residency cache). A fault while prefetching
        fails the other job, not the running one.

        Returns:
            Whether the other job was asked to prefetch (then the running job must not).
        """
        with self.state.condition:
            other = self.state.jobs.get(job_id)
        if other is None:
            return False
        headroom = device.budget_bytes - kept_bytes - int(running_peak * (1 + PEAK_MARGIN))
        if headroom <= 0:
            return False
        try:
            if not _try_locked(other, functools.partial(other.prefetch, device, headroom)):
                return False
        except BaseException as exc:
            self.state.fail(other, exc)
            return False
        with self.state.condition:
            self.state.prefetched_on[index] = other
        return True


class WorkerThreads:
    """The device workers' threads: one per device, each running :meth:`DeviceWorkers.work`.

    With several devices on the CPU (virtual devices ``cpu:Kx...``), torch's intra-op threads are
    split between them while the threads run (``torch.set_num_threads(cores // K)``, at least 1),
    so K workers compute at once instead of competing for every core. The setting is
    process-wide: :meth:`join` restores the thread count :meth:`start` found.

    Not thread-safe by itself: the executor calls :meth:`start` under its state's condition.

    Args:
        workers: The loop the threads run, over the executor's state (its devices, in order).
    """

    def __init__(self, workers: DeviceWorkers) -> None:
        #: The loop each thread runs.
        self.workers = workers
        self._threads: list[threading.Thread] = []
        self._num_threads_before: int | None = None  # torch's, while the workers split the cores

    def start(self) -> None:
        """Start one daemon thread per device (named ``sweepmaster-<device>``), once."""
        if self._threads:
            return
        devices = self.workers.state.devices
        cpu_devices = [d for d in devices if d.torch_device.type == "cpu"]
        if len(cpu_devices) > 1:  # process-wide: restored by join()
            self._num_threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(cpu_devices)))
        for index, device in enumerate(devices):
            thread = threading.Thread(target=self.workers.work, args=(index,), daemon=True,
                                      name=f"sweepmaster-{device.name}")
            self._threads.append(thread)
            thread.start()

    def join(self) -> None:
        """Wait for every thread but the calling one, then restore torch's thread count.

        The threads return once the executor's state is closed and its jobs have ended.
        """
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        if self._num_threads_before is not None:
            torch.set_num_threads(self._num_threads_before)
            self._num_threads_before = None


def _try_locked(job: ExecutorJob, action: Callable[[], None]) -> bool:
    """Run ``action()`` under the job's lock if it is free (the job is not running)."""
    if not job.lock.acquire(blocking=False):
        return False
    try:
        action()
    finally:
        job.lock.release()
    return True
