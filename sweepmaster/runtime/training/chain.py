"""The chain of shard tasks every spilled job runs, for one member or a fused array of K.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device as a chain of **shard tasks** (:mod:`~sweepmaster.runtime.training.tasks`).
:class:`ShardChain` is what every such job shares, whatever it trains: one member
(:class:`~sweepmaster.runtime.training.spill.SpilledJob`, the module run directly) or K stacked
members (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`, stacked members).
It runs a task (:meth:`ShardChain.run`: promote, compute, keep or demote, then the bookkeeping
the task ends). The job holds its parts (:mod:`~sweepmaster.runtime.training.job_parts`: host
boundaries, planned passes, task sequence, shard store); what is not a part yet is two base
classes, one concern each:

* :class:`~sweepmaster.runtime.training.compute.ShardCompute`: the per-shard training algorithm
  (forward, backward and evaluation microbatch loops, tied gradients, the just-in-time update,
  ``grad_clip``) and the per-shard interface a pipeline drives;
* :class:`~sweepmaster.runtime.training.bookkeeping.TrialBookkeeping`: a trial's bookkeeping
  over the job's :class:`~sweepmaster.runtime.training.member_runs.MemberRun` records (events,
  evaluations, checkpoints, results).

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from typing import Any

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.training.bookkeeping import TrialBookkeeping
from sweepmaster.runtime.training.tasks import ShardTask

__all__ = ["ShardChain"]


class ShardChain(TrialBookkeeping):
    """What every spilled job shares: its task chain, prefetch, residency, per-shard algorithm.

    Not thread-safe: one task at a time (any thread). Subclasses call ``super().__init__``
    (which builds the parts), then build their state; they provide the hooks the parts and the
    base classes read and what a task runs in (:meth:`_task_mode`, :meth:`_compute_mode`).

    Args:
        plan: The job plan (shards, microbatch sizes, seconds, peaks); its device's type
            (``cpu`` or ``cuda``) is where the tasks run.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation.

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).
    """

    def run(self, task: ShardTask, device: Device, *, keep: bool = False) -> None:
        """Run the next task on ``device``: promote, compute (and update), demote.

        With ``keep``, a shard whose next task is of the same shard stays resident on
        ``device`` instead of being demoted, until :meth:`evict` (the executor passes it always:
        its residency cache evicts the shard when another task needs the room): that task then
        promotes nothing, and what changed is written back only when the shard is evicted (its
        next task runs on another device, another job runs here, a checkpoint, a member
        leaving, the result). Pass it only when the job's next task will likely run on
        ``device`` and the shard fits beside what else is there (its next task's planned peak
        counts it anyway).

        After an exception the job holds no device memory (its state is back on the host) but
        cannot go on: the task that failed was partly done (a fused array: every member fails).

        Raises:
            ValueError: ``task`` is not the next task.
            torch.OutOfMemoryError: The device ran out of memory.
            FloatingPointError: The train loss of a step is not finite (one member's: a fused
                array's member fails alone, nothing is raised).
        """
        if task != self.next_task():
            raise ValueError(f"job {self.name!r}: task {task} is not the next task")
        self.tasks.pop()
        if not self._started:
            self.start(device, task)
            if self.stopped:  # every member of a fused array had finished already
                return
        if task.step == self.step and self.tasks.step_due(task):
            self.start_step(device)
        meter = device.meter
        if meter is not None:
            meter.reset_peak()
        swap_start = self.boundaries.swap_bytes
        try:
            with self._task_mode(device):
                try:
                    self.store.promote(task, device)
                    with self._compute_mode(device):
                        if task.shard in self._pending:  # an ``update`` task does only this
                            self._apply_pending(task.shard, self.task_tensors(), device)
                        if task.phase == "eval":
                            self._eval_shard(task.shard, device)
                        elif task.phase == "train" and task.kind == "forward":
                            self._forward_shard(task.shard, device)
                        elif task.phase == "train":
                            self._backward_shard(task.shard, device)
                except BaseException:
                    self.store.demote(task.shard, device)
                    raise
                following = self.peek_task(0)
                if keep and following is not None and following.shard == task.shard:
                    if following.kind != "backward" or not self.store.state_stays(task.shard):
                        self.demote_state(task.shard, device)  # home before the next task
                    self.store.keep(task.shard, device)
                else:
                    self.store.demote(task.shard, device)
        except BaseException:
            self.release()
            raise
        if meter is not None:
            self.peak_device_bytes = max(self.peak_device_bytes, meter.peak_bytes)
        if task.phase == "train":
            self._task_swap += self.boundaries.swap_bytes - swap_start
            if task.kind == "backward" and task.shard == 0:
                self._finish_step(device)
        if task.phase == "eval" and task.shard == len(self.plan.shards) - 1:
            self.finish_eval()
        self.end_tasks(task, device)

    @abstractmethod
    def _task_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """What a task runs in, from its promote to its demote (a job's dropout stream)."""

    @abstractmethod
    def _compute_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """What a task's compute runs in, between its promote and demote (metering)."""

    def settle(self, device: Device) -> None:  # noqa: B027
        """Hand on what has nothing left to train once :meth:`next_task` is ``None``."""

    def run_to_end(self, device: Device, *, prefetch: bool = True) -> None:
        """Run every task in order on ``device``, the job alone there, then :meth:`settle`.

        Args:
            device: Where the tasks run.
            prefetch: Double-buffer: promote the next shard while the current one computes.

        Raises:
            torch.OutOfMemoryError: A task did not fit the device.
            FloatingPointError: See :meth:`run`.
        """
        while (task := self.next_task()) is not None:
            if prefetch:
                self.prefetch(self.peek_task(), device)
            self.run(task, device)
        self.settle(device)

    def run_step(self, device: Device, *, keep: bool = False) -> None:
        """Run the tasks of the job's next optimizer step on ``device``, in order.

        The tasks before the step's last (``backward`` of shard 0) and that task: a step's
        forward and backward tasks, after whatever the sequence has before them (an
        evaluation). With ``keep``, a shard whose next task is of the same shard stays resident
        as the executor keeps it (:meth:`run`; one stacked or whole shard, S = 1, stays on
        ``device`` between steps until :meth:`evict` or :meth:`release`). Nothing is prefetched:
        the fusion measurement (:func:`~sweepmaster.runtime.planning.fusion_degree.\
measure_fusion`) times these steps of jobs that fit their device.

        Raises:
            ValueError: The job has no step left (or it stopped).
            torch.OutOfMemoryError: A task did not fit the device.
            FloatingPointError: See :meth:`run`.
        """
        while (task := self.next_task()) is not None:
            self.run(task, device, keep=keep)
            if task.phase == "train" and task.kind == "backward" and task.shard == 0:
                return
        raise ValueError(f"job {self.name!r} has no step left")
