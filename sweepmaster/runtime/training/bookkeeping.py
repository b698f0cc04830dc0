"""A spilled job's trial bookkeeping, once for K = 1 and K > 1, over its members' records.

Every spilled job keeps one :class:`~sweepmaster.runtime.training.member_runs.MemberRun` per member
(:attr:`TrialBookkeeping.runs`): :class:`TrialBookkeeping` records, at the task boundaries the
chain reaches, the start event, each step's records and ``on_step``, each evaluation's records,
``on_eval`` and pruning, the checkpoints due at a step boundary, the training seconds and a
member's result. A member's failure (a callback raising, a non-finite loss, a checkpoint that
cannot be written) fails it alone in a fused array and fails a single job
(:attr:`TrialBookkeeping.members_fail_alone`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import replace

import torch
from torch import nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.checkpoint import TrainingState, save_checkpoint
from sweepmaster.runtime.training.compute import ShardCompute
from sweepmaster.runtime.training.member_runs import MemberRun
from sweepmaster.runtime.training.tasks import ShardTask
from sweepmaster.workload.spec import TrainResult

__all__ = ["TrialBookkeeping"]


class TrialBookkeeping(ShardCompute):
    """A spilled job's members' records: start, steps, evaluations, checkpoints, results.

    A job provides its members' weights and training states (:meth:`member_state_dict`,
    :meth:`member_module`, :meth:`member_training_state`), its step's minibatch, epochs and
    learning rates (:meth:`start_step`, :meth:`step_ids`), and whether the members change at
    a step boundary (:meth:`_members_change`, a fused array's).

    Args:
        plan: The job plan.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations, or ``None``.

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).

    Attributes:
        p2p_bytes: Bytes moved device -> device so far (pipelined steps' boundaries).
        peak_device_bytes: The highest metered device peak of a task so far.
        step_swap_bytes: Bytes moved by each training step's tasks.
    """

    #: Every trial the job trains (K = 1: one), in order of :meth:`MemberRun.index`.
    runs: list[MemberRun]
    #: The trials still training: ``live[k]`` is member k of the job's stacked tensors.
    live: list[MemberRun]
    #: Whether a member's failure fails it alone (a fused array) or the job (K = 1: the
    #: member's error is raised).
    members_fail_alone = True
    #: The chain step whose step-boundary checkpoints were written last.
    _saved_step: int

    def __init__(self, plan: JobPlan, batch_size: int,
                 memory_plan: MemoryPlan | None = None) -> None:
        super().__init__(plan, batch_size, memory_plan)
        self.p2p_bytes = 0
        self.peak_device_bytes = 0
        self._started = False
        self._task_swap = 0  # bytes the training tasks of the current step moved so far
        self.step_swap_bytes: list[int] = []
        self._save_s = 0.0  # seconds spent writing checkpoints (not training)
        self._step_start = 0.0  # perf_counter at the current step's start
        # the current step's per-member epoch and learning rate (:meth:`start_step`)
        self._epochs: list[int] = []
        self._lrs: list[float] = []

    @property
    def started(self) -> bool:
        """Whether the job has started (its receivers heard ``on_start``)."""
        return self._started

    def start(self, device: Device, task: ShardTask) -> None:
        """Start the job (``on_start``) before ``task``, its first, runs on ``device``.

        Raises:
            Exception: What a single job's ``on_start`` raised (a fused array's member fails
                alone).
        """
        del task
        self._start_runs(device)

    def _start_runs(self, device: Device) -> None:
        """Every member starts on ``device`` (``on_start``; see :meth:`start`)."""
        self._started = True
        for run in self.runs:
            run.begin(device.name, self._save_s)
        self._raise_failed()

    @abstractmethod
    def start_step(self, device: Device) -> None:
        """Start a training step: its minibatch (plain's data order) and its dropout state."""

    @abstractmethod
    def step_ids(self) -> torch.Tensor:
        """The step's token ids on the host, ``(B, T)`` (a fused array: ``(K, B, T)``)."""

    def finish_step(self, device: Device, swap_bytes: int) -> None:
        """Record the step whose passes ran (its loss, ``on_step``); ``swap_bytes`` it moved.

        Raises:
            FloatingPointError: The train loss is not finite (one member's: a fused array's
                member fails alone, nothing is raised).
        """
        self._task_swap += swap_bytes
        self._finish_step(device)

    def _finish_step(self, device: Device) -> None:
        """Record the step whose last task ran on ``device``: each member's loss, ``on_step``.

        Each member's step counts it (a fused array counts its own step too).

        Raises:
            FloatingPointError: A single job's train loss is not finite (or what its
                ``on_step`` raised; a fused array's member fails alone).
        """
        seconds = time.perf_counter() - self._step_start
        for k, (run, loss) in enumerate(zip(self.live, self._train_losses(), strict=True)):
            run.step += 1
            run.record_step(run.step, loss, self._lrs[k], self._epochs[k], seconds, device)
        self._raise_failed()
        self.step_swap_bytes.append(self._task_swap)
        self._task_swap = 0

    def finish_eval(self) -> None:
        """Record the evaluation whose passes ran (``on_eval``; a member may be pruned).

        Raises:
            Exception: What a single job's ``on_eval`` raised (a fused array's member fails
                alone).
        """
        losses = self._eval_losses()
        for k, run in enumerate(self.live):
            if self._evaluated(run):
                run.record_eval(run.step, losses[k])
        self._raise_failed()

    def _evaluated(self, run: MemberRun) -> bool:
        """Whether the evaluation that ran concerns ``run`` (a single job's: always)."""
        del run
        return True

    def host_due(self, task: ShardTask) -> bool:
        """Whether ending ``task`` (a step's or evaluation's last) reads or changes host copies.

        A checkpoint is due, or a member leaves or may join: every shard must be home first.
        """
        if not self._ends_phase(task):
            return False
        saves = self._saved_step != self.step and any(self._saves(run) for run in self.live)
        return saves or self._members_change()

    def end_tasks(self, task: ShardTask, device: Device) -> None:
        """Bookkeeping once ``task``, a step's or evaluation's last, ran: checkpoints, members.

        Call it with every shard home when :meth:`host_due` said so.

        Raises:
            OSError: A single job's checkpoint could not be written (a fused array's member
                fails alone).
        """
        if self._ends_phase(task):
            self._end_step(device)  # the step, its evaluation and updates are done

    def _ends_phase(self, task: ShardTask) -> bool:
        """Whether ``task`` ends a step with its evaluation and updates (a step boundary).

        There no clipped update is deferred where a member checkpoints or ends
        (:func:`after_step_phase` settles them first).
        """
        following = self.peek_task(0)
        return following is None or (following.phase == "train" and (
            task.phase != "train" or task.step != following.step))

    def _members_change(self) -> bool:
        """Whether a member leaves or may join at the step boundary now (K = 1: never)."""
        return False

    def _end_step(self, device: Device) -> None:
        """A step boundary: the checkpoints due (once per step)."""
        del device
        if self._saved_step != self.step:
            self._save_due()
            self._saved_step = self.step

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
        for k, run in enumerate(self.live):
            if not self._saves(run):
                continue
            state = self.member_training_state(k)
            assert run.spec.state_dir is not None
            try:
                save_checkpoint(run.spec.state_dir, state, run.key,
                                keep=run.spec.keep_checkpoints)
            except OSError as exc:  # e.g. a full disk
                run.error = exc
        self._save_s += time.perf_counter() - start
        self._raise_failed()

    def _finish_run(self, index: int) -> None:
        """Member ``index`` of :attr:`live` ends: its result, weights saved (unless failed).

        :attr:`MemberRun.result` becomes its result with the job's device and counters
        (:meth:`_counted`), or ``None`` when the member failed.

        Raises:
            Exception: A single job's error (its weights could not be saved, or an earlier
                one); a fused array's member fails alone.
        """
        run = self.live[index]
        if run.error is None:
            try:
                run.finish(self, index, run.seconds(self._save_s))
            except Exception as exc:  # e.g. its checkpoint directory is not writable
                run.error = exc
        self._raise_failed()
        result = run.result if run.error is None else None
        run.result = None if result is None else self._counted(result)

    def _counted(self, result: TrainResult) -> TrainResult:
        """``result`` with the devices the job ran on last and its counters so far.

        Its swap, device-to-device, promote and demote counts and metered peak (a fused
        array's member: the array's).
        """
        return replace(
            result, device=self.device_name, swap_bytes=self.boundaries.swap_bytes,
            p2p_bytes=self.p2p_bytes, num_promotes=self.num_promotes,
            num_demotes=self.num_demotes, peak_device_bytes=self.peak_device_bytes or None)

    def _raise_failed(self) -> None:
        """Raise a member's error where it fails the job (K = 1, :attr:`members_fail_alone`)."""
        if self.members_fail_alone:
            return
        for run in self.live:
            if run.error is not None:
                raise run.error

    @abstractmethod
    def member_state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """Member ``index``'s weights (of :attr:`live`) as its model's ``state_dict`` (CPU)."""

    @abstractmethod
    def member_module(self, index: int) -> nn.Module:
        """Member ``index`` (of :attr:`live`) as a model of its own (to save its weights)."""

    @abstractmethod
    def member_training_state(self, index: int) -> TrainingState:
        """Member ``index``'s training state (of :attr:`live`), as a checkpoint holds it.

        Call it between steps, with no clipped update deferred.
        """
