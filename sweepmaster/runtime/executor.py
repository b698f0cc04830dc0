"""The executor: trains jobs on devices, spilling those larger than a device.

This is the entry point below ``sweep.py`` and the Python API (``Executor.fit`` from an Optuna
objective under ``study.optimize(n_jobs=K)``). A job whose plain footprint fits its device's budget
trains with :func:`~sweepmaster.runtime.plain.train_plain` (no spill overhead); a larger one is
planned (:func:`~sweepmaster.runtime.partition.plan_job`) and trained by shard tasks
(:func:`~sweepmaster.runtime.spill.train_spilled`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

from transformers import PretrainedConfig

from sweepmaster.runtime.device import Device, parse_devices
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.partition import JobPlan, plan_job
from sweepmaster.runtime.plain import train_plain
from sweepmaster.runtime.profile import estimate_plain_bytes
from sweepmaster.runtime.spill import train_spilled
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["Executor"]

SpillMode = Literal["auto", "always", "never"]


class Executor:
    """Train jobs on a fixed set of devices, spilling when a job does not fit; thread-safe.

    Each :meth:`fit` waits until a device is free, trains the job there and frees the device when
    it returns or raises. So K threads calling ``fit`` at once (e.g.
    ``study.optimize(objective, n_jobs=K)``) run at most ``len(devices)`` jobs at a time.

    Whether a job spills (Hydra, Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) is
    decided by its estimated plain footprint against the device budget (``spill="auto"``). The host
    CPU device (``"cpu"``, unmetered, budget = free RAM) always trains plain: spilling to the
    memory it already uses cannot help. On a virtual device, plain training runs under the
    device's meter, so a job that does not fit fails with ``torch.OutOfMemoryError``. The
    numbers are always those of :func:`~sweepmaster.runtime.plain.train_plain`.

    Example:
        >>> with Executor("cpu:1x256MiB") as executor:
        ...     result = executor.fit(spec)  # doctest: +SKIP

    Args:
        devices: A device spec for :func:`~sweepmaster.runtime.device.parse_devices`
            (``"auto"``, ``"cpu"``, ``"cuda:0,cuda:1"``, ``"cpu:2x256MiB"``) or devices.
        device_memory: Cap on every device's budget (bytes or a size such as ``"8GiB"``); only
            with a spec string.
        spill: ``"auto"`` (spill when the job does not fit), ``"always"`` or ``"never"``.
        microbatch_size: The largest blocks per layer pass when spilling (each shard uses the
            largest that fits); default the job's batch size.
        prefetch: Double-buffer shard promotion when spilling.

    Raises:
        ValueError: The device spec is invalid or the device list is empty or repeats a device.
    """

    def __init__(
        self,
        devices: str | Sequence[Device] = "auto",
        *,
        device_memory: str | int | None = None,
        spill: SpillMode = "auto",
        microbatch_size: int | None = None,
        prefetch: bool = True,
    ) -> None:
        if isinstance(devices, str):
            self._devices = parse_devices(devices, device_memory)
        else:
            self._devices = list(devices)
        if not self._devices:
            raise ValueError("an Executor needs at least one device")
        if len(set(self._devices)) != len(self._devices):
            raise ValueError(f"devices must be distinct, got {[d.name for d in self._devices]}")
        if spill not in ("auto", "always", "never"):
            raise ValueError(f"spill must be 'auto', 'always' or 'never', got {spill!r}")
        self._spill = spill
        self._microbatch_size = microbatch_size
        self._prefetch = prefetch
        self._free = list(self._devices)
        self._condition = threading.Condition()
        self._closed = False
        self._plans: dict[tuple[object, ...], JobPlan] = {}
        self._plain_bytes: dict[tuple[object, ...], int] = {}

    @property
    def devices(self) -> list[Device]:
        """The devices jobs run on, in order."""
        return list(self._devices)

    def plan(self, spec: TrainSpec, device: Device | None = None) -> JobPlan:
        """Plan a job for a device (default the first) without training; cached per architecture.

        Raises:
            LayerTooLargeError: A layer alone does not fit the device.
            UnsupportedModelError: The model cannot be split into layers.
        """
        device = device if device is not None else self._devices[0]
        key = _arch_key(spec, self._microbatch_size, device)
        plan = self._plans.get(key) if key is not None else None
        if plan is None:
            plan = plan_job(spec, device, microbatch_size=self._microbatch_size)
            if key is not None:
                self._plans[key] = plan
        return plan

    def fit(self, spec: TrainSpec, callbacks: TrainCallbacks | None = None) -> TrainResult:
        """Train one job on the first free device, waiting for one if all are busy.

        Args:
            spec: The job.
            callbacks: Its progress receiver (called on the training thread, i.e. the caller's).

        Returns:
            The job's result (``swap_bytes`` and promote/demote counts are 0 when it ran plain).

        Raises:
            RuntimeError: The executor is closed (also raised in threads waiting for a device
                when it closes).
            torch.OutOfMemoryError: The job did not fit its device.
            LayerTooLargeError: The job must spill but one of its layers alone does not fit.
            FloatingPointError: The train loss became non-finite (see ``train_plain``).
        """
        device = self._acquire()
        try:
            if self._spills(spec, device):
                return train_spilled(
                    spec, device, self.plan(spec, device), callbacks, prefetch=self._prefetch
                )
            meter = device.meter
            if meter is None:
                return train_plain(spec, device, callbacks)
            meter.reset_peak()
            with meter.metering():
                result = train_plain(spec, device, callbacks)
            return dataclasses.replace(result, peak_device_bytes=meter.peak_bytes)
        finally:
            self._release(device)

    def close(self) -> None:
        """Refuse new jobs and wake threads waiting for a device; running jobs finish."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _spills(self, spec: TrainSpec, device: Device) -> bool:
        if self._spill != "auto":
            return self._spill == "always"
        if device.meter is None:
            return False  # the host CPU: spilling to the memory it uses cannot help
        key = _arch_key(spec, None, device)
        plain = self._plain_bytes.get(key) if key is not None else None
        if plain is None:
            plain = estimate_plain_bytes(spec)
            if key is not None:
                self._plain_bytes[key] = plain
        return plain > device.budget_bytes

    def _acquire(self) -> Device:
        with self._condition:
            self._condition.wait_for(lambda: self._closed or bool(self._free))
            if self._closed:
                raise RuntimeError("the Executor is closed")
            return self._free.pop(0)

    def _release(self, device: Device) -> None:
        with self._condition:
            self._free.append(device)
            self._free.sort(key=self._devices.index)
            self._condition.notify()


def _arch_key(
    spec: TrainSpec, microbatch_size: int | None, device: Device
) -> tuple[object, ...] | None:
    """What a plan depends on, or ``None`` when the model source has no stable identity."""
    model = spec.model
    if isinstance(model, PretrainedConfig):
        source: object = model.to_json_string()
    elif isinstance(model, str):
        source = model
    else:
        return None
    opt = spec.optimizer
    return (
        source,
        spec.dtype,
        spec.batch_size,
        tuple(spec.train_data.shape[1:]),
        microbatch_size,
        opt.name,
        opt.momentum > 0,
        opt.grad_clip is not None,
        device.name,
        device.budget_bytes,
    )
