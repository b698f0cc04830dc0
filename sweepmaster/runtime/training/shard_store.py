"""Where a spilled job's shards live between and ahead of its tasks: promote, prefetch, keep.

:class:`ShardStore` is the part of a spilled job that owns its shards' residency. A shard task
promotes its shard's tensors to a device and demotes them after (:meth:`ShardStore.promote`,
:meth:`ShardStore.demote`): the device copies are installed as the data of the tensors the job
computes with and what an update changed is written back (:meth:`ShardStore.install`,
:meth:`ShardStore.uninstall`); a shard's optimizer state moves in one batch
(:meth:`ShardStore.promote_state`, :meth:`ShardStore.demote_state`). Around that:

* Hydra's double buffering (Nagrecha & Kumar 2022, :meth:`ShardStore.prefetch`): the next
  task's shard is promoted in the background (a side stream on CUDA, a copy thread on virtual
  devices) while the current task computes, or while another job's task runs on the device;
  with a memory plan, the backward task's first fetch of activations too;
* the job's part of the executor's residency cache: a shard whose next task is its own stays on
  its device (:meth:`ShardStore.resident_shard`, :meth:`ShardStore.resident_bytes`) until
  :meth:`ShardStore.evict` writes it back.

The job gives it its tensors (:class:`ShardTensors`: which tensors each shard promotes, their
host copies, where its optimizer state lives). Every copy is counted in the boundaries'
``swap_bytes``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import DeviceTransfer, flat_buffer, settle_all
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import HostBoundaries
from sweepmaster.runtime.training.host_update import HostUpdates
from sweepmaster.runtime.training.planned import PlannedPasses
from sweepmaster.runtime.training.tasks import ShardTask, StateSlot, TaskChain, TensorKey

__all__ = ["ShardStore", "ShardTensors"]


class ShardTensors(Protocol):
    """What a job gives its shard store: its tensors by key, their host copies, its state."""

    def shard_keys(self, shard: int) -> list[TensorKey]:
        """The tensors a promote of ``shard`` copies to a device, in promote order."""
        ...

    def trainable(self, key: TensorKey) -> bool:
        """Whether the tensor ``key`` gets gradients."""
        ...

    def host_tensor(self, key: TensorKey) -> torch.Tensor:
        """The host copy of ``key`` (stacked ``(K, ...)`` in a fused array)."""
        ...

    def task_tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The tensors the job computes with, by key: every :data:`TensorKey` of every shard.

        The same tensors in every shard task and pipeline pack; their data is the installed
        device copy (:meth:`ShardStore.install`), or :meth:`idle_data` of the host copy when
        none is.
        """
        ...

    def idle_data(self, host: torch.Tensor) -> torch.Tensor:
        """What a tensor's data is while no copy is installed, given its host copy.

        A single job's module holds its host copies (the tensor's data is ``host``); a fused
        array's stacked host tensors live apart (an empty tensor).
        """
        ...

    def state_slots(self, shard: int) -> list[StateSlot]:
        """Where the optimizer state tensors of ``shard`` that move with it live, in order.

        Each ``(container, key)``: ``container[key]`` is one state tensor (its host copy, or
        its device copy between :meth:`ShardStore.promote_state` and
        :meth:`ShardStore.demote_state`); a step may add slots while the state is on the
        device (its first step makes the state there).
        """
        ...

    def updates(self, shard: int) -> bool:
        """Whether ``shard`` has an optimizer (it owns trainable parameters)."""
        ...


class ShardStore:
    """A spilled job's shards on devices: promote and demote, prefetch, keep and evict.

    Not thread-safe: one task at a time (any thread).

    Args:
        plan: The job plan (shards' bytes, the budget and prefetch rule).
        memory_plan: The keep / swap / recompute plan of the activations, or ``None``.
        tensors: The job's tensors (:class:`ShardTensors`).
        boundaries: The job's host boundaries: every copy is counted in their ``swap_bytes``.
        passes: The job's planned passes: their activations fetched early, freed with the job.
        tasks: The job's task sequence (planned peaks of its tasks).
        prefetch_within_step: Prefetch only the task right after the current one, within one
            training step (a fused array: members leave the array between steps); else any.

    Attributes:
        num_promotes: Shard promotions so far.
        num_demotes: Shard demotions so far.
        num_prefetches: Shards promoted ahead of their task so far.
        num_resident_hits: Tasks whose shard was resident already (kept by the task before;
            no promote).
        num_prefetch_refusals: Prefetches (of shards, and a memory plan's early fetches of
            activations) dropped because the device had no memory for them
            (:meth:`prefetch`).
        device_name: Devices the job ran on last (a pipeline's: every device's name,
            comma-separated).
        fresh_state: Shards whose optimizer state is all zeros still (made before any update):
            its first promote copies nothing.
    """

    def __init__(self, plan: JobPlan, memory_plan: MemoryPlan | None, *, tensors: ShardTensors,
                 boundaries: HostBoundaries, passes: PlannedPasses, tasks: TaskChain,
                 prefetch_within_step: bool = False) -> None:
        self.plan = plan
        self.memory_plan = memory_plan
        self._job = tensors
        self._boundaries = boundaries
        self._passes = passes
        self._tasks = tasks
        self._within_step = prefetch_within_step
        self.num_promotes = 0
        self.num_demotes = 0
        self.num_prefetches = 0
        self.num_resident_hits = 0
        self.num_prefetch_refusals = 0
        self.device_name = plan.device
        #: task seq -> (device name, the copy filling its shard's tensors there)
        self._prefetched: dict[int, tuple[str, DeviceTransfer]] = {}
        self._kept: tuple[int, Device] | None = None  # (shard, device) left resident
        #: key -> the host copy of an installed tensor (:meth:`install`): its write-back target
        self._host_data: dict[TensorKey, torch.Tensor] = {}
        #: the installed parameters an update changed since they were installed or written back
        self._changed: set[TensorKey] = set()
        #: shard -> its optimizer state's slots and their host copies while it is on a device
        self._device_state: dict[int, list[tuple[StateSlot, torch.Tensor]]] = {}
        self.fresh_state: set[int] = set()
        #: the shards' optimizer steps on the host, when the plan updates there (ZeRO-Offload)
        self.host_updates = HostUpdates(tensors, boundaries.moved)

    def installed_host(self, key: TensorKey) -> torch.Tensor | None:
        """The host copy of the installed tensor ``key`` (``None``: it is not installed)."""
        return self._host_data.get(key)

    def mark_changed(self, keys: Sequence[TensorKey]) -> None:
        """Note that an update changed the installed ``keys``: they are written back."""
        self._changed.update(keys)

    # ------------------------------------------------------------------ promote and demote

    def promote(self, task: ShardTask, device: Device) -> None:
        """Make ``task``'s shard resident on ``device``: a kept one, prefetched or promoted.

        Prefetched or promoted copies are installed (:meth:`install`) as the data of the
        tensors the shard computes with (:meth:`ShardTensors.task_tensors`).
        """
        if not self._take_kept(task, device):
            copies = self._promote_hosts(task, device, self._promoted_hosts(task.shard))
            self.install(self._job.shard_keys(task.shard), copies)

    def demote(self, shard: int, device: Device) -> None:
        """Write back what the shard's updates changed, its optimizer state too; free the copies.

        Buffers are never written back: layers that update buffers in their forward (batch-norm
        running statistics) are not supported.
        """
        self.uninstall(self._job.shard_keys(shard), device)
        self.demote_state(shard, device)
        self.num_demotes += 1
        self.host_updates.released(shard)  # its host step (if due) starts now

    def install(self, keys: Sequence[TensorKey], copies: Sequence[torch.Tensor]) -> None:
        """Make ``copies`` (on a device) the data of the tensors ``keys`` the job computes with.

        The tensors are :meth:`ShardTensors.task_tensors`'s (the same ones in every task and
        pipeline pack: a graph a memory plan keeps from a forward task names them); their host
        copies (:meth:`ShardTensors.host_tensor`) are remembered as the targets of the
        write-back.
        """
        tensors = self._job.task_tensors()
        for key, copy in zip(keys, copies, strict=True):
            self._host_data[key] = self._job.host_tensor(key)
            tensors[key].data = copy

    def installed(self, key: TensorKey) -> torch.Tensor:
        """The installed tensor ``key`` (its ``.grad`` holds the gradient after a backward)."""
        return self._job.task_tensors()[key]

    def uninstall(self, keys: Sequence[TensorKey], device: Device) -> None:
        """Put the host copies of ``keys`` back, writing back what an update changed.

        The changed parameters go home in one batch, asynchronously on CUDA: the next reader
        of the host copies waits for it (a promote, or :meth:`settle_hosts`). Keys that are
        not installed (a promote that failed before installing them) are skipped; gradients
        are dropped.
        """
        tensors = self._job.task_tensors()
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
            tensor.data = self._job.idle_data(host)
            tensor.grad = None
        if changed:
            self._boundaries.moved(device, sum(t.nbytes for t in changed))
            device.transfer.demote(changed, hosts)

    def write_back_tensor(self, key: TensorKey, device: Device) -> None:
        """Write the installed ``key`` back to its host copy now if an update changed it.

        Waited for: the tensor stays installed, and its next update (in place) must not race
        the copy.
        """
        if key not in self._changed:
            return
        self._changed.discard(key)
        tensor = self._job.task_tensors()[key]
        self._boundaries.moved(device, tensor.nbytes)
        device.transfer.demote([tensor.data], [self._host_data[key]])[1].wait()

    def settle_hosts(self) -> None:
        """Make the host copies whole before they are read (a checkpoint, a result, a member).

        Writes back the shard kept resident (:meth:`evict`) and waits for the demotes still
        writing host tensors, every device's
        (:func:`~sweepmaster.runtime.devices.transfer.settle_all`).
        """
        self.evict()
        self.host_updates.wait_all()
        settle_all()

    def state_on_device(self, shard: int) -> bool:
        """Whether the shard's optimizer state is on a device (:meth:`promote_state`)."""
        return shard in self._device_state

    def promote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state to ``device`` (nothing if there or no optimizer).

        One batch through the device's transfer engine, counted in ``swap_bytes``; each tensor
        of :meth:`ShardTensors.state_slots` is replaced by its device copy, its host copy kept
        for :meth:`demote_state`. The state stays on the device while the shard is resident (kept
        for a next task that updates it, or a pipeline's pack) and goes home with the shard's
        demote. A state still all zeros (made flat before any update: :attr:`fresh_state`) is
        made on the device instead, nothing copied or counted (as a first step would make it).

        Raises:
            torch.OutOfMemoryError: The state does not fit the device.
        """
        if not self._job.updates(shard) or shard in self._device_state:
            return
        slots = self._job.state_slots(shard)
        hosts = [container[key] for container, key in slots]
        if shard in self.fresh_state:  # zeros: made on the device, nothing is copied
            self.fresh_state.discard(shard)
            if device.transfer.in_place:  # the host copies are the device's
                copies = device.transfer.promote(hosts)
            else:
                copies = device.transfer.allocate(hosts)
                flat = flat_buffer(copies)
                if copies:  # none: SGD without momentum
                    torch._foreach_zero_([flat] if flat is not None else copies)
        else:
            self._boundaries.moved(device, sum(t.nbytes for t in hosts))
            copies = device.transfer.promote(hosts)
        for (container, key), copy in zip(slots, copies, strict=True):
            container[key] = copy
        self._device_state[shard] = list(zip(slots, hosts, strict=True))

    def demote_state(self, shard: int, device: Device) -> None:
        """Copy the shard's optimizer state on ``device`` back to the host, if it is there.

        One batch, counted in ``swap_bytes``, asynchronous on CUDA (the next reader of the
        host copies waits for it: a promote, or :meth:`settle_hosts`). A state tensor that a
        first step made on the device (no host copy yet) gets a new host tensor.
        """
        homes = self._device_state.pop(shard, None)
        if homes is None:
            return
        # by its slot's identity: the homes hold the containers, so their ids stay unique
        host_of = {(id(container), key): host for (container, key), host in homes}
        slots = self._job.state_slots(shard)
        if not slots:
            return
        values = [container[key] for container, key in slots]
        self._boundaries.moved(device, sum(t.nbytes for t in values))
        hosts, _ = device.transfer.demote(
            values, [host_of.get((id(container), key)) for container, key in slots])
        for (container, key), host in zip(slots, hosts, strict=True):
            container[key] = host

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, task: ShardTask | None, current: ShardTask | None, device: Device, *,
                 deferred: Callable[[int], bool], headroom_bytes: int | None = None) -> None:
        """Start promoting ``task``'s shard to ``device`` in the background.

        Two cases of Hydra's double buffering:

        * ``task`` follows the job's next task ``current``: only when
          :meth:`_may_prefetch` allows it (the next task's planned peak plus this shard fits the
          budget, and the two shards share no parameter the current task updates);
        * ``task`` is ``current`` while the job waits (another job's task runs on
          ``device``): only when its parameters fit ``headroom_bytes``, the bytes the running
          task leaves free on ``device``.

        A shard whose clipped update is deferred (``deferred(shard)``) is never prefetched (its
        update needs its
        gradients and optimizer state beside it). The task's run then takes the copies (or drops
        them if it runs on another device). A prefetch the device has no memory for (planned
        peaks are estimates; on CUDA, fragmentation) is dropped, not raised: the task promotes
        its shard when it runs (:attr:`num_prefetch_refusals` counts them). On the host CPU
        (its transfers are in place) there is nothing to prefetch.
        """
        if (task is None or current is None or self._is_kept(task.shard)
                or device.transfer.in_place):
            return
        if task.seq != current.seq:
            self._prefetch_activations(current, task, device)
        if task.seq in self._prefetched or deferred(task.shard):
            return
        if task.seq == current.seq:
            if headroom_bytes is None or self.plan.shards[task.shard].param_bytes > headroom_bytes:
                return
        elif not self._may_prefetch(current, task):
            return
        hosts = self._promoted_hosts(task.shard)
        # on CUDA, allocated and copied on a stream of their own: the copy waits for no compute
        # (the memory is new to that stream) and the task's stream waits for the copy's event
        stream = (torch.cuda.stream(torch.cuda.Stream(device.torch_device))
                  if device.torch_device.type == "cuda" else contextlib.nullcontext())
        with stream:
            try:  # allocated now, as an allocator would; copied in the background
                copies = device.transfer.allocate(hosts)
            except torch.OutOfMemoryError:  # an estimate was short: the task promotes it itself
                self.num_prefetch_refusals += 1
                return
            copying = device.transfer.copy_in(copies, hosts, background=True)  # one batch
        self._prefetched[task.seq] = (device.name, copying)
        self.num_prefetches += 1

    def discard_prefetch(self, device: Device) -> None:
        """Drop what was prefetched onto ``device`` (it runs something else now), freeing it.

        Parameters and a memory plan's activations fetched early alike; the host copies stay.
        A shard kept resident there stays: the executor's residency cache evicts it
        (:meth:`evict`) when another task needs the room.
        """
        self.drop_prefetched(lambda seq, name: name == device.name)
        self._passes.unfetch_early(device)

    def release(self) -> None:
        """Free what the job holds on devices between its tasks; it cannot go on after this.

        Here: the shard kept resident (written back), the shards prefetched onto any device
        once their background copies end (failed or not), and the activations a memory plan
        keeps or fetched early for a backward task. Called when the job fails or leaves its
        executor; the host copies stay.
        """
        self.evict()
        self.host_updates.drop()
        self.drop_prefetched()
        self._passes.release()

    @property
    def prefetching(self) -> bool:
        """Whether copies prefetched for tasks are held (a task sequence made again has none)."""
        return bool(self._prefetched)

    def _promoted_hosts(self, shard: int) -> list[torch.Tensor]:
        """The host tensors a promote of ``shard`` copies to a device, in promote order.

        Host optimizer steps still writing them end first (:meth:`HostUpdates.wait`).
        """
        keys = self._job.shard_keys(shard)
        self.host_updates.wait(keys)
        return [self._job.host_tensor(key) for key in keys]

    def _may_prefetch(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether ``task`` (after ``current``) may be promoted while ``current`` runs.

        Another shard within :meth:`_prefetch_window`, sharing no parameter with the current
        task's shard (a tied one: the current task updates it), and the current task's planned
        peak plus the shard's parameters fit the budget by the rule its plan chose its
        prefetches by (:meth:`~sweepmaster.runtime.planning.plans.JobPlan.prefetch_fits`, with
        the plan's margin: 0 for a plan profiled on the job's own layers, ``PEAK_MARGIN`` for
        a fused array's stacked estimate).
        """
        if task.shard == current.shard or not self._prefetch_window(current, task):
            return False
        job = self._job
        updated = {key for key in job.shard_keys(current.shard) if job.trainable(key)}
        if any(key in updated for key in job.shard_keys(task.shard) if job.trainable(key)):
            return False
        budget = self.plan.budget_bytes
        if self.memory_plan is not None:
            budget = self.memory_plan.limit_bytes
        current_peak = self._tasks.planned_peak_bytes(current, self.state_on_device(current.shard))
        return self.plan.prefetch_fits(current_peak,
                                       self.plan.shards[task.shard].param_bytes, budget)

    def _prefetch_window(self, current: ShardTask, task: ShardTask) -> bool:
        """Whether ``task`` is close enough to ``current`` to be prefetched.

        Any task of a job's; within one training step only when :attr:`_within_step` (a fused
        array: members leave the array between steps).
        """
        if not self._within_step:
            return True
        return (task.seq == current.seq + 1 and task.step == current.step
                and current.phase == "train" and task.phase == "train")

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
        if not self._passes.fetch_early(task.shard, device):
            self.num_prefetch_refusals += 1

    def _promote_hosts(self, task: ShardTask, device: Device,
                       hosts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``task``'s shard: prefetched ones, or promoted now (counted)."""
        copies = self._take_prefetched(task, device)
        if copies is None:
            copies = device.transfer.promote(list(hosts))
        self._boundaries.moved(device, sum(copy.nbytes for copy in copies))
        self.num_promotes += 1
        self.device_name = device.name
        return copies

    def _take_prefetched(self, task: ShardTask, device: Device) -> list[torch.Tensor] | None:
        """The copies prefetched for ``task`` onto ``device`` (``None``: promote now).

        Drops stale prefetches (of earlier tasks, e.g. after the task moved device), and a copy
        made for another device. On CUDA the current stream waits for the copy's stream.
        """
        self.drop_prefetched(lambda seq, name: seq < task.seq)  # stale: e.g. the task moved
        if task.seq not in self._prefetched:
            return None
        name, copying = self._prefetched.pop(task.seq)
        copies = copying.wait_device()
        return copies if name == device.name else None

    def drop_prefetched(self, which: Callable[[int, str], bool] | None = None) -> None:
        """Drop prefetched shard copies, freeing them once their background copies end.

        Args:
            which: Selects by the task's sequence number and the device's name (``None``: all).
                A dropped copy that failed is dropped alike: the host copies are what count.
        """
        for seq in [seq for seq, (name, _) in self._prefetched.items()
                    if which is None or which(seq, name)]:
            with contextlib.suppress(Exception):
                self._prefetched.pop(seq)[1].wait_device()  # freed now, not when the copy ends

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
        (:class:`~sweepmaster.runtime.scheduling.residency.Residency`).
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
        executor's :class:`~sweepmaster.runtime.scheduling.residency.Residency`), or before a
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
            self.drop_prefetched(lambda seq, name: seq < task.seq)
            self._kept = None
            self.num_resident_hits += 1
            self.device_name = device.name
            return True
        self.evict()
        return False

    def _state_kept(self, shard: int) -> bool:
        """Whether the kept ``shard``'s optimizer state stays on its device with it."""
        return self.state_on_device(shard)

    def state_stays(self, shard: int) -> bool:
        """Whether the shard's optimizer state may stay on the device with the kept shard.

        :meth:`~sweepmaster.runtime.planning.plans.JobPlan.state_stays` on the job's plan and
        memory plan (the rule the policy's chain counts the bytes by).
        """
        if self.memory_plan is None:
            return self.plan.state_stays(shard)
        return self.plan.state_stays(shard, self.memory_plan.shards,
                                     self.memory_plan.limit_bytes)

    def keep(self, shard: int, device: Device) -> None:
        """Leave ``shard`` resident on ``device`` for the next task (its gradients dropped).

        A shard whose update runs on the host leaves instead: its device copy is stale.
        """
        if self.host_updates.due(shard):
            self.demote(shard, device)
            return
        tensors = self._job.task_tensors()
        for key in self._job.shard_keys(shard):
            tensors[key].grad = None
        self._kept = (shard, device)

    def _write_back(self, shard: int, device: Device) -> None:
        """Demote the kept ``shard`` from ``device``: write back what changed, free the rest."""
        self.demote(shard, device)
