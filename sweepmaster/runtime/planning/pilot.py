"""Hydra's pilot pass (Nagrecha & Kumar 2022, Algorithm 1): partition by training on the device.

:func:`pilot_pass` is the oracle: it really trains a candidate shard (a range of layers) on the
device under its budget and reports the peak bytes, or runs out of memory.
:func:`pilot_partition` grows each shard a layer at a time by that oracle and cuts before the
layer that runs out of memory. :func:`~sweepmaster.runtime.planning.partition.plan_job` plans by
it with ``method="pilot"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.planning.plans import LayerTooLargeError
from sweepmaster.runtime.planning.profile import (
    _nbytes,
    foreach_by_default,
    forked_host_rng,
    optimizer_state_bytes,
    optimizer_step_bytes,
)
from sweepmaster.runtime.planning.timing import _on_device
from sweepmaster.runtime.training.layers import decompose
from sweepmaster.workload.causal_lm import build_model, causal_lm_loss
from sweepmaster.workload.spec import TrainSpec

__all__ = ["pilot_partition", "pilot_pass"]


def pilot_pass(spec: TrainSpec, device: Device, microbatch_size: int) -> Callable[[int, int], int]:
    """A pilot-pass oracle for Hydra's partitioner (Algorithm 1): really train a candidate shard.

    The model is built on the host (it must fit in host memory). The returned
    ``fits(start, stop) -> peak bytes`` copies the parameters of layers ``[start, stop)`` to
    ``device``, runs a forward (with the loss for the last layer) and a backward of one
    ``microbatch_size``-block microbatch, then allocates the optimizer state and the step's
    scratch (:func:`~sweepmaster.runtime.planning.profile.optimizer_step_bytes`, on the
    device's optimizer path), under a fresh meter of its own with the device budget; it raises
    ``torch.OutOfMemoryError`` past the budget. Jobs may train on the device meanwhile: the
    pass counts its own tensors (a dispatch mode, on a GPU too) and never resets the device's
    statistics, which their tasks' peaks are read from.
    """
    torch_device = device.torch_device
    budget = device.budget_bytes
    with forked_host_rng():
        model = build_model(spec.model, spec.dtype, spec.peft)
        model.train()
        stack = decompose(model)
        input_ids_bT = spec.train_data[:microbatch_size]
        inputs: list[torch.Tensor] = [input_ids_bT]
        with torch.no_grad():
            for layer in stack.layers[:-1]:
                inputs.append(layer(inputs[-1]))
    first_use: dict[int, int] = {}
    for index in range(len(stack)):
        for param in stack.layer_parameters(index):
            first_use.setdefault(id(param), index)
    last = len(stack) - 1

    def fits(start: int, stop: int) -> int:
        params = {id(p): p for i in range(start, stop) for p in stack.layers[i].parameters()}
        owned = [p for p in params.values() if first_use.get(id(p), -1) >= start]
        meter = VirtualMeter(budget, device.name)
        with forked_host_rng(), meter.metering(), _on_device(params.values(), torch_device):
            x = inputs[start].to(torch_device, copy=True)
            x.requires_grad_(x.is_floating_point())
            output = x
            for layer in stack.layers[start:stop]:
                output = layer(output)
            if stop - 1 == last:
                output = causal_lm_loss(output, input_ids_bT.to(torch_device))
                output.backward()
            elif output.requires_grad:  # else frozen first layers: no backward
                output.backward(torch.ones_like(output))
            del output, x
            state_bytes = sum(optimizer_state_bytes(_nbytes(p), spec.optimizer) for p in owned)
            scratch = optimizer_step_bytes((_nbytes(p) for p in owned),
                                           foreach_by_default(torch_device.type), spec.optimizer)
            stand_in = torch.empty(state_bytes + scratch, dtype=torch.uint8, device=torch_device)
            del stand_in
        return meter.peak_bytes

    return fits


def pilot_partition(
    num_layers: int, fits: Callable[[int, int], int], layer_names: Sequence[str],
    budget_bytes: int,
) -> list[int]:
    """Hydra's pilot-pass partitioner (Algorithm 1): cut points ``[0, c1, ..., num_layers]``.

    Grow the current shard layer by layer; ``fits(start, stop)`` runs a pilot pass of layers
    ``[start, stop)`` on the device and returns its peak bytes, or raises
    ``torch.OutOfMemoryError``: then the shard is cut before the layer. ``layer_names`` and
    ``budget_bytes`` are for the error message.

    Raises:
        LayerTooLargeError: A single layer runs out of memory.
    """
    cuts = [0]
    for stop in range(1, num_layers + 1):
        for start in sorted({cuts[-1], stop - 1}):  # grow the shard, else cut before the layer
            try:
                fits(start, stop)
                break
            except torch.OutOfMemoryError:
                continue
        else:
            raise LayerTooLargeError(layer_names[stop - 1], budget_bytes + 1, budget_bytes)
        if start > cuts[-1]:
            cuts.append(start)
    return [*cuts, num_layers]

