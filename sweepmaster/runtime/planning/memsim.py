"""Memory and time simulator of a shard's tasks under a swap/recompute plan (mu-TWO, Alg. G).

mu-TWO (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) checks every candidate
plan with a simulator that tracks live bytes and copies in flight. :func:`simulate_shard` does it
layer by layer for one shard's tasks, on the schedule :mod:`~sweepmaster.runtime.training.spill`
executes:

* **Forward task** (every shard but the last), per microbatch: promote the boundary input; run
  each layer (with grad when its activations are swapped, else without); after layer ``j`` its
  swapped activations (or, for a recomputed layer, its input: the checkpoint) start to offload on
  the copy stream, and layer ``j``'s compute waits at its end for layer ``j-1``'s offloads, so
  at most one layer's offloads are in flight; demote the boundary output; wait for the rest.
* **Backward task**, per microbatch: promote the output gradient; then one stage per layer, last
  to first. A stage waits for its item (swapped activations, or a recomputed layer's input) and
  issues the next stage's item on the copy stream (depth-1 prefetch, across microbatches too);
  a swapped layer runs its backward, a recomputed one its forward then its backward. The first
  item can be hidden behind ``overlap_s`` seconds of independent compute (other jobs' tasks).
  Then the just-in-time update (its peak is a constant of the shard).
* The **last shard** runs its forward inside the backward task: per layer, activations are kept
  (autograd as usual), swapped (offloaded in the forward, fetched back in the backward), or the
  layer is recomputed from its input, which stays on the device.

Bytes are the shard's parameters, the gradients alive, the boundary tensors and the layer's
profiled working set (:class:`~sweepmaster.runtime.planning.memtrace.LayerActivations`); times
are the profiled layer times plus copies at ``bandwidth`` bytes/s (boundary copies synchronous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sweepmaster.runtime.planning.memprofile import ShardMemoryProfile
from sweepmaster.runtime.planning.memtrace import LayerActivations

__all__ = [
    "LayerDecision", "ShardSimulation", "offload_items", "simulate_shard", "stage_item_bytes",
]

#: ``(phase, microbatch, layer position, peak bytes)`` of each layer pass.
Trace = list[tuple[str, int, int, int]]


@dataclass(frozen=True)
class LayerDecision:
    """What happens to one layer's saved activations between its forward and its backward.

    Attributes:
        recompute: The layer runs again from its input before its backward.
        swap: Otherwise, per activation (slot), whether it is swapped (else kept on the device).
    """

    recompute: bool
    swap: tuple[bool, ...]

    @classmethod
    def keep_all(cls, num_activations: int) -> LayerDecision:
        """Keep every activation on the device."""
        return cls(False, (False,) * num_activations)

    @classmethod
    def swap_all(cls, num_activations: int) -> LayerDecision:
        """Swap every activation."""
        return cls(False, (True,) * num_activations)

    @classmethod
    def recomputed(cls, num_activations: int) -> LayerDecision:
        """Recompute the layer."""
        return cls(True, (False,) * num_activations)

    @property
    def code(self) -> str:
        """``R`` (recompute), ``S`` (all swapped), ``K`` (all kept) or ``M`` (mixed)."""
        if self.recompute:
            return "R"
        if all(self.swap):
            return "S"
        return "K" if not any(self.swap) else "M"


@dataclass(frozen=True)
class ShardSimulation:
    """Predicted bytes and seconds of one shard's tasks over one minibatch.

    Attributes as :class:`~sweepmaster.runtime.planning.memplan.ShardMemoryPlan`'s, and:
        compute_s: Seconds of one forward and one backward of its layers, nothing else.
        forward_stall_s: Seconds the forward task waits for offloads.
        backward_stall_s: Seconds the backward task waits for fetches (and, in the last shard,
            offloads).
        early_fetch: Whether the backward task's first fetch runs during the previous task.
    """

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    forward_s: float
    backward_s: float
    compute_s: float
    recompute_s: float
    forward_stall_s: float
    backward_stall_s: float
    offload_bytes: int
    fetch_bytes: int
    early_fetch: bool = False

    @property
    def swap_bytes(self) -> int:
        """Activation bytes copied either way (bytes)."""
        return self.offload_bytes + self.fetch_bytes

    @property
    def stall_s(self) -> float:
        """Seconds compute waits for activation copies, both tasks."""
        return self.forward_stall_s + self.backward_stall_s

    @property
    def overhead_s(self) -> float:
        """Seconds its tasks take beyond ``compute_s`` (recompute, stalls, boundary copies)."""
        return self.forward_s + self.backward_s - self.compute_s


def offload_items(
    layer: LayerActivations, decision: LayerDecision, position: int, last: bool
) -> list[tuple[float, int]]:
    """The offloads a layer's forward starts: ``(seconds from its start, bytes)`` in order.

    A recomputed layer offloads its input (the checkpoint; not the shard input, which is on the
    host, and not in the last shard, which keeps it); a swapped activation goes when autograd
    saves it (a shard input saved by the first layer is on the host already). Every possible
    offload is listed, with 0 bytes when the decision does not make it.
    """
    checkpoint = layer.input_bytes if decision.recompute and position > 0 and not last else 0
    items = [(0.0, checkpoint)]
    swaps = decision.swap if not decision.recompute else (False,) * len(layer.activations)
    for activation, swap in zip(layer.activations, swaps, strict=True):
        on_host = position == 0 and activation.source == "input"
        items.append((activation.saved_s, activation.num_bytes if swap and not on_host else 0))
    return items


def stage_item_bytes(
    layer: LayerActivations, decision: LayerDecision, last: bool
) -> int:
    """Bytes fetched before a layer's backward stage."""
    if decision.recompute:
        return 0 if last else layer.input_bytes
    return sum(
        a.num_bytes for a, swap in zip(layer.activations, decision.swap, strict=True) if swap
    )


def _kept_bytes(layer: LayerActivations, decision: LayerDecision) -> int:
    """Bytes a layer leaves on the device between its forward and backward (last shard)."""
    if decision.recompute:
        return layer.input_bytes
    return sum(
        a.num_bytes for a, swap in zip(layer.activations, decision.swap, strict=True) if not swap
    )


def _stage_bytes(layer: LayerActivations, decision: LayerDecision, last: bool) -> int:
    """Working bytes of a layer's backward stage, beside what lives across the stages."""
    if decision.recompute:
        created = sum(a.num_bytes for a in layer.activations if a.source == "created")
        return layer.input_bytes + max(
            layer.grad_forward_peak_bytes, created + layer.backward_peak_bytes
        )
    return (
        _kept_bytes(layer, decision) + stage_item_bytes(layer, decision, last)
        + layer.backward_peak_bytes
    )


def simulate_shard(
    shard: ShardMemoryProfile, decisions: Sequence[LayerDecision], bandwidth: float,
    overlap_s: float = 0.0, trace: Trace | None = None, early: tuple[float, int] | None = None,
) -> ShardSimulation:
    """Simulate one shard's tasks over a minibatch (see the module doc).

    Args:
        shard: The shard's profile.
        decisions: One per layer of the shard.
        bandwidth: Host <-> device copy bandwidth (bytes/s).
        overlap_s: Seconds of independent compute on the device before the backward task that
            its first fetch can hide behind.
        trace: If given, receives each layer pass (``phase`` ``"forward"`` or ``"backward"``).
        early: ``(seconds, bytes)``: the backward task's first fetch may run during the job's
            previous task on the device, which lasts ``seconds`` and has ``bytes`` to spare
            (not the last shard); ``None``: it may not.

    Raises:
        ValueError: A decision keeps activations across tasks (not the last shard), or swaps
            activations of a layer that cannot be swapped.
    """
    layers = shard.layers
    if len(decisions) != len(layers):
        raise ValueError(f"{len(decisions)} decisions for {len(layers)} layers")
    for layer, decision in zip(layers, decisions, strict=True):
        if not decision.recompute and len(decision.swap) != len(layer.activations):
            raise ValueError(f"layer {layer.name}: decision for the wrong activations")
        if not shard.last and not decision.recompute and not all(decision.swap):
            raise ValueError(f"layer {layer.name}: only the last shard keeps activations")
        if not layer.swappable and not decision.recompute and any(decision.swap):
            raise ValueError(f"layer {layer.name} cannot be swapped")
    forward_s, forward_peak, forward_stall = 0.0, 0, 0.0
    if not shard.last:
        forward_s, forward_peak, forward_stall = _forward_task(shard, decisions, bandwidth, trace)
    backward_s, backward_peak, stall_s, early_fetch = _backward_task(
        shard, decisions, bandwidth, overlap_s, trace, early
    )
    compute = recompute = 0.0
    offloaded = fetched = 0
    for mb in range(shard.num_microbatches):
        for position, (layer, decision) in enumerate(
            zip(shard.microbatch_layers(mb), decisions, strict=True)
        ):
            compute += layer.forward_s + layer.backward_s
            recompute += layer.forward_s if decision.recompute else 0.0
            offloaded += sum(n for _, n in offload_items(layer, decision, position, shard.last))
            fetched += stage_item_bytes(layer, decision, shard.last)
    forward_peak = max(forward_peak, shard.forward_floor_bytes)
    backward_peak = max(backward_peak, shard.update_peak_bytes)
    return ShardSimulation(
        max(forward_peak, backward_peak), forward_peak, backward_peak, forward_s, backward_s,
        compute, recompute, forward_stall, stall_s, offloaded, fetched, early_fetch,
    )


def _forward_task(
    shard: ShardMemoryProfile, decisions: Sequence[LayerDecision], bandwidth: float,
    trace: Trace | None,
) -> tuple[float, int, float]:
    """Seconds, peak bytes and stall seconds of a forward task (not the last shard)."""
    peak, t, stall = 0, 0.0, 0.0
    for mb in range(shard.num_microbatches):
        layers = shard.microbatch_layers(mb)
        t += layers[0].input_bytes / bandwidth  # promote the boundary input
        t, done, mb_peak, waited = _forward_layers(
            shard, decisions, bandwidth, t, mb, shard.param_bytes, trace
        )
        peak = max(peak, mb_peak)
        t += layers[-1].output_bytes / bandwidth  # demote the boundary output
        stall += waited + max(0.0, done - t)
        t = max(t, done)
    return t, peak, stall


def _forward_layers(
    shard: ShardMemoryProfile, decisions: Sequence[LayerDecision], bandwidth: float, t: float,
    mb: int, base: int, trace: Trace | None,
) -> tuple[float, float, int, float]:
    """One microbatch's layers from ``t``: compute end, offloads end, peak bytes, stall.

    Layer ``j``'s offloads start on the copy stream when made; its compute waits at its end
    for layer ``j-1``'s offloads, whose sources are live until then.
    """
    layers = shard.microbatch_layers(mb)
    peak = kept = pending = 0
    copy_free = done = t
    stall = 0.0
    for position, (layer, decision) in enumerate(zip(layers, decisions, strict=True)):
        working = layer.forward_peak_bytes if decision.recompute else (
            layer.grad_forward_peak_bytes
        )
        live = base + kept + layer.input_bytes + pending + working
        peak = max(peak, live)
        if trace is not None:
            trace.append(("forward", mb, position, live))
        layer_start = t
        t += layer.forward_s
        off = 0
        for offset, num_bytes in offload_items(layer, decision, position, shard.last):
            copy_free = max(copy_free, layer_start + offset) + num_bytes / bandwidth
            off += num_bytes
        if position > 0:  # wait for the previous layer's offloads
            stall += max(0.0, done - t)
            t = max(t, done)
        pending, done = off, copy_free
        if shard.last:
            kept += _kept_bytes(layer, decision)
    return t, done, peak, stall


def _backward_task(
    shard: ShardMemoryProfile, decisions: Sequence[LayerDecision], bandwidth: float,
    overlap_s: float, trace: Trace | None, early: tuple[float, int] | None,
) -> tuple[float, int, float, bool]:
    """Seconds, peak bytes, stall seconds of a backward task; whether it fetches early."""
    num_layers = len(decisions)
    params = shard.param_bytes
    last = shard.last
    items = [
        [stage_item_bytes(layer, d, last) for layer, d in zip(layers, decisions, strict=True)]
        for layers in map(shard.microbatch_layers, range(shard.num_microbatches))
    ]
    backward_order = range(num_layers - 1, -1, -1)
    order = [(mb, j) for mb in range(shard.num_microbatches) for j in backward_order]
    peak, stall, t = 0, 0.0, 0.0
    copy_free = -overlap_s
    arrival: float | None = None  # of the current stage's item
    early_fetch = False
    if not last:  # the first item is fetched from the start of the task (or before it)
        if early is not None and early[0] > 0 and items[0][-1] <= early[1]:
            copy_free -= early[0]
            early_fetch = True
        arrival = copy_free + items[0][-1] / bandwidth
        copy_free = arrival
    for k, (mb, j) in enumerate(order):
        layers = shard.microbatch_layers(mb)
        layer, decision = layers[j], decisions[j]
        multi = mb > 0 and shard.num_microbatches > 1
        grads = shard.grad_bytes if multi else shard.grad_bytes_after[j]
        kept_before = 0
        if j == num_layers - 1:  # a microbatch starts
            if last:  # promote the input and the loss's ids, run the forward
                t += (layers[0].input_bytes + shard.loss_ids_bytes) / bandwidth
                grads = shard.grad_bytes if mb > 0 else 0
                base = shard.param_bytes + grads + shard.loss_ids_bytes
                t, done, fwd_peak, waited = _forward_layers(shard, decisions, bandwidth, t, mb,
                                                            base, trace)
                peak = max(peak, fwd_peak)
                stall += waited + max(0.0, done - t)
                t = max(t, done)
                arrival = t + items[mb][-1] / bandwidth
                copy_free = arrival
            else:
                t += layer.output_bytes / bandwidth  # promote the output gradient
        if last:
            kept_before = sum(_kept_bytes(lay, d) for lay, d in zip(layers[:j], decisions[:j],
                                                                   strict=True))
        assert arrival is not None
        start = max(t, arrival)
        stall += start - t
        next_bytes = 0
        if k + 1 < len(order):
            nmb, nj = order[k + 1]
            next_bytes = items[nmb][nj]
            if not (last and nj == num_layers - 1):  # the last shard fetches it after its forward
                arrival = max(copy_free, start) + next_bytes / bandwidth
                copy_free = arrival
            else:
                next_bytes = 0
        working = _stage_bytes(layer, decision, last)
        live = params + grads + shard.loss_ids_bytes + kept_before + layer.output_bytes
        peak = max(peak, live + next_bytes + working)
        if trace is not None:
            trace.append(("backward", mb, j, live + next_bytes + working))
        t = start + layer.backward_s + (layer.forward_s if decision.recompute else 0.0)
        if j == 0 and shard.index > 0:
            t += layer.input_bytes / bandwidth  # demote the input gradient
    return t, peak, stall, early_fetch
