"""The chain of shard tasks every spilled job runs, for one member or a fused array of K.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device as a chain of **shard tasks**: per optimizer step, ``forward`` of shards ``0..S-2`` and
``backward`` (with Harmony's just-in-time update) of ``S-1..0``, then evaluation or deferred
update tasks (:func:`after_step_phase`). :class:`ShardChain` is what every such job shares,
whatever it trains: one member (:class:`~sweepmaster.runtime.training.spill.SpilledJob`, the
module run directly) or K stacked members
(:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`, ``vmap`` over members):

* the task sequence and the task API a scheduler drives (:meth:`ShardChain.next_task`,
  :meth:`ShardChain.peek_task`), with the plan's estimated seconds and peaks
  (:meth:`ShardChain.planned_peak_bytes`, the one estimate prefetch decisions read);
* Hydra's double buffering (:meth:`ShardChain.prefetch`): the next task's shard is promoted in
  the background (a side stream on CUDA, a copy thread on virtual devices) while the current
  task computes, or while another job's task runs on the device;
* the host side of boundaries: microbatches, boundary activations and gradients demoted into
  host buffers of the whole minibatch, every copy counted in ``swap_bytes``.

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan

__all__ = ["ShardChain", "ShardTask", "TaskKind", "TaskPhase", "after_step_phase", "metering"]

TaskKind = Literal["forward", "backward"]
TaskPhase = Literal["train", "eval", "update"]

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


def metering(device: Device) -> contextlib.AbstractContextManager[None]:
    """The device meter's counting context (a no-op on a device without a meter)."""
    meter = device.meter
    return meter.metering() if meter is not None else contextlib.nullcontext()


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


class ShardChain(ABC):
    """What every spilled job shares: its task chain, prefetch, and host boundaries.

    Not thread-safe: one task at a time (any thread). Subclasses build their state, then call
    ``super().__init__``; they provide :meth:`_task_sequence` (from :meth:`_chain`),
    :meth:`_promoted_hosts` and :meth:`_may_prefetch`, and run the tasks.

    Args:
        plan: The job plan (shards, microbatch sizes, seconds, peaks); its device's type
            (``cpu`` or ``cuda``) is where the tasks run.
        batch_size: Rows of a training minibatch (B).
        memory_plan: The keep / swap / recompute plan of the activations (mu-TWO), or ``None``
            for Hydra's recompute of every activation.

    Attributes:
        swap_bytes: Bytes moved between host and device so far (promotes, demotes, boundaries).
        p2p_bytes: Bytes moved device -> device so far (pipelined steps' boundaries).
        num_promotes: Shard promotions so far.
        num_demotes: Shard demotions so far.
        num_prefetches: Shards promoted ahead of their task so far.
        peak_device_bytes: The highest metered device peak of a task so far.
    """

    def __init__(self, plan: JobPlan, batch_size: int,
                 memory_plan: MemoryPlan | None = None) -> None:
        self.plan = plan
        self.memory_plan = memory_plan
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
        self.swap_bytes = 0
        self.p2p_bytes = 0
        self.num_promotes = 0
        self.num_demotes = 0
        self.num_prefetches = 0
        self.peak_device_bytes = 0
        self._batch_size = batch_size
        self._device_name = plan.device
        self._pending: dict[int, Any] = {}  # shard -> its deferred clipped update (grad_clip)
        self._future = deque[ShardTask]()
        self._first_seq = 0  # ``seq`` of the first task of the current task sequence
        self._num_issued = 0  # tasks the sequences have given so far
        self._tasks = self._task_sequence()
        self._prefetched: dict[int, tuple[str, concurrent.futures.Future[Any]]] = {}
        self._kept: tuple[int, Device] | None = None  # (shard, device) left resident
        #: Tasks whose shard was resident already (kept by the task before; no promote).
        self.num_resident_hits = 0
        #: Prefetches (of shards, and a memory plan's early fetches of activations) dropped
        #: because the device had no memory for them (:meth:`prefetch`).
        self.num_prefetch_refusals = 0

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

    @abstractmethod
    def run(self, task: ShardTask, device: Device, *, keep: bool = False) -> None:
        """Run the next task on ``device``: promote, compute (and update), demote.

        With ``keep``, a shard whose next task is of the same shard stays resident on
        ``device`` instead of being demoted, until :meth:`evict` (the executor passes it always:
        its residency cache evicts the shard when another task needs the room).

        Raises:
            ValueError: ``task`` is not the next task.
            torch.OutOfMemoryError: The device ran out of memory.
        """

    def settle(self, device: Device) -> None:  # noqa: B027
        """Hand on what has nothing left to train once :meth:`next_task` is ``None``."""

    def planned_peak_bytes(self, task: ShardTask) -> int:
        """Planned device peak of ``task`` (bytes): the one estimate prefetch decisions read.

        A training task the memory plan covers peaks at the memory plan's estimate (its kept
        and swapped activations); any other task at the job plan's (Hydra's full recompute).
        The last shard's evaluation pass holds its logits like its backward.
        """
        shard = self.plan.shards[task.shard]
        if self.memory_plan is not None and task.phase == "train":
            planned = self.memory_plan.shards[task.shard]
            return (planned.forward_peak_bytes if task.kind == "forward"
                    else planned.backward_peak_bytes)
        if task.phase == "eval" and task.shard == len(self.plan.shards) - 1:
            return shard.backward_peak_bytes
        return shard.forward_peak_bytes if task.kind == "forward" else shard.backward_peak_bytes

    @abstractmethod
    def _task_sequence(self) -> Iterator[ShardTask]:
        """Every task of the job in order (ending a job early only truncates it)."""

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

        A shard kept resident there stays: the executor's residency cache evicts it
        (:meth:`evict`) when another task needs the room.
        """
        for seq in [seq for seq, (name, _) in self._prefetched.items() if name == device.name]:
            self._prefetched.pop(seq)[1].result()

    def release(self) -> None:
        """Free what the job holds on devices between its tasks; it cannot go on after this.

        Here: the shard kept resident (written back), and the shards prefetched onto any device
        once their background copies end (failed or not). Called when the job fails or leaves
        its executor; the host copies stay.
        """
        self.evict()
        for _, future in self._prefetched.values():
            with contextlib.suppress(Exception):
                future.result()
        self._prefetched.clear()

    @abstractmethod
    def _promoted_hosts(self, shard: int) -> list[torch.Tensor]:
        """The host tensors a promote of ``shard`` copies to a device, in promote order."""

    @abstractmethod
    def _may_prefetch(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether ``task`` (after ``current``) may be promoted while ``current`` runs."""

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
            self._device_name = device.name
            return True
        self.evict()
        return False

    def _state_kept(self, shard: int) -> bool:
        """Whether the kept ``shard``'s optimizer state stays on its device with it."""
        return False

    @abstractmethod
    def _keep(self, shard: int, device: Device) -> None:
        """Leave ``shard`` resident on ``device`` for the next task (its gradients dropped)."""

    @abstractmethod
    def _write_back(self, shard: int, device: Device) -> None:
        """Demote the kept ``shard`` from ``device``: write back what changed, free the rest."""

    def _prefetch_activations(self, current: ShardTask, task: ShardTask,  # noqa: B027
                              device: Device) -> None:
        """Fetch activations ``task`` needs during ``current`` (a memory plan's early fetch)."""

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

    # ------------------------------------------------------------------ host boundaries

    def _moved(self, device: Device, num_bytes: int) -> None:
        """Count ``num_bytes`` moved between the host and ``device`` in :attr:`swap_bytes`.

        Nothing moves to or from the host CPU itself (its transfers are in place).
        """
        if not device.transfer.in_place:
            self.swap_bytes += num_bytes

    def _to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        self._moved(device, host.nbytes)
        return device.to_device(host, non_blocking=host.is_pinned())

    def _to_host(self, device: Device, tensor: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        self._moved(device, tensor.nbytes)
        return device.to_host(tensor, out)

    def _microbatches(self, shard: int, num_rows: int | None = None) -> list[slice]:
        """Row slices of ``shard``'s microbatches over a minibatch (or ``num_rows`` rows)."""
        size = self.plan.shards[shard].microbatch_size
        rows = self._batch_size if num_rows is None else num_rows
        return [slice(lo, min(lo + size, rows)) for lo in range(0, rows, size)]

    def _eval_chunks(self, shard: int, num_rows: int) -> list[slice]:
        """Plain's evaluation batches of ``batch_size`` rows, in ``shard``'s microbatches."""
        size = self.plan.shards[shard].microbatch_size
        return [
            slice(lo, min(lo + size, hi))
            for start in range(0, num_rows, self._batch_size)
            for hi in [min(start + self._batch_size, num_rows)]
            for lo in range(start, hi, size)
        ]

    def _store(self, boundaries: dict[int, torch.Tensor], shard: int, rows: slice,
               num_rows: int, tensor: torch.Tensor, device: Device, *,
               row_dim: int = 0) -> None:
        """Demote a microbatch's boundary into the host buffer of the whole batch.

        ``tensor`` is ``(b, ...)`` (``row_dim=0``) or a fused array's ``(K, b, ...)``
        (``row_dim=1``); the buffer, made at the first microbatch, holds ``num_rows`` rows.
        """
        buffer = boundaries.get(shard)
        if buffer is None:
            shape = (*tensor.shape[:row_dim], num_rows, *tensor.shape[row_dim + 1:])
            meter = device.meter
            with meter.unmetered() if meter is not None else contextlib.nullcontext():
                buffer = torch.empty(shape, dtype=tensor.dtype,
                                     pin_memory=device.pin_host_memory)
            boundaries[shard] = buffer
        index = (slice(None),) * row_dim + (rows,)
        self._to_host(device, tensor.detach(), buffer[index])

    def _promote_hosts(self, task: ShardTask, device: Device,
                       hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``task``'s shard: prefetched ones, or promoted now (counted)."""
        copies = self._take_prefetched(task, device)
        if copies is None:
            copies = device.transfer.promote(list(hosts))
        self._moved(device, sum(copy.nbytes for copy in copies))
        self.num_promotes += 1
        self._device_name = device.name
        return copies
