"""A spilled shard's optimizer step on the host, overlapped with the device (ZeRO-Offload).

ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC 2021, https://arxiv.org/abs/2101.06840) keeps the optimizer state on the host and steps it
there: after a shard's backward its gradients go device -> host, the CPU runs the optimizer
step over the host (pinned) copies of the parameters and state while the device runs its next
task, and the parameters reach the device with the shard's next promote. A job plan whose
:attr:`~sweepmaster.runtime.planning.plans.JobPlan.update_on` is ``"host"``
(:mod:`~sweepmaster.runtime.planning.update_site` chose it) updates this way.

:class:`HostUpdates` is the part of a spilled job's shard store
(:class:`~sweepmaster.runtime.training.shard_store.ShardStore`) that does it, with a narrow
interface:

* :meth:`HostUpdates.submit`: the shard's update, called where the device update would run;
  its owned gradients start home on the device's copy stream (counted in the swap volume) and
  the step is due;
* :meth:`HostUpdates.released`: the shard left the device (its host copies are the tensors'
  data again): the due step starts on the host's optimizer thread, after the gradients' copy;
* :meth:`HostUpdates.wait`: before a promote reads host copies, the steps writing them end
  (the one host wait of a spilled step; a step's error is raised there);
* :meth:`HostUpdates.wait_all`: before the host copies are read whole (checkpoint, result).

The step is the job's own optimizer step (``torch.optim`` for one member, the table's fused
step for K), the same call the device update makes, on the host copies: the same numbers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.transfer import Transfer
from sweepmaster.runtime.training.tasks import TensorKey

__all__ = ["HostTensors", "HostUpdates", "UpdateStep"]

#: The host CPU the steps run on (its "transfers" are in place).
HOST = Device("cpu")

#: ``step(shard, tensors, schedule, device, clip_coef)``: the job's optimizer step of the
#: shard's owned parameters in ``tensors`` (their ``.grad`` set), its state where ``device``
#: is (:meth:`~sweepmaster.runtime.training.shard_members.ShardMembers.update`).
UpdateStep = Callable[[int, Mapping[TensorKey, torch.Tensor], Any, Device, Any], None]

_POOL_LOCK = threading.Lock()
_POOL: list[concurrent.futures.ThreadPoolExecutor] = []


def _host_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's host optimizer thread (one: the steps share the host's cores)."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="host-update"))
        return _POOL[0]


class HostTensors(Protocol):
    """What :class:`HostUpdates` reads of a job: its tensors and their host copies."""

    def task_tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The tensors the job computes with, by key."""
        ...

    def host_tensor(self, key: TensorKey) -> torch.Tensor:
        """The host copy of ``key``."""
        ...

    def idle_data(self, host: torch.Tensor) -> torch.Tensor:
        """What a tensor's data is while no copy is installed, given its host copy."""
        ...


@dataclass
class _Due:
    """A submitted update waiting for its shard to leave the device."""

    keys: list[TensorKey]
    grads: list[torch.Tensor]  # host copies, written by ``copying``
    copying: Transfer
    schedule: Any
    step: UpdateStep


class HostUpdates:
    """The host optimizer steps of one spilled job's shards (see the module doc).

    Calls come from the job's one task at a time (any thread); the steps run on the host's
    optimizer thread, one after another.

    Args:
        job: The job's tensors and host copies.
        moved: ``moved(device, num_bytes)`` counts bytes in the job's swap volume.

    Attributes:
        num_steps: Host steps started so far.
    """

    def __init__(self, job: HostTensors, moved: Callable[[Device, int], None]) -> None:
        self._job = job
        self._moved = moved
        self._due: dict[int, _Due] = {}
        self._running: dict[TensorKey, concurrent.futures.Future[None]] = {}
        self._grad_buffers: dict[int, list[torch.Tensor]] = {}
        self.num_steps = 0

    def submit(self, shard: int, keys: Sequence[TensorKey], schedule: Any, device: Device,
               step: UpdateStep) -> None:
        """The shard's update on the host: its owned gradients go home now, the step is due.

        The gradients (``.grad`` of the installed ``keys``) are demoted in one batch on the
        device's copy stream (counted) into the shard's host buffers and dropped from the
        device; the step runs once the shard has left the device (:meth:`released`).

        Args:
            shard: The shard.
            keys: Its owned parameters (each with a gradient).
            schedule: What the step needs besides the gradients (its step, or K lrs).
            device: Where the gradients are.
            step: The job's optimizer step (:data:`UpdateStep`).
        """
        tensors = self._job.task_tensors()
        grads: list[torch.Tensor] = []
        for key in keys:
            grad = tensors[key].grad
            assert grad is not None
            grads.append(grad)
            tensors[key].grad = None
        self._moved(device, sum(g.nbytes for g in grads))
        # as the device update's write-back: on the d2h stream (CUDA), inline on a virtual
        # device (its device copies are freed now, within the task's planned peak)
        hosts, copying = device.transfer.demote(grads, self._buffers(shard, grads, device))
        self._due[shard] = _Due(list(keys), hosts, copying, schedule, step)

    def _buffers(self, shard: int, grads: Sequence[torch.Tensor],
                 device: Device) -> list[torch.Tensor]:
        """The shard's host gradient buffers, made once (pinned on CUDA), unmetered.

        Free again by the shard's next update: its promote waited for the step that read them.
        Made anew when the shapes change (a fused array's member left).
        """
        buffers = self._grad_buffers.get(shard)
        if buffers is None or [b.shape for b in buffers] != [g.shape for g in grads]:
            meter = device.meter
            with meter.unmetered() if meter is not None else contextlib.nullcontext():
                buffers = [torch.empty(g.shape, dtype=g.dtype, pin_memory=device.pin_host_memory)
                           for g in grads]
            self._grad_buffers[shard] = buffers
        return list(buffers)

    def due(self, shard: int) -> bool:
        """Whether the shard's host step waits for it to leave the device."""
        return shard in self._due

    def released(self, shard: int) -> None:
        """The shard left the device: start its due step (if any) on the host thread."""
        due = self._due.pop(shard, None)
        if due is None:
            return
        hosts = [self._job.host_tensor(key) for key in due.keys]
        future = _host_thread().submit(self._step, shard, due, hosts)
        self.num_steps += 1
        for key in due.keys:
            self._running[key] = future

    def _step(self, shard: int, due: _Due, hosts: list[torch.Tensor]) -> None:
        """The optimizer step on the host copies (the host thread)."""
        due.copying.wait()
        tensors = self._job.task_tensors()
        for key, host, grad in zip(due.keys, hosts, due.grads, strict=True):
            tensors[key].data = host
            tensors[key].grad = grad
        try:
            due.step(shard, tensors, due.schedule, HOST, None)
        finally:
            for key, host in zip(due.keys, hosts, strict=True):
                tensors[key].data = self._job.idle_data(host)
                tensors[key].grad = None

    def wait(self, keys: Sequence[TensorKey]) -> None:
        """Wait for the host steps writing any of ``keys`` (before a promote reads them).

        Raises:
            Exception: What such a step raised.
        """
        for key in keys:
            future = self._running.pop(key, None)
            if future is not None:
                future.result()

    def wait_all(self) -> None:
        """Wait for every host step started (the host copies are read whole next).

        Raises:
            Exception: What a step raised.
        """
        self.wait(list(self._running))

    def drop(self) -> None:
        """Forget the due steps and wait out the running ones, errors ignored (a failed job)."""
        self._due.clear()
        for future in list(self._running.values()):
            concurrent.futures.wait([future])
        self._running.clear()
