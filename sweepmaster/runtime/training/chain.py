"""The chain of shard tasks every spilled job runs, for one member or a fused array of K.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device as a chain of **shard tasks**: per optimizer step, ``forward`` of shards ``0..S-2`` and
``backward`` (with Harmony's just-in-time update) of ``S-1..0``, then evaluation or deferred
update tasks (:func:`after_step_phase`). :class:`ShardChain` is what every such job shares,
whatever it trains: one member (:class:`~sweepmaster.runtime.training.spill.SpilledJob`, the
module run directly) or K stacked members
(:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`, ``vmap`` over members):

* the task sequence and the task API a scheduler drives (:meth:`ShardChain.next_task`,
  :meth:`ShardChain.peek_task`, :meth:`ShardChain.run`), with the plan's estimated seconds and
  peaks (:meth:`ShardChain.planned_peak_bytes`, the one estimate prefetch decisions read);
* the per-shard training algorithm, once for one member and for K: a task's promote, its
  forward, backward or evaluation microbatch loop, the tied-gradient exchange, the update or
  ``grad_clip``'s norms -> parked gradients -> clip coefficient at shard 0 -> deferred
  updates, then keep or demote; the jobs differ only behind small hooks (the rows' dimension,
  the tensors a shard computes with, a loss of one member or K, per-member norms, the dropout
  mode);
* Hydra's double buffering (:meth:`ShardChain.prefetch`): the next task's shard is promoted in
  the background (a side stream on CUDA, a copy thread on virtual devices) while the current
  task computes, or while another job's task runs on the device;
* the host side of boundaries (:class:`~sweepmaster.runtime.training.boundaries.HostBoundaries`,
  a base class): microbatches, boundary activations and gradients demoted into host buffers of
  the whole minibatch, every copy counted in ``swap_bytes``;
* the per-shard interface a pipeline drives
  (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP): promote a
  shard's tensors and optimizer state, run its forward or backward on a microbatch's rows, its
  update, the clip coefficients, evaluation passes, and the step's bookkeeping. Tensors are
  named by a :data:`TensorKey`; a fused array's rows sit after its member dimension
  (:attr:`ShardChain.row_dim`), its clip norms and coefficients are per member ``(K,)``.
* with a memory plan (mu-TWO, :mod:`~sweepmaster.runtime.planning.memplan`), the planned
  forward and backward passes of a shard
  (:class:`~sweepmaster.runtime.training.planned.PlannedPasses`, a base class): each layer's
  pass of each microbatch keeps, swaps or recomputes its saved activations from the forward
  task to the backward task, and the backward task's first fetch may run during the job's
  previous task (started by :meth:`ShardChain.prefetch`);
* a trial's bookkeeping, once for K = 1 and K > 1, over the job's
  :class:`~sweepmaster.runtime.training.members.MemberRun` records (:attr:`ShardChain.runs`):
  the start event, each step's records and ``on_step``, each evaluation's records, ``on_eval``
  and pruning, the checkpoints due at a step boundary, the training seconds and the result. A
  member's failure (a callback raising, a non-finite loss, a checkpoint that cannot be written)
  fails it alone in a fused array and fails a single job
  (:attr:`ShardChain.members_fail_alone`).

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import settle_all
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import metering
from sweepmaster.runtime.training.checkpoint import TrainingState, save_checkpoint
from sweepmaster.runtime.training.members import MemberRun
from sweepmaster.runtime.training.planned import PlannedPasses
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.workload.spec import TrainResult

TaskKind = Literal["forward", "backward"]
TaskPhase = Literal["train", "eval", "update"]
#: Names one tensor a shard promotes (a parameter, frozen parameter or buffer) to the job: a
#: fused array's canonical name, or one member's ``id(tensor)``.
TensorKey = int | str
#: Where one optimizer state tensor lives: ``(container, key)``, the tensor being
#: ``container[key]`` (a parameter's state in ``torch.optim``'s or the fused optimizer's).
StateSlot = tuple[MutableMapping[str, Any], str]

#: Background copies of virtual-device prefetches.
_COPY_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefetch")


def after_step_phase(*, evaluates: bool, defers: bool, settles: bool) -> TaskPhase | None:
    """What follows a training step in a spilled job's task chain (one rule for every K).

    Args:
        evaluates: Some member evaluates after the step.
        defers: Clipped updates are deferred (``grad_clip`` and more than one shard).
        settles: Some member ends or writes a checkpoint after the step: its weights must be
            whole by then.

    Returns:
        ``"eval"``: evaluation tasks of every shard (they apply deferred updates as they
        promote); ``"update"``: ``update`` tasks of shards ``1..S-1``; ``None``: nothing.
    """
    if evaluates:
        return "eval"
    return "update" if defers and settles else None


@dataclass(frozen=True)
class ShardTask:
    """One shard task of one job: the unit a scheduler places on a device.

    Attributes:
        job_id: The job's name (``TrainSpec.name``; a fused array's first member's).
        seq: Position in the job's task sequence (tasks run in ``seq`` order).
        step: Optimizer steps the job had finished when the task was issued.
        shard: The shard index.
        kind: ``"forward"`` or ``"backward"`` (evaluation is forward; a final deferred update
            is backward).
        phase: ``"train"``, ``"eval"`` or ``"update"``.
        est_seconds: Estimated run time (from the plan).
        promote_bytes: Parameter bytes promoted at the start (from the plan).
    """

    job_id: str
    seq: int
    step: int
    shard: int
    kind: TaskKind
    phase: TaskPhase
    est_seconds: float
    promote_bytes: int


class ShardChain(PlannedPasses):
    """What every spilled job shares: its task chain, prefetch, residency, per-shard algorithm.

    The host boundaries and planned passes are its base classes'
    (:class:`~sweepmaster.runtime.training.boundaries.HostBoundaries`,
    :class:`~sweepmaster.runtime.training.planned.PlannedPasses`, whose counters it has too).
    Not thread-safe: one task at a time (any thread). Subclasses build their state, then call
    ``super().__init__``; they say what follows a step (:attr:`num_steps`,
    :meth:`_evaluates_after`, :meth:`_settles_after`: the task sequence is :meth:`_chain`'s
    with :func:`after_step_phase`). The per-shard algorithm is here once, for one member and
    for K (:meth:`run`: promote, a deferred update, the forward, backward or evaluation task's
    microbatch loop, the tied-gradient exchange, the update or the ``grad_clip`` flow, keep or
    demote), and so are a shard's promote and demote: its tensors' device copies installed and
    written back when an update changed them (:meth:`install`, :meth:`uninstall`), its
    optimizer state promoted and demoted in one batch (:meth:`promote_state`,
    :meth:`demote_state`). A job provides what differs behind small hooks: the tensors it
    computes with by :data:`TensorKey` (:meth:`_task_tensors`, their host copies
    :meth:`host_tensor`, their data between installs :meth:`_idle_data`), where its optimizer
    state lives (:meth:`_state_slots`), a shard's forward (:meth:`_run_shard`), its dropout
    mode (:meth:`_pass_mode`), its members' loss (:meth:`_lm_loss`), gradient norms
    (:meth:`_norms_of`) and optimizer step (:meth:`_update`), and the evaluation's dropout
    switch (:meth:`_dropout_off`).
    A trial's bookkeeping is here once too, over :attr:`runs` (one
    :class:`~sweepmaster.runtime.training.members.MemberRun` per member, K >= 1): the start
    event (:meth:`start`), each step's and evaluation's records and events
    (:meth:`_finish_step`, :meth:`finish_eval`), the checkpoints due at a step boundary
    (:meth:`end_tasks`) and a member's result (:meth:`_finish_run`); a job provides its members'
    weights and training states (:meth:`member_state_dict`, :meth:`member_module`,
    :meth:`member_training_state`) and its epochs and learning rates of the step
    (:meth:`start_step`).

    Args:
        plan: The job plan (shards, microbatch sizes, seconds, peaks); its device's type
            (``cpu`` or ``cuda``) is where the tasks run.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation.

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).

    Attributes:
        p2p_bytes: Bytes moved device -> device so far (pipelined steps' boundaries).
        num_promotes: Shard promotions so far.
        num_demotes: Shard demotions so far.
        num_prefetches: Shards promoted ahead of their task so far.
        peak_device_bytes: The highest metered device peak of a task so far.
        step: Optimizer steps the job finished (a fused array's: in this run).
    """

    step: int
    #: Every trial the job trains (K = 1: one), in order of :meth:`MemberRun.index`.
    runs: list[MemberRun]
    #: The trials still training: ``live[k]`` is member k of the job's stacked tensors.
    live: list[MemberRun]
    #: Whether a member's failure fails it alone (a fused array) or the job (K = 1: the
    #: member's error is raised).
    members_fail_alone = True
    #: The chain step whose step-boundary checkpoints were written last.
    _saved_step: int
    #: A shard is prefetched beside a task only with this share of the task's planned peak
    #: to spare: the error the plan's peaks may have. 0 for a job whose plan was profiled on
    #: its own layers (its metered peaks equal the planned ones to the byte, and its plan chose
    #: its prefetches with no margin); a subclass whose peaks are estimates sets more.
    _prefetch_margin = 0.0
    #: The evaluation's loss sum so far, float64 (a fused array's: per member ``(K,)``), and
    #: the tokens it counts.
    _eval_sum: torch.Tensor
    _eval_tokens: int
    #: Per shard, the optimizer of its owned parameters (``None``: it owns none).
    _optimizers: Sequence[Any]

    def __init__(self, plan: JobPlan, batch_size: int,
                 memory_plan: MemoryPlan | None = None) -> None:
        super().__init__(plan, batch_size, memory_plan)
        self.p2p_bytes = 0
        self.num_promotes = 0
        self.num_demotes = 0
        self.num_prefetches = 0
        self.peak_device_bytes = 0
        #: Devices the job ran on last (a pipeline's: every device's name, comma-separated).
        self.device_name = plan.device
        self._started = False
        self._pending: dict[int, Any] = {}  # shard -> its deferred clipped update (grad_clip)
        self._task_swap = 0  # bytes the training tasks of the current step moved so far
        self.step_swap_bytes: list[int] = []  # bytes moved by each training step's tasks
        self._save_s = 0.0  # seconds spent writing checkpoints (not training)
        self._step_start = 0.0  # perf_counter at the current step's start
        # the current step's per-member epoch and learning rate (:meth:`start_step`)
        self._epochs: list[int] = []
        self._lrs: list[float] = []
        self._contrib: dict[TensorKey, torch.Tensor] = {}  # tied parameter -> later shards' grad
        # grad_clip: owned gradients' norms and parked gradients on the host, by parameter, and
        # the step's clip coefficient (a fused array's: per member)
        self._norms: dict[TensorKey, torch.Tensor] = {}
        self._host_grads: dict[TensorKey, torch.Tensor] = {}
        self._clip_coef: torch.Tensor | None = None
        self._future = deque[ShardTask]()
        self._first_seq = 0  # ``seq`` of the first task of the current task sequence
        self._num_issued = 0  # tasks the sequences have given so far
        self._tasks = self._task_sequence()
        self._prefetched: dict[int, tuple[str, concurrent.futures.Future[Any]]] = {}
        self._kept: tuple[int, Device] | None = None  # (shard, device) left resident
        #: key -> the host copy of an installed tensor (:meth:`install`): its write-back target
        self._host_data: dict[TensorKey, torch.Tensor] = {}
        #: the installed parameters an update changed since they were installed or written back
        self._changed: set[TensorKey] = set()
        #: shard -> its optimizer state's slots and their host copies while it is on a device
        self._device_state: dict[int, list[tuple[StateSlot, torch.Tensor]]] = {}
        #: Tasks whose shard was resident already (kept by the task before; no promote).
        self.num_resident_hits = 0
        #: Prefetches (of shards, and a memory plan's early fetches of activations) dropped
        #: because the device had no memory for them (:meth:`prefetch`).
        self.num_prefetch_refusals = 0
        self._reset_eval()

    # ------------------------------------------------------------------ task API

    @property
    @abstractmethod
    def stopped(self) -> bool:
        """Whether the job stopped before its task sequence ends (pruned, every member left)."""

    def next_task(self) -> ShardTask | None:
        """The next task to run, or ``None`` when the job is finished or :attr:`stopped`."""
        return None if self.stopped else self.peek_task(0)

    def peek_task(self, ahead: int = 1) -> ShardTask | None:
        """The task ``ahead`` positions after the next one (assuming nothing ends early)."""
        while len(self._future) <= ahead:
            task = next(self._tasks, None)
            if task is None:
                return None
            self._num_issued = task.seq + 1
            self._future.append(task)
        return self._future[ahead]

    def take_tasks(self, num_tasks: int) -> list[ShardTask]:
        """Take the next ``num_tasks`` tasks off the chain at once, to be run together.

        A pipelined step (:mod:`~sweepmaster.runtime.training.pipelined`) runs a whole step's
        tasks over several devices at once.

        Raises:
            ValueError: The job has fewer tasks left, or it stopped.
        """
        tasks = [self.peek_task(i) for i in range(num_tasks)] if not self.stopped else [None]
        if any(task is None for task in tasks):
            raise ValueError(f"the job has fewer than {num_tasks} tasks left")
        for _ in range(num_tasks):
            self._future.popleft()
        return [task for task in tasks if task is not None]

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
        self._future.popleft()
        if not self._started:
            self.start(device, task)
            if self.stopped:  # every member of a fused array had finished already
                return
        if task.step == self.step and self._step_due(task):
            self.start_step(device)
        meter = device.meter
        if meter is not None:
            meter.reset_peak()
        swap_start = self.swap_bytes
        try:
            with self._task_mode(device):
                try:
                    self._promote(task, device)
                    with self._compute_mode(device):
                        if task.shard in self._pending:  # an ``update`` task does only this
                            self._apply_pending(task.shard, self._task_tensors(), device)
                        if task.phase == "eval":
                            self._eval_shard(task.shard, device)
                        elif task.phase == "train" and task.kind == "forward":
                            self._forward_shard(task.shard, device)
                        elif task.phase == "train":
                            self._backward_shard(task.shard, device)
                except BaseException:
                    self._demote(task.shard, device)
                    raise
                following = self.peek_task(0)
                if keep and following is not None and following.shard == task.shard:
                    if following.kind != "backward" or not self._state_stays(task.shard):
                        self.demote_state(task.shard, device)  # home before the next task
                    self._keep(task.shard, device)
                else:
                    self._demote(task.shard, device)
        except BaseException:
            self.release()
            raise
        if meter is not None:
            self.peak_device_bytes = max(self.peak_device_bytes, meter.peak_bytes)
        if task.phase == "train":
            self._task_swap += self.swap_bytes - swap_start
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

    def _counted(self, result: TrainResult) -> TrainResult:
        """``result`` with the devices the job ran on last and its counters so far.

        Its swap, device-to-device, promote and demote counts and metered peak (a fused
        array's member: the array's).
        """
        return replace(
            result, device=self.device_name, swap_bytes=self.swap_bytes,
            p2p_bytes=self.p2p_bytes, num_promotes=self.num_promotes,
            num_demotes=self.num_demotes, peak_device_bytes=self.peak_device_bytes or None)

    def _promote(self, task: ShardTask, device: Device) -> None:
        """Make ``task``'s shard resident on ``device``: a kept one, prefetched or promoted.

        Prefetched or promoted copies are installed (:meth:`install`) as the data of the
        tensors the shard computes with (:meth:`_task_tensors`).
        """
        if not self._take_kept(task, device):
            copies = self._promote_hosts(task, device, self._promoted_hosts(task.shard))
            self.install(self.shard_keys(task.shard), copies)

    def _demote(self, shard: int, device: Device) -> None:
        """Write back what the shard's updates changed, its optimizer state too; free the copies.

        Buffers are never written back: layers that update buffers in their forward (batch-norm
        running statistics) are not supported.
        """
        self.uninstall(self.shard_keys(shard), device)
        self.demote_state(shard, device)
        self.num_demotes += 1

    def _finish_step(self, device: Device) -> None:
        """Record the step whose last task ran on ``device``: each member's loss, ``on_step``.

        Raises:
            FloatingPointError: A single job's train loss is not finite (or what its
                ``on_step`` raised; a fused array's member fails alone).
        """
        self.step += 1
        seconds = time.perf_counter() - self._step_start
        for k, (run, loss) in enumerate(zip(self.live, self._train_losses(), strict=True)):
            run.step += 1
            run.record_step(run.step, loss, self._lrs[k], self._epochs[k], seconds, device)
        self._raise_failed()
        self.step_swap_bytes.append(self._task_swap)
        self._task_swap = 0

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

    def planned_peak_bytes(self, task: ShardTask) -> int:
        """Planned device peak of ``task`` (bytes): the one estimate prefetch decisions read.

        A training task the memory plan covers peaks at the memory plan's estimate (its kept
        and swapped activations); any other task at the job plan's (Hydra's full recompute).
        The last shard's evaluation pass holds its logits like its backward.
        A task whose shard stayed resident with its optimizer state (:meth:`_state_stays`)
        holds the state through its compute, not only through its update: its bytes are added.
        """
        shard = self.plan.shards[task.shard]
        state = shard.optimizer_bytes if self.state_on_device(task.shard) else 0
        if self.memory_plan is not None and task.phase == "train":
            planned = self.memory_plan.shards[task.shard]
            return state + (planned.forward_peak_bytes if task.kind == "forward"
                            else planned.backward_peak_bytes)
        if task.phase == "eval" and task.shard == len(self.plan.shards) - 1:
            return state + shard.backward_peak_bytes
        return state + (shard.forward_peak_bytes if task.kind == "forward"
                        else shard.backward_peak_bytes)

    def _task_sequence(self) -> Iterator[ShardTask]:
        """Every task of the job in order (ending a job early only truncates it).

        Hydra's tasks of steps :attr:`step` to :attr:`num_steps`; what follows each step is
        :func:`after_step_phase`'s, from :meth:`_evaluates_after` and :meth:`_settles_after`
        (before the first step: only an evaluation).
        """
        first = self.step
        defers = self.clips and len(self.plan.shards) > 1

        def after(step: int) -> TaskPhase | None:
            return after_step_phase(evaluates=self._evaluates_after(step), defers=defers,
                                    settles=step != first and self._settles_after(step))

        yield from self._chain(self.name, first, self.num_steps, after)

    @property
    @abstractmethod
    def num_steps(self) -> int:
        """The step the job trains to (a fused array's: in this run)."""

    @abstractmethod
    def _evaluates_after(self, step: int) -> bool:
        """Whether some member evaluates after ``step`` (at the sequence's first: before it)."""

    @abstractmethod
    def _settles_after(self, step: int) -> bool:
        """Whether some member ends or writes a checkpoint after ``step``."""

    def _rechain(self) -> None:
        """Make the task sequence again from the next task on (what follows has changed).

        A fused array a member joined has more steps, or an evaluation before its next step.
        Call it between tasks with nothing prefetched; the new sequence's tasks go on from the
        next ``seq``.
        """
        assert not self._prefetched, "prefetched copies of the old sequence's tasks"
        self._first_seq = self._future[0].seq if self._future else self._num_issued
        self._future.clear()
        self._tasks = self._task_sequence()

    def _chain(self, job_id: str, first: int, stop: int,
               after: Callable[[int], TaskPhase | None]) -> Iterator[ShardTask]:
        """Hydra's tasks of steps ``first..stop-1``, each step followed by ``after(step + 1)``.

        ``after(first)`` says what runs before the first step (an evaluation at step 0). The
        first task's ``seq`` is the next one the job has not issued (see :meth:`_rechain`).
        """
        num_shards = len(self.plan.shards)
        seq = self._first_seq
        self._job_id = job_id

        def task(step: int, shard: int, kind: TaskKind, phase: TaskPhase) -> ShardTask:
            nonlocal seq
            seq += 1
            plan = self.plan.shards[shard]
            seconds = plan.forward_s if kind == "forward" else plan.backward_s
            if self.memory_plan is not None and phase == "train":
                planned = self.memory_plan.shards[shard]
                seconds = planned.forward_s if kind == "forward" else planned.backward_s
            return ShardTask(job_id, seq - 1, step, shard, kind, phase, seconds,
                             plan.param_bytes)

        def following(step: int) -> Iterator[ShardTask]:
            phase = after(step)
            if phase == "eval":
                yield from (task(step, i, "forward", "eval") for i in range(num_shards))
            elif phase == "update":
                yield from (task(step, i, "backward", "update") for i in range(1, num_shards))

        yield from following(first)
        for step in range(first, stop):
            yield from (task(step, i, "forward", "train") for i in range(num_shards - 1))
            yield from (task(step, i, "backward", "train") for i in range(num_shards - 1, -1, -1))
            yield from following(step + 1)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, task: ShardTask | None, device: Device, *,
                 headroom_bytes: int | None = None) -> None:
        """Start promoting ``task``'s shard to ``device`` in the background.

        Two cases of Hydra's double buffering:

        * ``task`` follows the job's next task (``peek_task()``): only when
          :meth:`_may_prefetch` allows it (the next task's planned peak plus this shard fits the
          budget, and the two shards share no parameter the current task updates);
        * ``task`` is the job's next task while the job waits (another job's task runs on
          ``device``): only when its parameters fit ``headroom_bytes``, the bytes the running
          task leaves free on ``device``.

        A shard whose clipped update is deferred is never prefetched (its update needs its
        gradients and optimizer state beside it). The task's run then takes the copies (or drops
        them if it runs on another device). A prefetch the device has no memory for (planned
        peaks are estimates; on CUDA, fragmentation) is dropped, not raised: the task promotes
        its shard when it runs (:attr:`num_prefetch_refusals` counts them). On the host CPU
        (its transfers are in place) there is nothing to prefetch.
        """
        current = self.next_task()
        if (task is None or current is None or self._is_kept(task.shard)
                or device.transfer.in_place):
            return
        if task.seq != current.seq:
            self._prefetch_activations(current, task, device)
        if task.seq in self._prefetched or task.shard in self._pending:
            return
        if task.seq == current.seq:
            if headroom_bytes is None or self.plan.shards[task.shard].param_bytes > headroom_bytes:
                return
        elif not self._may_prefetch(current, task):
            return
        hosts = self._promoted_hosts(task.shard)
        try:
            if device.torch_device.type == "cuda":
                stream = torch.cuda.Stream(device.torch_device)
                with torch.cuda.stream(stream):  # one batch on the transfer engine's stream
                    copies = device.transfer.promote(hosts)
            else:  # allocate now (as an allocator would), copy in the background
                copies = device.empty_like(hosts)
        except torch.OutOfMemoryError:  # an estimate was short: the task promotes it itself
            self.num_prefetch_refusals += 1
            return
        if device.torch_device.type == "cuda":
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result((copies, stream))
        else:

            def copy() -> tuple[list[torch.Tensor], None]:
                device.transfer.copy_in(copies, hosts).wait_device()  # one batch
                return copies, None

            done = _COPY_POOL.submit(copy)
        self._prefetched[task.seq] = (device.name, done)
        self.num_prefetches += 1

    def discard_prefetch(self, device: Device) -> None:
        """Drop what was prefetched onto ``device`` (it runs something else now), freeing it.

        Parameters and a memory plan's activations fetched early alike; the host copies stay.
        A shard kept resident there stays: the executor's residency cache evicts it
        (:meth:`evict`) when another task needs the room.
        """
        for seq in [seq for seq, (name, _) in self._prefetched.items() if name == device.name]:
            self._prefetched.pop(seq)[1].result()
        self._unfetch_early(device)

    def release(self) -> None:
        """Free what the job holds on devices between its tasks; it cannot go on after this.

        Here: the shard kept resident (written back), the shards prefetched onto any device
        once their background copies end (failed or not), and the activations a memory plan
        keeps or fetched early for a backward task. Called when the job fails or leaves its
        executor; the host copies stay.
        """
        self.evict()
        for _, future in self._prefetched.values():
            with contextlib.suppress(Exception):
                future.result()
        self._prefetched.clear()
        self._release_passes()

    def _promoted_hosts(self, shard: int) -> list[torch.Tensor]:
        """The host tensors a promote of ``shard`` copies to a device, in promote order."""
        return [self.host_tensor(key) for key in self.shard_keys(shard)]

    def _may_prefetch(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether ``task`` (after ``current``) may be promoted while ``current`` runs.

        Another shard within :meth:`_prefetch_window`, sharing no parameter with the current
        task's shard (a tied one: the current task updates it), and the current task's planned
        peak (with :attr:`_prefetch_margin`) plus the shard's parameters fit the budget.
        """
        if task.shard == current.shard or not self._prefetch_window(current, task):
            return False
        updated = {key for key in self.shard_keys(current.shard) if self.trainable(key)}
        if any(key in updated for key in self.shard_keys(task.shard) if self.trainable(key)):
            return False
        budget = self.plan.budget_bytes
        if self.memory_plan is not None:
            budget = self.memory_plan.limit_bytes
        peak = math.ceil(self.planned_peak_bytes(current) * (1 + self._prefetch_margin))
        return peak + self.plan.shards[task.shard].param_bytes <= budget

    def _prefetch_window(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether ``task`` is close enough to ``current`` to be prefetched (any: a job's)."""
        del current, task
        return True

    # ------------------------------------------------------------------ residency

    def resident_shard(self, device: Device) -> int | None:
        """The shard the job keeps resident on ``device`` between its tasks, if any."""
        kept = self._kept
        return kept[0] if kept is not None and kept[1] is device else None

    def resident_bytes(self, device: Device) -> int:
        """Planned bytes the job keeps on ``device`` between its tasks (0: nothing).

        The kept shard's parameters (the plan's ``param_bytes``, what its promote saves), and
        its optimizer state when that stays with it (a job of one shard between its steps).
        The executor's residency cache counts them against the device's budget
        (:class:`~sweepmaster.runtime.scheduling.scheduler.Residency`).
        """
        shard = self.resident_shard(device)
        if shard is None:
            return 0
        planned = self.plan.shards[shard]
        return planned.param_bytes + (planned.optimizer_bytes if self._state_kept(shard) else 0)

    def evict(self, device: Device | None = None) -> None:
        """Write back and free the shard kept resident on ``device`` (any device: None), if any.

        The job's part of the residency cache: a task run with ``keep`` leaves its shard on
        the device when the job's next task is of the same shard; what changed is written back
        here, when that task runs on another device, another job's task needs the room (the
        executor's :class:`~sweepmaster.runtime.scheduling.scheduler.Residency`), or before a
        checkpoint, a member leaving or the result reads the host copies.
        """
        if self._kept is not None and (device is None or self._kept[1] is device):
            shard, kept_on = self._kept
            self._kept = None
            self._write_back(shard, kept_on)

    def _is_kept(self, shard: int) -> bool:
        """Whether ``shard`` stays resident on a device between tasks (nothing to prefetch)."""
        return self._kept is not None and self._kept[0] == shard

    def _take_kept(self, task: ShardTask, device: Device) -> bool:
        """Whether ``task``'s shard is resident on ``device`` already (it promotes nothing).

        Otherwise a shard kept resident elsewhere is written back first.
        """
        if self._kept == (task.shard, device):
            self._drop_stale(task.seq)
            self._kept = None
            self.num_resident_hits += 1
            self.device_name = device.name
            return True
        self.evict()
        return False

    def _state_kept(self, shard: int) -> bool:
        """Whether the kept ``shard``'s optimizer state stays on its device with it."""
        return self.state_on_device(shard)

    def _state_stays(self, shard: int) -> bool:
        """Whether the shard's optimizer state may stay on the device with the kept shard.

        :meth:`~sweepmaster.runtime.planning.plans.JobPlan.state_stays` on the job's plan and
        memory plan (the rule the policy's chain counts the bytes by).
        """
        if self.memory_plan is None:
            return self.plan.state_stays(shard)
        return self.plan.state_stays(shard, self.memory_plan.shards,
                                     self.memory_plan.limit_bytes)

    def _keep(self, shard: int, device: Device) -> None:
        """Leave ``shard`` resident on ``device`` for the next task (its gradients dropped)."""
        tensors = self._task_tensors()
        for key in self.shard_keys(shard):
            tensors[key].grad = None
        self._kept = (shard, device)

    def _write_back(self, shard: int, device: Device) -> None:
        """Demote the kept ``shard`` from ``device``: write back what changed, free the rest."""
        self._demote(shard, device)

    def _prefetch_activations(self, current: ShardTask, task: ShardTask, device: Device) -> None:
        """Fetch the first item of ``task``'s backward during ``current`` (memory plan).

        Only what the memory plan budgets beside the current task (``early_fetch_bytes``). A
        fetch the device has no memory for (the plan's peaks are estimates) is dropped like a
        shard prefetch (:attr:`num_prefetch_refusals`): the backward task fetches it itself.
        """
        if self.memory_plan is None or task.phase != "train" or task.kind != "backward":
            return
        follows = current.phase == "train" and current.kind == "backward"
        if not follows or current.shard != task.shard + 1:
            return
        if not self._fetch_early(task.shard, device):
            self.num_prefetch_refusals += 1

    def _promote_hosts(self, task: ShardTask, device: Device,
                       hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``task``'s shard: prefetched ones, or promoted now (counted)."""
        copies = self._take_prefetched(task, device)
        if copies is None:
            copies = device.transfer.promote(list(hosts))
        self._moved(device, sum(copy.nbytes for copy in copies))
        self.num_promotes += 1
        self.device_name = device.name
        return copies

    def _take_prefetched(self, task: ShardTask, device: Device) -> list[torch.Tensor] | None:
        """The copies prefetched for ``task`` onto ``device`` (``None``: promote now).

        Drops stale prefetches (of earlier tasks, e.g. after the task moved device), and a copy
        made for another device. On CUDA the current stream waits for the copy's stream.
        """
        self._drop_stale(task.seq)
        if task.seq not in self._prefetched:
            return None
        name, future = self._prefetched.pop(task.seq)
        copies, stream = future.result()
        if name != device.name:
            return None
        if stream is not None:
            current = torch.cuda.current_stream(device.torch_device)
            current.wait_stream(stream)
            for copy in copies:
                copy.record_stream(current)
        return list(copies)

    def _drop_stale(self, seq: int) -> None:
        """Drop prefetches of tasks before ``seq`` (e.g. the task moved device), freeing them."""
        for stale in [stale for stale in self._prefetched if stale < seq]:
            self._prefetched.pop(stale)[1].result()

    # ------------------------------------------------------------------ per-shard interface
    # What a pipeline (training/pipelined.py) drives; each call between tasks of the chain's
    # own (after :meth:`take_tasks` took a step's or an evaluation's tasks).

    @property
    @abstractmethod
    def name(self) -> str:
        """The job's name (a fused array's: its first member's)."""

    @property
    def started(self) -> bool:
        """Whether the job has started (its receivers heard ``on_start``)."""
        return self._started

    @property
    @abstractmethod
    def clips(self) -> bool:
        """Whether some member clips its gradients (``grad_clip``): updates wait for the norm."""

    def deferred(self, shard: int) -> bool:
        """Whether the shard's clipped update is deferred (applied when it is next promoted)."""
        return shard in self._pending

    def dropout_stream(self, state: torch.Tensor | None) -> JobRng | None:
        """The dropout stream a pipeline's pack draws from (``None``: drawn up front).

        Args:
            state: The stream's state where the pack starts, ``None`` for the job's own stream.

        Returns:
            The stream, or ``None`` for a job that draws a step's dropout at its start
            (:meth:`start_step`, a fused array).
        """
        del state
        return None

    def set_dropout_state(self, state: torch.Tensor) -> None:  # noqa: B027
        """Continue the job's dropout stream from ``state`` (a pipeline's last pack's)."""

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

    @abstractmethod
    def shard_keys(self, shard: int) -> list[TensorKey]:
        """The tensors a promote of ``shard`` copies to a device, in promote order."""

    @abstractmethod
    def owned_keys(self, shard: int) -> list[TensorKey]:
        """The parameters ``shard`` updates (it owns them: the first shard using each)."""

    @abstractmethod
    def trainable(self, key: TensorKey) -> bool:
        """Whether the tensor ``key`` gets gradients."""

    @abstractmethod
    def host_tensor(self, key: TensorKey) -> torch.Tensor:
        """The host copy of ``key`` (stacked ``(K, ...)`` in a fused array)."""

    def install(self, keys: Sequence[TensorKey], copies: Sequence[torch.Tensor]) -> None:
        """Make ``copies`` (on a device) the data of the tensors ``keys`` the job computes with.

        The tensors are :meth:`_task_tensors`'s (the same ones in every task and pipeline
        pack: a graph a memory plan keeps from a forward task names them); their host copies
        (:meth:`host_tensor`) are remembered as the targets of the write-back.
        """
        tensors = self._task_tensors()
        for key, copy in zip(keys, copies, strict=True):
            self._host_data[key] = self.host_tensor(key)
            tensors[key].data = copy

    def installed(self, key: TensorKey) -> torch.Tensor:
        """The installed tensor ``key`` (its ``.grad`` holds the gradient after a backward)."""
        return self._task_tensors()[key]

    def uninstall(self, keys: Sequence[TensorKey], device: Device) -> None:
        """Put the host copies of ``keys`` back, writing back what an update changed.

        The changed parameters go home in one batch, asynchronously on CUDA: the next reader
        of the host copies waits for it (a promote, or :meth:`_settle_hosts`). Keys that are
        not installed (a promote that failed before installing them) are skipped; gradients
        are dropped.
        """
        tensors = self._task_tensors()
        changed: list[torch.Tensor] = []
        hosts: list[torch.Tensor] = []
        for key in keys:
            host = self._host_data.pop(key, None)
            if host is None:
                continue
            tensor = tensors[key]
            if key in self._changed:
                changed.append(tensor.data)
                hosts.append(host)
                self._changed.discard(key)
            tensor.data = self._idle_data(host)
            tensor.grad = None
        if changed:
            self._moved(device, sum(t.nbytes for t in changed))
            device.transfer.demote(changed, hosts)

    def write_back_tensor(self, key: TensorKey, device: Device) -> None:
        """Write the installed ``key`` back to its host copy now if an update changed it.

        Waited for: the tensor stays installed, and its next update (in place) must not race
        the copy.
        """
        if key not in self._changed:
            return
        self._changed.discard(key)
        tensor = self._task_tensors()[key]
        self._moved(device, tensor.nbytes)
        device.transfer.demote([tensor.data], [self._host_data[key]])[1].wait()

    def _settle_hosts(self) -> None:
        """Make the host copies whole before they are read (a checkpoint, a result, a member).

        Writes back the shard kept resident (:meth:`evict`) and waits for the demotes still
        writing host tensors, every device's
        (:func:`~sweepmaster.runtime.devices.transfer.settle_all`).
        """
        self.evict()
        settle_all()

    def forward_pass(self, shard: int, mb: int, rows: slice, x: torch.Tensor, device: Device,
                     rng: JobRng | None = None,
                     overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """Microbatch ``mb``'s forward of ``shard`` without grad, on its installed tensors.

        Args:
            shard: The shard.
            mb: The microbatch's index.
            rows: Its rows of the minibatch.
            x: Its input on ``device``: token ids ``(b, T)`` or ``(b, T, C)`` (a fused array:
                ``(K, b, ...)``).
            device: Where it runs (metered).
            rng: The dropout stream (:meth:`dropout_stream`), else the job's.
            overrides: ``key -> tensor`` used instead of installed ones (a pipeline pack's
                copies of tied parameters another pack holds).

        Returns:
            Its output on ``device``, ``(b, T, C)`` (``(K, b, T, C)``).
        """
        return self._forward_rows(shard, mb, rows, x, device, self._task_tensors(), rng,
                                  overrides)

    def backward_pass(self, shard: int, mb: int, rows: slice, x: torch.Tensor,
                      target: Callable[[], torch.Tensor], device: Device, weight: bool,
                      rng: JobRng | None = None,
                      overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                      ) -> torch.Tensor | None:
        """Microbatch ``mb``'s backward of ``shard``, its gradients accumulated in ``.grad``.

        Recomputes the shard's forward from ``x`` with the dropout replayed (the last shard:
        forward and each member's loss) and backpropagates, on the installed tensors.

        Args:
            shard: The shard.
            mb: The microbatch's index.
            rows: Its rows of the minibatch.
            x: Its input on ``device`` (as :meth:`forward_pass`'s).
            target: Returns, on ``device``, the labels ``(b, T)`` (last shard) or the gradient
                of the shard's output ``(b, T, C)`` (a fused array: ``(K, b, ...)``); called
                once the forward ran.
            device: Where it runs (metered).
            weight: Weigh the microbatch's loss by its share of the minibatch's rows.
            rng: See :meth:`forward_pass`.
            overrides: See :meth:`forward_pass`.

        Returns:
            The gradient of ``x`` (as ``x``); ``None`` for shard 0.
        """
        if self._trains_nothing(shard):
            return None
        return self._backward_rows(shard, mb, rows, x, target, device, weight,
                                   self._task_tensors(), rng, overrides)

    def updates(self, shard: int) -> bool:
        """Whether ``shard`` owns parameters to update (it has an optimizer)."""
        return self._optimizers[shard] is not None

    def update_shard(self, shard: int, device: Device,
                     clip_coef: torch.Tensor | None = None) -> None:
        """Harmony's just-in-time update of the shard's installed parameters, this step's.

        The optimizer state is used where :meth:`promote_state` put it, else promoted for the
        update; it stays there until :meth:`demote_state` (with the shard's demote, or before a
        next task that does not update the shard). ``clip_coef``: the clip coefficients on
        ``device`` (:meth:`clip_coefficient`), multiplied into the gradients first.
        """
        self._jit_update(shard, self._task_tensors(), self._schedule(), device, clip_coef)

    def state_on_device(self, shard: int) -> bool:
        """Whether the shard's optimizer state is on a device (:meth:`promote_state`)."""
        return shard in self._device_state

    def promote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state to ``device`` (nothing if there or no optimizer).

        One batch through the device's transfer engine, counted in :attr:`swap_bytes`; each
        tensor of :meth:`_state_slots` is replaced by its device copy, its host copy kept for
        :meth:`demote_state`. The state stays on the device while the shard is resident (kept
        for a next task that updates it, or a pipeline's pack) and goes home with the shard's
        demote.

        Raises:
            torch.OutOfMemoryError: The state does not fit the device.
        """
        if self._optimizers[shard] is None or shard in self._device_state:
            return
        slots = self._state_slots(shard)
        hosts = [container[key] for container, key in slots]
        self._moved(device, sum(t.nbytes for t in hosts))
        copies = device.transfer.promote(hosts)
        for (container, key), copy in zip(slots, copies, strict=True):
            container[key] = copy
        self._device_state[shard] = list(zip(slots, hosts, strict=True))

    def demote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state on ``device`` back to the host, if it is there.

        One batch, counted in :attr:`swap_bytes`, asynchronous on CUDA (the next reader of the
        host copies waits for it: a promote, or :meth:`_settle_hosts`). A state tensor that a
        first step made on the device (no host copy yet) gets a new host tensor.
        """
        homes = self._device_state.pop(shard, None)
        if homes is None:
            return
        # by its slot's identity: the homes hold the containers, so their ids stay unique
        host_of = {(id(container), key): host for (container, key), host in homes}
        slots = self._state_slots(shard)
        if not slots:
            return
        values = [container[key] for container, key in slots]
        self._moved(device, sum(t.nbytes for t in values))
        hosts, _ = device.transfer.demote(
            values, [host_of.get((id(container), key)) for container, key in slots])
        for (container, key), host in zip(slots, hosts, strict=True):
            container[key] = host

    @abstractmethod
    def _state_slots(self, shard: int) -> list[StateSlot]:
        """Where the optimizer state tensors of ``shard`` that move with it live, in order.

        Each ``(container, key)``: ``container[key]`` is one state tensor (its host copy, or
        its device copy between :meth:`promote_state` and :meth:`demote_state`); a step may
        add slots while the state is on the device (its first step makes the state there).
        """

    def grad_norms(self, shard: int) -> dict[TensorKey, torch.Tensor]:
        """The 2-norms of the shard's owned gradients: 0-dim, a fused array's ``(K,)``."""
        return self._grad_norms(shard, self._task_tensors())

    @abstractmethod
    def clip_coefficient(self, norms: Mapping[TensorKey, torch.Tensor],
                         device: Device) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient from every owned parameter's gradient norm.

        Args:
            norms: Every owned parameter's :meth:`grad_norms`, on ``device``.
            device: Where they are.

        Returns:
            The coefficient on ``device``: 0-dim, a fused array's per member ``(K,)``.
        """

    def park_grads(self, shard: int, device: Device) -> None:
        """Defer the shard's clipped update: its owned gradients go to the host."""
        self._park_grads(shard, self._task_tensors(), device)

    def defer_clip(self, coef: torch.Tensor, device: Device) -> None:
        """Keep the step's clip coefficient (on ``device``) on the host for deferred updates."""
        self._clip_coef = self.to_host(device, coef)

    def apply_deferred(self, shard: int, device: Device) -> None:
        """Apply the shard's deferred clipped update to its installed parameters."""
        self._apply_pending(shard, self._task_tensors(), device)

    @abstractmethod
    def eval_ids(self) -> torch.Tensor:
        """The evaluation blocks on the host, ``(M, T)`` (a fused array: ``(K, M, T)``)."""

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Evaluation mode (dropout off) with the evaluation's loss sum reset, then back."""
        self._reset_eval()
        with self._dropout_off(None):
            yield

    def eval_pass(self, shard: int, x: torch.Tensor, device: Device,
                  overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """An evaluation chunk's forward of ``shard`` (no grad); see :meth:`forward_pass`."""
        with torch.no_grad():
            return self._run_shard(shard, self._task_tensors(), x, None, device, overrides)

    def add_eval_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """Add an evaluation chunk's loss, weighted by its tokens, to the evaluation's sum.

        ``logits``: ``(b, T, V)``; ``ids``: ``(b, T)`` (a fused array: ``(K, ...)`` both). The
        sum is plain's: float64, each chunk's loss times its ``b * (T - 1)`` tokens.
        """
        tokens = ids.shape[self.row_dim] * (ids.shape[self.row_dim + 1] - 1)
        loss = self._lm_loss(logits, ids).detach().double().cpu()
        self._eval_sum = self._eval_sum + loss * tokens
        self._eval_tokens += tokens

    def _reset_eval(self) -> None:
        """Start an evaluation's loss sum (it takes each member's shape at the first chunk)."""
        self._eval_sum = torch.zeros((), dtype=torch.float64)
        self._eval_tokens = 0

    def _train_losses(self) -> list[float]:
        """Each member's train loss of the step, taken off the record (:attr:`_losses`).

        One microbatch's loss, or the microbatches' losses weighted by their shares of the
        minibatch's rows (``math.fsum``): plain's loss of the whole minibatch.
        """
        losses, self._losses = self._losses, []
        fractions = [fraction for _, fraction in losses]
        return [
            values[0] if len(values) == 1
            else math.fsum(v * w for v, w in zip(values, fractions, strict=True))
            for values in zip(*(values for values, _ in losses), strict=True)
        ]

    def _eval_losses(self) -> list[float]:
        """Each member's evaluation loss: its token-weighted mean over the evaluation blocks.

        The sum is dropped: made under the device's meter, the job holds nothing there
        between tasks.
        """
        sums = self._eval_sum.reshape(-1).tolist()
        self._eval_sum = torch.zeros(0, dtype=torch.float64)
        return [total / self._eval_tokens for total in sums]

    @abstractmethod
    def _dropout_off(self, shard: int | None) -> contextlib.AbstractContextManager[None]:
        """The layers of ``shard`` (``None``: every layer) in evaluation mode, then back."""

    def _eval_guard(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """What an evaluation task runs in besides :meth:`_dropout_off` (nothing by default)."""
        del device
        return contextlib.nullcontext()

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
    # ------------------------------------------------------------------ shard algorithms
    # One member or K: what differs is behind the hooks after them (rows on :attr:`row_dim`,
    # the tensors a shard computes with by :data:`TensorKey`, a loss of one member or K).

    def _step_due(self, task: ShardTask) -> bool:
        """Whether ``task`` is its step's first (it draws the minibatch and the dropout)."""
        first: TaskKind = "forward" if len(self.plan.shards) > 1 else "backward"
        return task.phase == "train" and task.kind == first and task.shard == 0

    def _trains_nothing(self, shard: int) -> bool:
        """A frozen first shard (a LoRA base's embeddings): its backward has no gradient."""
        return shard == 0 and len(self.plan.shards) > 1 and not self.owned_keys(0)

    def _forward_shard(self, shard: int, device: Device) -> None:
        """A training forward task's compute: each microbatch's output to the host boundary.

        Under the memory plan (:meth:`_forward_planned`, its passes kept for the backward
        task) or without grad (Hydra's recompute in the backward task).
        """
        if self.memory_plan is not None:
            self._forward_planned(shard, device)
            return
        tensors = self._task_tensors()
        for mb, rows in enumerate(self.microbatches(shard)):
            x = self._input(shard, rows, device)
            y = self._forward_rows(shard, mb, rows, x, device, tensors)
            del x
            self._store(self._acts, shard + 1, rows, self._batch_size, y, device,
                        row_dim=self.row_dim)
            del y

    def _forward_rows(self, shard: int, mb: int, rows: slice, x: torch.Tensor, device: Device,
                      tensors: Mapping[TensorKey, torch.Tensor], rng: JobRng | None = None,
                      overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                      ) -> torch.Tensor:
        """A microbatch's forward of ``shard`` on ``tensors`` (see :meth:`forward_pass`)."""
        with torch.no_grad(), self._pass_mode(shard, mb, rows, True, device, rng=rng):
            return self._run_shard(shard, tensors, x, rows, device, overrides)

    def _eval_shard(self, shard: int, device: Device) -> None:
        """An evaluation task's compute: plain's evaluation batches through the shard.

        Each chunk's output goes to the host boundary of every evaluation block; the last
        shard adds each chunk's loss to the evaluation's sum (:meth:`add_eval_loss`).
        """
        last = shard == len(self.plan.shards) - 1
        ids = self.eval_ids()
        num_rows = int(ids.shape[self.row_dim])
        tensors = self._task_tensors()
        with self._evaluating_shard(shard, device), torch.no_grad():
            for rows in self.eval_chunks(shard, num_rows):
                index = self._row_index(rows)
                host = ids if shard == 0 else self._eval_acts[shard]
                x = self.to_device(device, host[index])
                with metering(device):
                    y = self._run_shard(shard, tensors, x, None, device)
                    if last:
                        labels = x if shard == 0 else self.to_device(device, ids[index])
                        self.add_eval_loss(y, labels)
                        del labels
                    else:
                        self._store(self._eval_acts, shard + 1, rows, num_rows, y, device,
                                    row_dim=self.row_dim)
                del x, y
        self._eval_acts.pop(shard, None)

    def _backward_shard(self, shard: int, device: Device) -> None:
        """A training backward task's compute: every microbatch's backward, then the update.

        Under the memory plan (:meth:`_backward_planned`) or Hydra's recompute of the shard
        from its host boundary, each microbatch's gradient of its input stored for the shard
        before; then :meth:`_after_backward`.
        """
        last = shard == len(self.plan.shards) - 1
        microbatches = [] if self._trains_nothing(shard) else self.microbatches(shard)
        if self.memory_plan is not None and self._planned_backward(shard, device):
            if microbatches:
                self._backward_planned(shard, device)
            else:
                self._drop_passes(shard)
        else:
            weight = len(microbatches) > 1
            tensors = self._task_tensors()
            for mb, rows in enumerate(microbatches):
                x = self._input(shard, rows, device)
                target: Callable[[], torch.Tensor]
                if not last:
                    target = functools.partial(self.to_device, device,
                                               self._grads[shard][self._row_index(rows)])
                elif shard == 0:  # the only shard: its input is the labels
                    target = functools.partial(torch.Tensor.detach, x)
                else:
                    target = functools.partial(self.to_device, device,
                                               self._labels()[self._row_index(rows)])
                grad = self._backward_rows(shard, mb, rows, x, target, device, weight, tensors)
                if grad is not None:
                    self._store(self._grads, shard - 1, rows, self._batch_size, grad, device,
                                row_dim=self.row_dim)
                del x, grad
        self._acts.pop(shard, None)
        self._grads.pop(shard, None)
        with metering(device):
            self._after_backward(shard, self._task_tensors(), device)

    def _backward_rows(self, shard: int, mb: int, rows: slice, x: torch.Tensor,
                       target: Callable[[], torch.Tensor], device: Device, weight: bool,
                       tensors: Mapping[TensorKey, torch.Tensor], rng: JobRng | None = None,
                       overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                       ) -> torch.Tensor | None:
        """A microbatch's backward of ``shard`` on ``tensors`` (see :meth:`backward_pass`)."""
        last = shard == len(self.plan.shards) - 1
        if shard > 0:
            x.requires_grad_(True)
        with self._pass_mode(shard, mb, rows, last, device, rng=rng):
            y = self._run_shard(shard, tensors, x, rows, device, overrides)
        with metering(device):
            if last:
                loss_fn = self._loss_fn(target(), rows, weight)
                loss = loss_fn(y, True)
                del y, loss_fn
                loss.backward()
                del loss
            else:
                grad = target()
                if y.requires_grad:  # else a frozen first shard (LoRA's embeddings)
                    torch.autograd.backward(y, grad)
                del y, grad
        if shard == 0:
            return None
        assert x.grad is not None
        return x.grad

    def _after_backward(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                        device: Device) -> None:
        """Send tied-gradient contributions, then update the owned parameters (jit update).

        A parameter belongs to the first shard using it: a later shard sends its gradient
        contribution to the host, the owner adds it. With ``grad_clip``, the owned gradients'
        norms go to the host; a shard ``> 0`` parks its gradients (its update is deferred),
        shard 0, the step's last backward, makes the clip coefficient and updates.
        """
        owned = self.owned_keys(shard)
        owns = set(owned)
        for key in self.shard_keys(shard):
            if key in owns or not self.trainable(key):
                continue
            param = tensors[key]
            assert param.grad is not None
            grad = param.grad
            earlier = self._contrib.get(key)
            if earlier is not None:
                grad = grad + self.to_device(device, earlier)
            self._contrib[key] = self.to_host(device, grad, earlier)
            param.grad = None
            del grad
        for key in owned:
            contribution = self._contrib.pop(key, None)
            if contribution is not None:
                owned_grad = tensors[key].grad
                assert owned_grad is not None
                owned_grad.add_(self.to_device(device, contribution))
        if not self.clips:
            if self.updates(shard):
                self._jit_update(shard, tensors, self._schedule(), device)
            return
        for key, norm in self._grad_norms(shard, tensors).items():
            self._norms[key] = self.to_host(device, norm)
        if shard > 0:
            self._park_grads(shard, tensors, device)
            return
        # back on the device uncounted: the cost model's promote volume has no such copy
        norms = {key: norm.to(device.torch_device) for key, norm in self._norms.items()}
        self._norms.clear()
        self.defer_clip(self.clip_coefficient(norms, device), device)
        del norms
        if self.updates(shard):  # a LoRA base's first shard owns nothing
            self._jit_update(shard, tensors, self._schedule(), device,
                             self._device_clip_coef(device))

    def _grad_norms(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                    ) -> dict[TensorKey, torch.Tensor]:
        """Each owned gradient's 2-norm (0-dim; a fused array's per member ``(K,)``)."""
        owned = self.owned_keys(shard)
        if not owned:
            return {}
        grads: list[torch.Tensor] = []
        for key in owned:
            grad = tensors[key].grad
            assert grad is not None
            grads.append(grad)
        return dict(zip(owned, self._norms_of(grads), strict=True))

    def _park_grads(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                    device: Device) -> None:
        """Defer the shard's clipped update: its owned gradients to the host."""
        if not self.updates(shard):
            return
        for key in self.owned_keys(shard):
            param = tensors[key]
            assert param.grad is not None
            self._host_grads[key] = self.to_host(device, param.grad, self._host_grads.get(key))
            param.grad = None
        self._pending[shard] = self._schedule()

    def _device_clip_coef(self, device: Device) -> torch.Tensor:
        """The step's clip coefficient (0-dim; per member ``(K,)``) copied to ``device``."""
        assert self._clip_coef is not None
        return self.to_device(device, self._clip_coef)

    def _apply_pending(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                       device: Device) -> None:
        """Apply the clipped update deferred from the shard's last backward (``grad_clip``).

        The optimizer state goes home after it: the task computes on.
        """
        schedule = self._pending.pop(shard)
        with metering(device):
            for key in self.owned_keys(shard):
                tensors[key].grad = self.to_device(device, self._host_grads[key])
            self._jit_update(shard, tensors, schedule, device, self._device_clip_coef(device))
        self.demote_state(shard, device)

    @abstractmethod
    def _task_tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The tensors the job computes with, by key: every :data:`TensorKey` of every shard.

        The same tensors in every shard task and pipeline pack; their data is the installed
        device copy (:meth:`install`), or :meth:`_idle_data` of the host copy when none is.
        """

    @abstractmethod
    def _idle_data(self, host: torch.Tensor) -> torch.Tensor:
        """What a tensor's data is while no copy is installed, given its host copy.

        A single job's module holds its host copies (the tensor's data is ``host``); a fused
        array's stacked host tensors live apart (an empty tensor).
        """

    @abstractmethod
    def _run_shard(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                   x: torch.Tensor, rows: slice | None, device: Device,
                   overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """The shard's forward on ``x``: of the step's microbatch ``rows``, or evaluation.

        ``x``: ``(b, ...)`` (a fused array: ``(K, b, ...)``); ``rows``: ``None`` for an
        evaluation chunk (no dropout); ``overrides`` as in :meth:`forward_pass`.
        """

    @contextlib.contextmanager
    def _evaluating_shard(self, shard: int, device: Device) -> Iterator[None]:
        """An evaluation task's mode (dropout off); shard 0 resets the evaluation's sum."""
        if shard == 0:
            self._reset_eval()
        with self._dropout_off(shard), self._eval_guard(device):
            yield

    @abstractmethod
    def _norms_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The 2-norm of each gradient: 0-dim, a fused array's per member ``(K,)``."""

    @abstractmethod
    def _schedule(self) -> Any:
        """What an update of this step needs besides the gradients (its step, or lrs)."""

    def _jit_update(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                    schedule: Any, device: Device, clip_coef: torch.Tensor | None = None) -> None:
        """Harmony's just-in-time update of the shard's owned parameters in ``tensors``.

        Promotes the optimizer state unless it is there (:meth:`promote_state`), notes the
        owned parameters as changed (written back when uninstalled: :meth:`uninstall`), and
        steps (:meth:`_update`). The state goes home with the shard's demote, or stays with the
        shard when it is kept resident for a next task that updates it (a job of one shard:
        the next step; a pipeline's pack: the whole run).
        """
        self.promote_state(shard, device)
        self._changed.update(self.owned_keys(shard))
        self._update(shard, tensors, schedule, device, clip_coef)

    @abstractmethod
    def _update(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor], schedule: Any,
                device: Device, clip_coef: torch.Tensor | None = None) -> None:
        """The optimizer step of the shard's owned parameters, its state on ``device`` already.

        ``schedule``: :meth:`_schedule` of the update's step; ``clip_coef``: the clip
        coefficient on ``device`` (:meth:`clip_coefficient`), multiplied into the gradients
        first. The gradients are dropped after it.
        """
