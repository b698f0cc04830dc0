"""Optimal swap-vs-recompute decisions of a shard: a MILP over the simulator's equations.

The reference the greedy of :mod:`~sweepmaster.runtime.planning.memplan` (mu-TWO, Purandare et al.,
MLSys 2023) is measured against. For a shard other than the last, each layer is swapped
(``s_j = 1``) or recomputed (``s_j = 0``); every quantity
:func:`~sweepmaster.runtime.planning.memsim.simulate_shard` computes is linear in ``s`` or a
maximum of linear terms, so the MILP below is exact for the simulator:

* bytes: each layer pass of each task (forward with the previous layer's offloads in flight,
  backward stage with the next stage's prefetch) is a linear expression ``<= budget``;
* seconds: the simulator's recurrences ``t = max(a, b) + d`` become ``t >= a + d``,
  ``t >= b + d`` for the compute chain and the copy stream of both tasks; minimizing the end
  times makes them tight on the critical path.

The objective is the forward task's end plus the backward task's end; minus the shard's
compute, it is the simulator's ``overhead_s``. Solved by HiGHS (``scipy.optimize.milp``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from sweepmaster.runtime.planning.memprofile import ShardMemoryProfile
from sweepmaster.runtime.planning.memsim import (
    LayerDecision,
    _stage_bytes,
    offload_items,
    stage_item_bytes,
)
from sweepmaster.runtime.planning.memtrace import ActivationProfile, LayerActivations

__all__ = ["optimal_shard_decisions", "random_shard_profile"]

#: A linear expression: coefficients by variable, plus a constant.
Expr = tuple[dict[int, float], float]
#: The bytes of a layer pass as a function of its decision variable.
LayerBytes = Callable[[LayerActivations, int], Expr]
#: A layer's offloads: ``(seconds from its start, bytes)`` as functions of its decision.
LayerOffloads = Callable[[LayerActivations, int], list[tuple[float, Expr]]]


class _Model:
    """Variables and constraint rows of a MILP under construction."""

    def __init__(self) -> None:
        self.num = 0
        self.integer: list[int] = []
        self.rows: list[dict[int, float]] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def var(self, integer: bool = False) -> int:
        """A new variable (binary when ``integer``, else continuous); its index."""
        self.num += 1
        self.integer.append(1 if integer else 0)
        return self.num - 1

    def add(self, coeffs: dict[int, float], lower: float, upper: float) -> None:
        """``lower <= sum(coeffs) <= upper``."""
        self.rows.append(coeffs)
        self.lower.append(lower)
        self.upper.append(upper)

    def at_least(self, coeffs: dict[int, float], constant: float = 0.0) -> None:
        """``sum(coeffs) >= constant``."""
        self.add(coeffs, constant, np.inf)

    def after(self, var: int, expr: Expr) -> None:
        """``var >= expr``."""
        self.at_least({var: 1.0, **{k: -v for k, v in expr[0].items()}}, expr[1])


def _linear(s: int, if_swap: float, if_recompute: float) -> Expr:
    """``s * if_swap + (1 - s) * if_recompute`` as (coefficients, constant)."""
    return {s: if_swap - if_recompute}, if_recompute


def _per(expr: Expr, bandwidth: float) -> Expr:
    """Seconds of copying ``expr`` bytes."""
    return {k: v / bandwidth for k, v in expr[0].items()}, expr[1] / bandwidth


def _merge(*terms: Expr) -> Expr:
    coeffs: dict[int, float] = {}
    constant = 0.0
    for term, c in terms:
        for key, value in term.items():
            coeffs[key] = coeffs.get(key, 0.0) + value
        constant += c
    return coeffs, constant


def optimal_shard_decisions(
    shard: ShardMemoryProfile, budget_bytes: int, bandwidth: float, overlap_s: float = 0.0,
    early: tuple[float, int] | None = None, time_limit_s: float = 60.0,
) -> tuple[LayerDecision, ...]:
    """Swap or recompute each layer of a shard (not the last) at the least simulated time.

    Arguments as :func:`~sweepmaster.runtime.planning.memsim.simulate_shard`'s, with the peak
    ``budget_bytes`` and HiGHS's ``time_limit_s`` (seconds).

    Raises:
        ValueError: The last shard, or no decisions fit the budget.
    """
    if shard.last:
        raise ValueError("the MILP plans shards that leave the device between tasks")
    if max(shard.update_peak_bytes, shard.forward_floor_bytes) > budget_bytes:
        raise ValueError(f"shard {shard.index}: its optimizer step alone exceeds the budget")
    num_layers = len(shard.layers)
    model = _Model()
    s = [model.var(integer=True) for _ in range(num_layers)]
    for j, layer in enumerate(shard.layers):
        if not layer.swappable:
            model.add({s[j]: 1.0}, 0.0, 0.0)
    per_mb = [shard.microbatch_layers(mb) for mb in range(shard.num_microbatches)]
    swap_all = [LayerDecision.swap_all(len(layer.activations)) for layer in shard.layers]
    redo = [LayerDecision.recomputed(len(layer.activations)) for layer in shard.layers]

    def item(layer: LayerActivations, j: int) -> Expr:
        swapped = stage_item_bytes(layer, swap_all[j], False)
        return _linear(s[j], swapped, stage_item_bytes(layer, redo[j], False))

    def stage(layer: LayerActivations, j: int) -> Expr:
        swapped = _stage_bytes(layer, swap_all[j], False)
        return _linear(s[j], swapped, _stage_bytes(layer, redo[j], False))

    def offloads(layer: LayerActivations, j: int) -> list[tuple[float, Expr]]:
        swapped = offload_items(layer, swap_all[j], j, False)
        recomputed = offload_items(layer, redo[j], j, False)
        return [
            (offset, _linear(s[j], if_swap, if_recompute))
            for (offset, if_swap), (_, if_recompute) in zip(swapped, recomputed, strict=True)
        ]

    forward_end = _forward(model, shard, per_mb, s, offloads, bandwidth, budget_bytes)
    backward_end = _backward(model, shard, per_mb, s, item, stage, bandwidth, overlap_s, early,
                             budget_bytes)
    cost = np.zeros(model.num)
    cost[forward_end] = 1.0
    cost[backward_end] = 1.0
    matrix = np.zeros((len(model.rows), model.num))
    for i, row in enumerate(model.rows):
        for key, value in row.items():
            matrix[i, key] = value
    bounds_lo = np.full(model.num, -np.inf)
    bounds_hi = np.full(model.num, np.inf)
    for var in s:
        bounds_lo[var], bounds_hi[var] = 0.0, 1.0
    result = milp(
        cost, constraints=LinearConstraint(matrix, np.array(model.lower), np.array(model.upper)),
        integrality=np.array(model.integer), bounds=Bounds(bounds_lo, bounds_hi),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
    )
    if result.x is None:
        raise ValueError(f"shard {shard.index}: no swap/recompute decisions fit the budget")
    return tuple(swap_all[j] if result.x[s[j]] > 0.5 else redo[j] for j in range(num_layers))


def _forward(
    model: _Model, shard: ShardMemoryProfile, per_mb: Sequence[Sequence[LayerActivations]],
    s: Sequence[int], offloads: LayerOffloads, bandwidth: float, budget: int,
) -> int:
    """Forward task: memory rows and time variables; returns the end-time variable."""
    params = shard.param_bytes
    start: Expr = ({}, 0.0)
    end = -1
    for layers in per_mb:
        c_prev = _merge(start, ({}, layers[0].input_bytes / bandwidth))  # a layer's start
        copy_free = c_prev
        done = c_prev  # the previous layer's offloads end
        pending: Expr = ({}, 0.0)
        for j, layer in enumerate(layers):
            working = _linear(s[j], layer.grad_forward_peak_bytes, layer.forward_peak_bytes)
            coeffs, constant = _merge(working, pending, ({}, params + layer.input_bytes))
            model.add(coeffs, -np.inf, budget - constant)
            layer_start = c_prev
            a = _merge(c_prev, ({}, layer.forward_s))  # compute end before waiting
            pending = ({}, 0.0)
            for offset, num_bytes in offloads(layer, j):
                o = model.var()
                for base in (copy_free, _merge(layer_start, ({}, offset))):
                    model.after(o, _merge(base, _per(num_bytes, bandwidth)))  # o >= max + copy
                copy_free = ({o: 1.0}, 0.0)
                pending = _merge(pending, num_bytes)
            if j > 0:
                c = model.var()
                for base in (a, done):  # c >= max(a, previous layer's offloads)
                    model.after(c, base)
                c_prev = ({c: 1.0}, 0.0)
            else:
                c_prev = a
            done = copy_free
        end = model.var()
        finished = _merge(c_prev, ({}, layers[-1].output_bytes / bandwidth))
        for base in (finished, done):
            model.after(end, base)
        start = ({end: 1.0}, 0.0)
    return end


def _backward(
    model: _Model, shard: ShardMemoryProfile, per_mb: Sequence[Sequence[LayerActivations]],
    s: Sequence[int], item: LayerBytes, stage: LayerBytes, bandwidth: float, overlap_s: float,
    early: tuple[float, int] | None, budget: int,
) -> int:
    """Backward task: memory rows and time variables; returns the end-time variable."""
    num_layers = len(shard.layers)
    order = [(mb, j) for mb in range(len(per_mb)) for j in range(num_layers - 1, -1, -1)]
    params = shard.param_bytes
    first = item(per_mb[0][-1], num_layers - 1)
    arrival = model.var()
    coeffs, constant = first
    bound = {arrival: 1.0, **{k: -v / bandwidth for k, v in coeffs.items()}}
    if early is not None and early[0] > 0:  # fetched during the previous task if it fits
        fetched_early = model.var(integer=True)
        model.add({fetched_early: 1.0}, 0.0, 1.0)
        big = float(constant + sum(abs(v) for v in coeffs.values()))
        model.add({**coeffs, fetched_early: big}, -np.inf, early[1] - constant + big)
        bound[fetched_early] = early[0]
    model.at_least(bound, constant / bandwidth - overlap_s)
    end_prev: Expr = ({}, 0.0)
    end = -1
    for k, (mb, j) in enumerate(order):
        layer = per_mb[mb][j]
        ready = end_prev
        if j == num_layers - 1:
            ready = _merge(ready, ({}, layer.output_bytes / bandwidth))
        start = model.var()
        for base in (ready, ({arrival: 1.0}, 0.0)):
            model.after(start, base)
        next_item: Expr = ({}, 0.0)
        if k + 1 < len(order):
            nmb, nj = order[k + 1]
            next_item = item(per_mb[nmb][nj], nj)
            following = model.var()
            for base in (({arrival: 1.0}, 0.0), ({start: 1.0}, 0.0)):
                model.after(following, _merge(base, _per(next_item, bandwidth)))
            arrival = following
        grads = shard.grad_bytes if mb > 0 and shard.num_microbatches > 1 else (
            shard.grad_bytes_after[j]
        )
        coeffs, constant = _merge(stage(layer, j), next_item,
                                  ({}, params + grads + layer.output_bytes))
        model.add(coeffs, -np.inf, budget - constant)
        tail = layer.input_bytes / bandwidth if j == 0 and shard.index > 0 else 0.0
        end_prev = ({start: 1.0, s[j]: -layer.forward_s},
                    layer.backward_s + layer.forward_s + tail)
        if k + 1 == len(order):
            end = model.var()
            model.after(end, end_prev)
    return end


def random_shard_profile(
    rng: random.Random, num_layers: int, num_microbatches: int
) -> ShardMemoryProfile:
    """A synthetic shard profile, to compare the greedy planner with the optimum.

    Layers of 4 or 8 KiB width saving 1 to 5 activations of 1 to 6 widths each, forward times of
    1 to 5 ms (backward 1.5 to 2.5 times that), 10% of the layers not swappable, 20 to 60 KiB of
    parameters, drawn from ``rng``. Used by the tests and by ``bench/memplan.py``.
    """
    kib = 1024
    layers = []
    for j in range(num_layers):
        width = rng.choice([4, 8]) * kib
        acts = [ActivationProfile(0, width, "input", "", 0.0, 0.0, 0.0)]
        acts += [
            ActivationProfile(k, rng.randint(1, 6) * width, "created", "op", 0.0, 0.0, 0.0)
            for k in range(1, rng.randint(2, 6))
        ]
        forward_s = rng.uniform(1, 5) * 1e-3
        layers.append(LayerActivations(
            index=j, name=f"layer.{j}", rows=2, activations=tuple(acts), input_bytes=width,
            output_bytes=width, forward_s=forward_s,
            backward_s=forward_s * rng.uniform(1.5, 2.5), forward_peak_bytes=3 * width,
            grad_forward_peak_bytes=sum(a.num_bytes for a in acts) + width,
            backward_peak_bytes=(2 + rng.randint(0, 4)) * width, swappable=rng.random() > 0.1,
        ))
    params = rng.randint(20, 60) * kib
    return ShardMemoryProfile(
        index=1, last=False, num_microbatches=num_microbatches, layers=tuple(layers),
        param_bytes=params,
        grad_bytes_after=tuple(params * (num_layers - 1 - j) // num_layers
                               for j in range(num_layers)),
        grad_bytes=params, update_peak_bytes=3 * params, forward_floor_bytes=0,
        loss_ids_bytes=0, between_s=0.0,
    )
