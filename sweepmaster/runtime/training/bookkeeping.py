"""A spilled job's trial bookkeeping, once for K = 1 and K > 1, over its members' records.

Every spilled job keeps one :class:`~sweepmaster.runtime.training.member_runs.MemberRun` per member
(its members part's ``runs``): :class:`TrialBookkeeping`, the part a trainer holds as
``bookkeeping``, records, at the task boundaries the trainer reaches, the start event, each
step's records and ``on_step``, each evaluation's records, ``on_eval`` and pruning, the
checkpoints due at a step boundary, the training seconds and a member's result. A member's
failure (a callback raising, a non-finite loss, a checkpoint that cannot be written) fails it
alone in a fused array and fails a single job (the members' ``fail_alone``).
"""

from __future__ import annotations

import time
from dataclasses import replace

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.training.boundaries import HostBoundaries
from sweepmaster.runtime.training.compute import ShardCompute
from sweepmaster.runtime.training.member_runs import MemberRun
from sweepmaster.runtime.training.shard_members import ShardMembers
from sweepmaster.runtime.training.shard_store import ShardStore
from sweepmaster.runtime.training.tasks import ShardTask, TaskChain
from sweepmaster.runtime.training.training_state import save_checkpoint
from sweepmaster.workload.spec import TrainResult

__all__ = ["TrialBookkeeping"]


class TrialBookkeeping:
    """A spilled job's members' records: start, steps, evaluations, checkpoints, results.

    The part a trainer holds as ``bookkeeping``. It reads of the members
    (:class:`~sweepmaster.runtime.training.shard_members.ShardMembers`) their records
    (``runs``, ``live``, ``step``, whether a failure fails a member alone), the step's epochs
    and learning rates, their training states (to checkpoint them) and, for a fused array,
    which members an evaluation concerns and whether members change at a step boundary; the
    members change there (:meth:`~sweepmaster.runtime.training.shard_members.ShardMembers.\
at_step_boundary`) after the checkpoints due.

    Args:
        members: The job's members.
        tasks: The job's task sequence (which task follows: a step boundary).
        store: The job's shard store (its promote counters and device names, for a result).
        boundaries: The job's host boundaries (its swap bytes, for a result).
        compute: The job's per-shard compute (the step's and evaluation's losses).

    Attributes:
        p2p_bytes: Bytes moved device -> device so far (pipelined steps' boundaries).
        peak_device_bytes: The highest metered device peak of a task so far.
        step_swap_bytes: Bytes moved by each training step's tasks.
        save_s: Seconds spent writing checkpoints so far (not training).
        saved_step: The job step whose step-boundary checkpoints were written last.
    """

    def __init__(self, members: ShardMembers, *, tasks: TaskChain, store: ShardStore,
                 boundaries: HostBoundaries, compute: ShardCompute) -> None:
        self.members = members
        self.tasks = tasks
        self.store = store
        self.boundaries = boundaries
        self.compute = compute
        self.p2p_bytes = 0
        self.peak_device_bytes = 0
        self._started = False
        self.task_swap = 0  # bytes the training tasks of the current step moved so far
        self.step_swap_bytes: list[int] = []
        self.save_s = 0.0
        self._step_start = 0.0  # perf_counter at the current step's start
        self.saved_step = 0

    @property
    def started(self) -> bool:
        """Whether the job has started (its receivers heard ``on_start``)."""
        return self._started

    def start(self, device: Device, task: ShardTask) -> None:
        """Start the job (``on_start``) before ``task``, its first, runs on ``device``.

        A fused array's members done already leave then, unless ``task`` is an evaluation.

        Raises:
            Exception: What a single job's ``on_start`` raised (a fused array's member fails
                alone).
        """
        self.start_runs(device)
        self.members.after_start(task)

    def start_runs(self, device: Device) -> None:
        """Every member starts on ``device`` (``on_start``; see :meth:`start`)."""
        self._started = True
        for run in self.members.runs:
            run.begin(device.name, self.save_s)
        self.raise_failed()

    def start_step(self) -> None:
        """A training step starts now (its seconds count from here)."""
        self._step_start = time.perf_counter()

    def finish_step(self, device: Device, swap_bytes: int) -> None:
        """Record the step whose passes ran (its loss, ``on_step``); ``swap_bytes`` it moved.

        Raises:
            FloatingPointError: The train loss is not finite (one member's: a fused array's
                member fails alone, nothing is raised).
        """
        self.task_swap += swap_bytes
        self.end_step(device)

    def end_step(self, device: Device) -> None:
        """Record the step whose last task ran on ``device``: each member's loss, ``on_step``.

        Each member's step counts it (a fused array counts its own step too).

        Raises:
            FloatingPointError: A single job's train loss is not finite (or what its
                ``on_step`` raised; a fused array's member fails alone).
        """
        members = self.members
        members.step_done()
        seconds = time.perf_counter() - self._step_start
        losses = self.compute.train_losses()
        for k, (run, loss) in enumerate(zip(members.live, losses, strict=True)):
            run.step += 1
            run.record_step(run.step, loss, members.lrs[k], members.epochs[k], seconds, device)
        self.raise_failed()
        self.step_swap_bytes.append(self.task_swap)
        self.task_swap = 0

    def finish_eval(self) -> None:
        """Record the evaluation whose passes ran (``on_eval``; a member may be pruned).

        Raises:
            Exception: What a single job's ``on_eval`` raised (a fused array's member fails
                alone).
        """
        losses = self.compute.eval_losses()
        for k, run in enumerate(self.members.live):
            if self.members.evaluated(run):
                run.record_eval(run.step, losses[k])
        self.raise_failed()

    def host_due(self, task: ShardTask) -> bool:
        """Whether ending ``task`` (a step's or evaluation's last) reads or changes host copies.

        A checkpoint is due, or a member leaves or may join: every shard must be home first.
        """
        if not self._ends_phase(task):
            return False
        members = self.members
        saves = self.saved_step != members.step and any(self._saves(run) for run in members.live)
        return saves or members.members_change()

    def end_tasks(self, task: ShardTask, device: Device) -> None:
        """Bookkeeping once ``task``, a step's or evaluation's last, ran: checkpoints, members.

        Call it with every shard home when :meth:`host_due` said so.

        Raises:
            OSError: A single job's checkpoint could not be written (a fused array's member
                fails alone).
        """
        if self._ends_phase(task):  # the step, its evaluation and updates are done
            if self.saved_step != self.members.step:  # the checkpoints due (once per step)
                self._save_due()
                self.saved_step = self.members.step
            self.members.at_step_boundary()

    def _ends_phase(self, task: ShardTask) -> bool:
        """Whether ``task`` ends a step with its evaluation and updates (a step boundary).

        There no clipped update is deferred where a member checkpoints or ends
        (:func:`after_step_phase` settles them first).
        """
        following = self.tasks.peek(0)
        return following is None or (following.phase == "train" and (
            task.phase != "train" or task.step != following.step))

    def _saves(self, run: MemberRun) -> bool:
        """Whether ``run`` writes a checkpoint at this step boundary.

        At every multiple of its ``checkpoint_every``: a clipped update never holds that
        boundary back (see :meth:`_ends_phase`).
        """
        every = run.spec.checkpoint_every
        return (every is not None and run.error is None and not run.pruned
                and run.step % every == 0)

    def _save_due(self) -> None:
        """Write the training state of every member :meth:`_saves` names.

        Raises:
            OSError: A single job's checkpoint could not be written (a fused array's member
                fails alone).
        """
        start = time.perf_counter()
        for k, run in enumerate(self.members.live):
            if not self._saves(run):
                continue
            state = self.members.member_training_state(k)
            assert run.spec.state_dir is not None
            try:
                save_checkpoint(run.spec.state_dir, state, run.key,
                                keep=run.spec.keep_checkpoints)
            except OSError as exc:  # e.g. a full disk
                run.error = exc
        self.save_s += time.perf_counter() - start
        self.raise_failed()

    def finish_run(self, index: int) -> None:
        """Member ``index`` of the members' ``live`` ends: its result, its weights saved.

        :attr:`MemberRun.result` becomes its result with the job's device and counters
        (:meth:`_counted`), or ``None`` when the member failed.

        Raises:
            Exception: A single job's error (its weights could not be saved, or an earlier
                one); a fused array's member fails alone.
        """
        run = self.members.live[index]
        if run.error is None:
            try:
                run.finish(self.members, index, run.seconds(self.save_s))
            except Exception as exc:  # e.g. its checkpoint directory is not writable
                run.error = exc
        self.raise_failed()
        result = run.result if run.error is None else None
        run.result = None if result is None else self._counted(result)

    def _counted(self, result: TrainResult) -> TrainResult:
        """``result`` with the devices the job ran on last and its counters so far.

        Its swap, device-to-device, promote and demote counts and metered peak (a fused
        array's member: the array's).
        """
        return replace(
            result, device=self.store.device_name, swap_bytes=self.boundaries.swap_bytes,
            p2p_bytes=self.p2p_bytes, num_promotes=self.store.num_promotes,
            num_demotes=self.store.num_demotes, peak_device_bytes=self.peak_device_bytes or None)

    def raise_failed(self) -> None:
        """Raise a member's error where it fails the job (K = 1: the members' ``fail_alone``)."""
        if self.members.fail_alone:
            return
        for run in self.members.live:
            if run.error is not None:
                raise run.error
