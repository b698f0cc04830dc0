"""Where a spilled job's optimizer step runs: on the device, or on the host (ZeRO-Offload).

A spilled shard's just-in-time update (Harmony) runs on the device: its optimizer state is
promoted for the update and demoted after it, with the parameters the update changed.
ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX
ATC 2021, https://arxiv.org/abs/2101.06840) updates on the host instead: the gradients go
device -> host, the optimizer step runs on the CPU over the host (pinned) fp32 copies of the
parameters and state, overlapped with the device's next backward, and the parameters come back
with the shard's next promote (which a spilled job makes anyway). Per update of a shard that
owns ``P`` parameter bytes with ``O`` bytes of optimizer state:

* device: ``O`` promoted, ``O + P`` demoted (state home, changed parameters written back);
* host: ``P`` of gradients demoted; the host step touches ``2P + O`` bytes (parameters,
  gradients, state) at the measured host optimizer throughput
  (:func:`host_optimizer_bytes_per_s`), hidden behind the next task's compute (the next
  shard's backward; shard 0's step is waited for by the next step's forward of shard 0).

:func:`update_cost` compares both per step of a plan and chooses; the choice is a field of the
job plan (:attr:`~sweepmaster.runtime.planning.plans.JobPlan.update_on`), which the trainer,
the byte account (:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`) and
``sweepmaster plan`` read.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sweepmaster.workload.spec import OptimizerSpec

if TYPE_CHECKING:
    from sweepmaster.runtime.planning.plans import JobPlan, ShardPlan

__all__ = ["UPDATE_SITES", "UpdateCost", "UpdateSite", "host_optimizer_bytes_per_s",
           "update_cost", "with_update_on"]

#: Where an update runs.
UpdateSite = Literal["device", "host"]
#: What a caller may ask for: choose by cost (``"auto"``), or one site.
UPDATE_SITES = ("auto", "device", "host")

#: Measured host optimizer throughputs (bytes/s) per optimizer kind, once per process.
_HOST_BYTES_PER_S: dict[tuple[str, bool], float] = {}
_MEASURE_LOCK = threading.Lock()


@dataclass(frozen=True)
class UpdateCost:
    """Bytes and seconds of one step's updates on each site, and the site chosen.

    Attributes:
        update_on: ``"device"`` or ``"host"``: where the job's updates run.
        reason: Why, in a few words (``sweepmaster plan`` prints it).
        device_bytes: Host <-> device bytes of a steady step's updates on the device: the
            state promoted and demoted, the changed parameters written back.
        host_bytes: Of the updates on the host: the gradients demoted.
        device_s: Seconds of ``device_bytes`` at the device's host bandwidth.
        host_s: Seconds of ``host_bytes`` at that bandwidth plus each host step's seconds
            not hidden behind the device's next task (only the copies when not
            :attr:`compared`).
        compared: Whether the sites' seconds were compared (the host step's measured); not
            for a job that updates on the device whatever they are, or one forced there.
    """

    update_on: UpdateSite
    reason: str
    device_bytes: int
    host_bytes: int
    device_s: float
    host_s: float
    compared: bool = True


def host_optimizer_bytes_per_s(optimizer: OptimizerSpec, num_elements: int = 1 << 18) -> float:
    """Bytes per second the host's optimizer step gets through, measured once per process.

    The optimizer table's multi-tensor step
    (:attr:`~sweepmaster.runtime.training.optimizers.OptimizerEntry.fused_step`, one member) on
    one flat fp32 buffer of ``num_elements`` parameters with its gradient and state, best of 3
    after a warm-up; the bytes are the parameters, gradients and state it reads and writes.
    Cached per optimizer name and whether it keeps state (SGD with or without momentum).
    """
    from sweepmaster.runtime.planning.profile import optimizer_state_bytes

    key = (optimizer.name, optimizer_state_bytes(4, optimizer) > 0)
    with _MEASURE_LOCK:
        if key not in _HOST_BYTES_PER_S:
            _HOST_BYTES_PER_S[key] = _measure(optimizer, num_elements)
        return _HOST_BYTES_PER_S[key]


def _measure(optimizer: OptimizerSpec, num_elements: int) -> float:
    """One measurement of :func:`host_optimizer_bytes_per_s` (see there)."""
    import torch

    from sweepmaster.runtime.training.fused_optim import build_fused_optimizer

    fused = build_fused_optimizer([optimizer], torch.device("cpu"))
    param = torch.zeros(1, num_elements)
    best = float("inf")
    for _ in range(4):  # the first is the warm-up (the state is made there)
        param.grad = torch.full_like(param, 1e-3)
        start = time.perf_counter()
        fused.step([param], [optimizer.lr])
        best = min(best, time.perf_counter() - start)
    state_bytes = sum(t.nbytes for state in fused.state for t in state.values()
                      if isinstance(t, torch.Tensor))
    return (2 * param.nbytes + state_bytes) / max(best, 1e-9)


def update_cost(shards: Sequence[ShardPlan], optimizer: OptimizerSpec, device_type: str,
                update_on: str = "auto", *, bandwidth_bytes_per_s: float | None = None,
                host_bytes_per_s: float | None = None) -> UpdateCost:
    """Both sites' bytes and seconds per steady step of ``shards``, and where to update.

    ``"auto"`` updates on the host where it moves fewer bytes and its seconds (gradient
    demotes plus host steps not hidden by the next task) are no more than the device's. A job
    of one shard (it fits its device: the shard and its state stay resident) and a job whose
    updates wait for the clip norm (``grad_clip`` with more than one shard: they are deferred
    to the shard's next promote) always update on the device, ``"host"`` forced or not; so does
    every job of a virtual device (``device_type`` ``"cpu"``) unless forced: its "device" is
    the host's own memory and cores, so moving the step there saves nothing real.

    Args:
        shards: The job plan's shards.
        optimizer: The job's optimizer (its state bytes are the shards'; its kind is measured).
        device_type: ``"cuda"`` or ``"cpu"`` (a virtual device).
        update_on: ``"auto"``, or force ``"device"`` or ``"host"`` (tests, benchmarks).
        bandwidth_bytes_per_s: The device's host <-> device bandwidth (bytes/s); ``None``:
            what step-time estimates assume for ``device_type``
            (:func:`~sweepmaster.runtime.planning.packing.copy_bytes_per_s`).
        host_bytes_per_s: The host optimizer throughput; ``None``: measured
            (:func:`host_optimizer_bytes_per_s`).

    Raises:
        ValueError: ``update_on`` is none of :data:`UPDATE_SITES`.
    """
    if bandwidth_bytes_per_s is None:
        from sweepmaster.runtime.planning.packing import copy_bytes_per_s

        bandwidth_bytes_per_s = copy_bytes_per_s(device_type)
    if update_on not in UPDATE_SITES:
        raise ValueError(f"update_on must be one of {', '.join(UPDATE_SITES)}, got {update_on!r}")
    updating = [s for s in shards if s.num_owned_params]
    device_bytes = sum(2 * s.optimizer_bytes + s.owned_param_bytes for s in updating)
    host_bytes = sum(s.owned_param_bytes for s in updating)
    device_s = device_bytes / bandwidth_bytes_per_s
    clipped = optimizer.grad_clip is not None and len(shards) > 1
    virtual = device_type != "cuda" and update_on == "auto"
    if len(shards) == 1 or clipped or update_on == "device" or virtual:
        reason = ("fits: one resident shard keeps its state" if len(shards) == 1
                  else "grad_clip defers updates" if clipped
                  else "forced" if update_on == "device" else "virtual device: one CPU")
        return UpdateCost("device", reason, device_bytes, host_bytes, device_s,
                          host_bytes / bandwidth_bytes_per_s, compared=False)
    throughput = host_bytes_per_s or host_optimizer_bytes_per_s(optimizer)
    host_s = host_bytes / bandwidth_bytes_per_s
    for shard in updating:
        step_s = (2 * shard.owned_param_bytes + shard.optimizer_bytes) / throughput
        # the next task is the backward of the shard before; shard 0's step is waited for
        hidden = shards[shard.index - 1].backward_s if shard.index > 0 else 0.0
        host_s += max(0.0, step_s - hidden)
    if update_on == "host":
        site: UpdateSite = "host"
        reason = "forced"
    elif host_bytes < device_bytes and host_s <= device_s:
        site, reason = "host", "fewer bytes, no slower"
    else:
        site = "device"
        reason = "no fewer bytes" if host_bytes >= device_bytes else "host step slower"
    return UpdateCost(site, reason, device_bytes, host_bytes, device_s, host_s)


def with_update_on(plan: JobPlan, optimizer: OptimizerSpec, update_on: str) -> JobPlan:
    """``plan`` with its updates where ``update_on`` says (``"auto"``: as it was planned).

    ``"device"`` or ``"host"`` apply :func:`update_cost`'s rules (a job of one shard, or one
    that clips its gradients across shards, stays on the device) and recount the plan's swap
    volume per step.

    Raises:
        ValueError: As :func:`update_cost`.
    """
    if update_on == "auto":
        return plan
    device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
    site = update_cost(plan.shards, optimizer, device_type, update_on).update_on
    placed = dataclasses.replace(plan, update_on=site)
    return dataclasses.replace(placed, swap_bytes_per_step=placed.step_swap_bytes())
