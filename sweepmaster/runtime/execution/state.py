"""What an executor and its device workers share: jobs, their futures, the policy, one condition.

:class:`ExecutorState` is the one object the executor's API
(:class:`~sweepmaster.runtime.executor.ShardExecutor`) and its device workers
(:class:`~sweepmaster.runtime.execution.device_workers.DeviceWorkers`) both change, always under
its :attr:`~ExecutorState.condition`: the jobs and their futures, the scheduling policy, the
residency cache, what each device holds prefetched, and the jobs that ended or failed. It ends
jobs (:meth:`~ExecutorState.end`) and fails them for faults outside their own tasks
(:meth:`~ExecutorState.fail`), so a fault fails one job and the devices go on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.execution.jobs import ExecutorJob
from sweepmaster.runtime.scheduling.residency import Residency
from sweepmaster.runtime.scheduling.scheduler import Policy

__all__ = ["ExecutorState", "JobCancelledError"]

_log = logging.getLogger(__name__)


class JobCancelledError(RuntimeError):
    """The job was cancelled (``ShardExecutor.cancel``, ``ShardExecutor.close``) before its end."""


@dataclasses.dataclass(eq=False)
class ExecutorState:
    """The jobs an executor runs and what its device workers share about them, under one lock.

    Every field but :attr:`devices` changes under :attr:`condition` (held by the caller, unless a
    method says otherwise); the workers wait on it for their next task, so whoever changes what
    they wait for notifies it.

    Args:
        devices: The executor's devices, in order (device ``index`` is ``devices[index]``).
        policy: The scheduling policy for these devices.
        residency: What each device keeps between tasks (the policies' rule, same budgets).
    """

    devices: Sequence[Device]
    policy: Policy
    residency: Residency
    condition: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    #: No new jobs; the workers stop once every job has ended.
    closed: bool = False
    #: The jobs running or waiting by name, and the futures each settles.
    jobs: dict[str, ExecutorJob] = dataclasses.field(default_factory=dict)
    futures: dict[str, list[concurrent.futures.Future[Any]]] = dataclasses.field(
        default_factory=dict)
    #: Jobs cancelled while a task of theirs ran: their worker ends them after it.
    cancelled: set[str] = dataclasses.field(default_factory=set)
    #: Jobs failed outside their own task, with their errors.
    failed: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    #: Jobs ended, to hear it with no lock held (:meth:`hand_on_ended`).
    ended_jobs: list[ExecutorJob] = dataclasses.field(default_factory=list)
    #: Per device, the job whose copies (a prefetch, or packs of a pipelined step) it holds.
    prefetched_on: list[ExecutorJob | None] = dataclasses.field(init=False)
    #: Names of the jobs running or waiting (a new job of a name in use is renamed).
    names_in_use: set[str] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.prefetched_on = [None] * len(self.devices)

    def end(self, job_id: str, *, result: Any = None,
             error: BaseException | None = None) -> None:
        """Forget a job and settle its futures still pending (called with the condition held).

        A fused array's members settle their own futures as they leave it; whatever is pending
        when the job ends gets ``error`` (or ``result``). Whatever the job still holds on any
        device is freed; a failure to free it cannot fail the job any more and is dropped.
        """
        self.names_in_use.discard(job_id)
        self.cancelled.discard(job_id)
        self.failed.pop(job_id, None)
        futures = self.futures.pop(job_id)
        job = self.jobs.pop(job_id)
        self.residency.drop_job(job_id)
        for index, prefetched in enumerate(self.prefetched_on):
            if prefetched is job:
                self.prefetched_on[index] = None
        with job.lock, contextlib.suppress(Exception):  # it never runs again
            job.release()
        self.ended_jobs.append(job)
        pending = [future for future in futures if not future.done()]
        if pending and error is None and result is None:
            error = JobCancelledError(f"job {job_id!r} ended without a result")
        for future in pending:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    def fail(self, job: ExecutorJob, error: BaseException) -> None:
        """Fail ``job`` for a fault outside its own task (e.g. while prefetching it elsewhere).

        A job whose task runs on a device now is ended by that device's worker after the task;
        any other is ended at once. Called without the job's lock.
        """
        error = _released(error)
        with self.condition:
            if self.jobs.get(job.job_id) is not job:
                return  # it ended already
            self.failed.setdefault(job.job_id, error)
            running = {t.job_id for d in range(len(self.devices))
                       if (t := self.policy.running(d)) is not None}
            if job.job_id not in running:
                self.policy.remove_job(job.job_id)
                self.end(job.job_id, error=error)
            self.condition.notify_all()
        self.hand_on_ended()

    def hand_on_ended(self) -> None:
        """Tell the jobs that ended that they have (:meth:`ExecutorJob.ended`), no lock held."""
        with self.condition:
            ended, self.ended_jobs = self.ended_jobs, []
        for job in ended:
            try:
                job.ended()
            except BaseException:  # it has ended anyway (a vacancy hook's Ctrl-C): the worker
                _log.exception("job %s failed to hear that it ended", job.job_id)  # goes on


def _released(error: BaseException) -> BaseException:
    """Clear the local variables of the error's frames (and of its causes), keeping the traceback.

    A failed task's frames hold its device tensors; the job's future keeps the error, so without
    this the failed job would keep counting against its device's budget.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    return error
