"""Bytes and seconds of candidate shards, the cost model both partitioners pack by.

A shard is a contiguous range of layers ``[start, stop)`` of a
:class:`~sweepmaster.runtime.planning.profile.ModelProfile`. At their peak its tasks
(:mod:`~sweepmaster.runtime.training.spill`) hold: forward, parameters + one microbatch's input +
the largest layer transient (no grad); backward, parameters + gradients + the boundary input + the
shard's recompute activations of one microbatch + the backward transient, then for the
just-in-time update parameters + gradients + optimizer state + the step's transient. A tied
parameter is owned (updated, its optimizer state held) by the first shard that uses it; later
shards borrow it and send back their gradient contributions.
:mod:`~sweepmaster.runtime.planning.packing` packs layers by these costs and
:mod:`~sweepmaster.runtime.planning.memprofile` reads a shard's update peaks from them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

from sweepmaster.runtime.planning.plans import ShardPlan
from sweepmaster.runtime.planning.profile import (
    LayerProfile,
    ModelProfile,
    optimizer_state_bytes,
    optimizer_step_bytes,
    plain_footprint_bytes,
)
from sweepmaster.workload.spec import OptimizerSpec

__all__ = ["PassBytes"]

#: Fills in what each pass of a shard promotes besides its boundaries (a fused array's dropout
#: noise and LoRA scalings: :attr:`ShardPlan.noise_bytes`, :attr:`ShardPlan.scaling_bytes`).
PassBytes = Callable[[ShardPlan], ShardPlan]


def _plain_bytes(profile: ModelProfile, optimizer: OptimizerSpec) -> int:
    return plain_footprint_bytes(
        profile.param_bytes, profile.plain_activation_peak_bytes, optimizer,
        sum(profile.frozen_param_bytes.values()), profile.foreach_optimizer,
    )


class _Costs:
    """Bytes and seconds of candidate shards ``[start, stop)`` on ``rows``-block microbatches."""

    def __init__(self, profile: ModelProfile, optimizer: OptimizerSpec,
                 pass_bytes: PassBytes | None = None) -> None:
        self.profile = profile
        self.optimizer = optimizer
        self.pass_bytes = pass_bytes
        self.num_layers = len(profile.layers)
        self.batch_size = profile.batch_size
        self.row_options = sorted(
            {max(1, math.ceil(profile.microbatch_size / 2**k)) for k in range(32)}, reverse=True
        )
        self._layers: dict[int, tuple[LayerProfile, ...]] = {}
        self._shard_rows: dict[tuple[int, int, int], int | None] = {}
        self.first_use: dict[str, int] = {}
        self.last_use: dict[str, int] = {}
        for index, layer in enumerate(profile.layers):
            for name in layer.param_names:
                self.first_use.setdefault(name, index)
                self.last_use[name] = index

    def layers(self, rows: int) -> tuple[LayerProfile, ...]:
        if rows not in self._layers:
            self._layers[rows] = tuple(self.profile.layer(i, rows) for i in range(self.num_layers))
        return self._layers[rows]

    def scale(self, rows: int) -> float:
        """Microbatch -> minibatch factor."""
        return self.batch_size / rows

    def _names(self, start: int, stop: int) -> set[str]:
        layers = self.profile.layers
        return {name for layer in layers[start:stop] for name in layer.param_names}

    def _owned(self, start: int, stop: int) -> list[str]:
        return [n for n in self._names(start, stop) if start <= self.first_use[n]]

    def param_bytes(self, start: int, stop: int) -> int:
        """Parameters the shard holds while resident, trainable and frozen (bytes)."""
        frozen = {name for layer in self.profile.layers[start:stop]
                  for name in layer.frozen_param_names}
        return self.grad_bytes(start, stop) + sum(
            self.profile.frozen_param_bytes[n] for n in frozen)

    def grad_bytes(self, start: int, stop: int) -> int:
        """Trainable parameters the shard uses, i.e. its gradients (bytes)."""
        return sum(self.profile.param_bytes[n] for n in self._names(start, stop))

    def owned_bytes(self, start: int, stop: int) -> int:
        return sum(self.profile.param_bytes[n] for n in self._owned(start, stop))

    def optimizer_bytes(self, start: int, stop: int) -> int:
        sizes = self.profile.param_bytes
        owned = self._owned(start, stop)
        return sum(optimizer_state_bytes(sizes[n], self.optimizer) for n in owned)

    def contribution_bytes(self, start: int, stop: int) -> int:
        """Gradient contributions to owned parameters from later shards (bytes)."""
        sizes = self.profile.param_bytes
        return sum(sizes[n] for n in self._owned(start, stop) if self.last_use[n] >= stop)

    def borrowed_params(self, start: int, stop: int,
                        cuts: Sequence[int]) -> tuple[tuple[str, int, int], ...]:
        """``(name, owner shard, bytes)`` of each tied parameter an earlier shard owns.

        Of the shard of layers ``start .. stop``; ``cuts``: the shards' cut points over the
        layers; the owner is the shard of the parameter's first use. In name order.
        """
        sizes = self.profile.param_bytes
        return tuple((n, bisect.bisect_right(cuts, self.first_use[n]) - 1, sizes[n])
                     for n in sorted(self._names(start, stop)) if self.first_use[n] < start)

    def forward_peak(self, start: int, stop: int, rows: int) -> int:
        layers = self.layers(rows)
        transient = max(
            (layers[i].input_bytes if i > start else 0) + layers[i].forward_peak_bytes
            for i in range(start, stop)
        )
        return self.param_bytes(start, stop) + layers[start].input_bytes + transient

    def backward_peak(self, start: int, stop: int, rows: int) -> int:
        layers = self.layers(rows)
        params = self.param_bytes(start, stop)
        grads = self.grad_bytes(start, stop)
        accumulated = grads if math.ceil(self.batch_size / rows) > 1 else 0
        saved = 0
        compute = 0
        for i in range(start, stop):
            compute = max(compute, saved + layers[i].train_forward_peak_bytes + accumulated)
            saved += layers[i].saved_bytes
        later_grads = 0
        for i in range(stop - 1, start - 1, -1):
            saved -= layers[i].saved_bytes
            incoming = layers[i].output_bytes if i < self.num_layers - 1 else 0
            grads_alive = accumulated or later_grads
            compute = max(compute, saved + layers[i].backward_peak_bytes + incoming + grads_alive)
            later_grads += sum(self.profile.param_bytes[n] for n in layers[i].param_names)
        compute += params + layers[start].input_bytes
        if self.optimizer.grad_clip is not None and start > 0:
            return compute
        return max(compute, self.update_peak(start, stop))

    def update_peak(self, start: int, stop: int) -> int:
        """Just-in-time update: parameters, gradients, state, the step's transient (0: none)."""
        owned = self._owned(start, stop)
        if not owned:
            return 0
        transient = max(self.contribution_bytes(start, stop), self.step_bytes(owned))
        return (self.param_bytes(start, stop) + self.grad_bytes(start, stop)
                + self.optimizer_bytes(start, stop) + transient)

    def task_peak(self, kind: str, start: int, stop: int, rows: int) -> int:
        clip = self.optimizer.grad_clip is not None and start > 0
        if kind == "forward":
            peak = self.forward_peak(start, stop, rows)
            return max(peak, self.deferred_update_peak(start, stop)) if clip else peak
        peak = self.backward_peak(start, stop, rows)
        if clip and stop == self.num_layers:
            peak = max(peak, self.deferred_update_peak(start, stop))
        return peak

    def deferred_update_peak(self, start: int, stop: int) -> int:
        """An update ``grad_clip`` deferred: its gradients come back (0: nothing to update)."""
        owned = self._owned(start, stop)
        if not owned:
            return 0
        return (
            self.param_bytes(start, stop)
            + self.owned_bytes(start, stop)
            + self.optimizer_bytes(start, stop)
            + self.step_bytes(owned)
        )

    def step_bytes(self, owned: list[str]) -> int:
        """Scratch of an optimizer step over the parameters ``owned`` (one shard's update)."""
        return optimizer_step_bytes((self.profile.param_bytes[n] for n in owned),
                                    self.profile.foreach_optimizer, self.optimizer)

    def peak(self, start: int, stop: int, rows: int) -> int:
        """Largest task peak of a shard, whether or not it is the last one."""
        return max(
            self.task_peak("forward", start, stop, rows),
            self.task_peak("backward", start, stop, rows),
        )

    def rows_that_fit(self, start: int, stop: int, limit: int) -> int | None:
        """The largest microbatch (from the halving ladder) whose peak fits ``limit``."""
        for rows in self.row_options:
            if self.peak(start, stop, rows) <= limit:
                return rows
        return None

    def shard_rows(self, start: int, stop: int, limit: int) -> int | None:
        """A shard's microbatch: the largest each of its layers fits alone, if the shard fits.

        Microbatches stay as large as the layers allow (small ones run slower than FLOPs say);
        a shard only packs more layers at that size.
        """
        key = (start, stop, limit)
        if key not in self._shard_rows:
            rows = min(self._layer_rows(i, limit) or 0 for i in range(start, stop))
            fits = rows > 0 and self.peak(start, stop, rows) <= limit
            self._shard_rows[key] = rows if fits else None
        return self._shard_rows[key]

    def _layer_rows(self, index: int, limit: int) -> int | None:
        key = (index, index + 1, limit)
        if key not in self._shard_rows:
            self._shard_rows[key] = self.rows_that_fit(index, index + 1, limit)
        return self._shard_rows[key]

    def forward_s(self, start: int, stop: int) -> float:
        rows = self.profile.microbatch_size
        return self.scale(rows) * sum(layer.forward_s for layer in self.layers(rows)[start:stop])

    def backward_s(self, start: int, stop: int) -> float:
        rows = self.profile.microbatch_size
        return self.scale(rows) * sum(
            layer.forward_s + layer.backward_s for layer in self.layers(rows)[start:stop]
        )

