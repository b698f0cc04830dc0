"""mu-TWO's greedy choice of one shard's keep / swap / recompute decisions (Algorithms B and C).

mu-TWO (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) starts a shard from
Hydra's full recompute (keep everything, for the last shard) and, while the simulated peak
(:func:`~sweepmaster.runtime.planning.memsim.simulate_shard`, Alg. G) exceeds the budget, takes
the move that frees the most peak bytes per second of added time: swaps ordered by inactive time
(Alg. B), recomputes by bytes per second of recompute (Alg. C). Then, in the same orders, it
accepts every move that lowers the simulated time within the budget.
:func:`~sweepmaster.runtime.planning.memplan_milp.optimal_shard_decisions` solves the same
choice exactly; :func:`~sweepmaster.runtime.planning.memplan.plan_memory` plans a job's shards
with either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sweepmaster.runtime.devices.meter import format_bytes
from sweepmaster.runtime.planning.memprofile import ShardMemoryProfile
from sweepmaster.runtime.planning.memsim import LayerDecision, ShardSimulation, simulate_shard

__all__ = ["MemoryPlanError", "greedy_shard_decisions"]

#: Relative improvement below which a move does not count (floating-point noise).
_EPSILON = 1e-9


class MemoryPlanError(ValueError):
    """No swap/recompute plan keeps a shard within the budget.

    Attributes:
        shard: The shard index.
        num_bytes: The lowest peak found (bytes).
        budget_bytes: The budget (bytes).
    """

    def __init__(self, shard: int, num_bytes: int, budget_bytes: int) -> None:
        self.shard = shard
        self.num_bytes = num_bytes
        self.budget_bytes = budget_bytes
        super().__init__(
            f"shard {shard}: no keep/swap/recompute plan found within the budget of "
            f"{format_bytes(budget_bytes)}, the best needs {format_bytes(num_bytes)}: plan the "
            "job for this budget (more shards) or use a smaller microbatch_size"
        )


def greedy_shard_decisions(
    shard: ShardMemoryProfile, budget_bytes: int, bandwidth: float, overlap_s: float = 0.0,
    early: tuple[float, int] | None = None,
) -> tuple[LayerDecision, ...]:
    """mu-TWO's greedy for one shard (Algorithms B and C with the simulator, see module doc).

    Raises:
        MemoryPlanError: No decisions found that fit ``budget_bytes``.
    """
    layers = shard.layers
    if shard.last:
        decisions = [LayerDecision.keep_all(len(layer.activations)) for layer in layers]
    else:
        decisions = [LayerDecision.recomputed(len(layer.activations)) for layer in layers]

    def simulate(candidate: Sequence[LayerDecision]) -> ShardSimulation:
        return simulate_shard(shard, candidate, bandwidth, overlap_s, early=early)

    current = simulate(decisions)
    moves = _moves(shard)
    while current.peak_bytes > budget_bytes:  # fit: most bytes freed per second added
        best: tuple[float, float, list[LayerDecision], ShardSimulation] | None = None
        for move in moves:
            candidate = move(decisions)
            if candidate is None:
                continue
            sim = simulate(candidate)
            freed = current.peak_bytes - sim.peak_bytes
            if freed <= 0:
                continue
            added = max(sim.overhead_s - current.overhead_s, 0.0)
            score = freed / added if added > 0 else math.inf
            if best is None or (score, -sim.overhead_s) > (best[0], -best[1]):
                best = (score, sim.overhead_s, candidate, sim)
        if best is None:
            raise MemoryPlanError(shard.index, current.peak_bytes, budget_bytes)
        decisions, current = best[2], best[3]
    for _ in range(4 * len(layers) + 4):  # improve: first improvement in mu-TWO's orders
        improved = False
        for move in moves:
            candidate = move(decisions)
            if candidate is None:
                continue
            sim = simulate(candidate)
            if sim.peak_bytes <= budget_bytes and _better(sim, current):
                decisions, current, improved = candidate, sim, True
        if not improved:
            break
    return tuple(decisions)


def _better(sim: ShardSimulation, current: ShardSimulation) -> bool:
    """Less overhead, or as much with fewer bytes swapped."""
    tolerance = _EPSILON * max(current.overhead_s, 1e-12)
    if sim.overhead_s < current.overhead_s - tolerance:
        return True
    return sim.overhead_s <= current.overhead_s + tolerance and sim.swap_bytes < current.swap_bytes


def _moves(shard: ShardMemoryProfile) -> list[_Move]:
    """Candidate changes, swaps by inactive time (longest first), then recomputes by ratio."""
    layers = shard.layers
    swaps: list[tuple[float, _Move]] = []
    recomputes: list[tuple[float, _Move]] = []
    later_forward = [sum(layer.forward_s for layer in layers[j + 1 :]) for j in range(len(layers))]
    later_backward = [
        sum(layer.backward_s for layer in layers[j + 1 :]) for j in range(len(layers))
    ]
    for j, layer in enumerate(layers):
        num = len(layer.activations)
        inactive = [  # forward rest, later layers' forwards, other tasks, backwards until its own
            (layer.forward_s - a.last_use_s) + later_forward[j] + shard.between_s
            + later_backward[j]
            + layer.backward_s * (1 - a.last_use_s / layer.forward_s if layer.forward_s else 0)
            for a in layer.activations
        ]
        ratio = layer.saved_bytes / layer.forward_s if layer.forward_s > 0 else math.inf
        recomputes.append((ratio, _Move(j, "recompute", num)))
        if not layer.swappable:
            if shard.last:
                swaps.append((math.inf, _Move(j, "keep", num)))
            continue
        swaps.append((min(inactive, default=math.inf), _Move(j, "swap", num)))
        if shard.last:
            swaps.append((math.inf, _Move(j, "keep", num)))
            for k in range(num):
                swaps.append((inactive[k], _Move(j, "swap", num, k)))
                swaps.append((inactive[k], _Move(j, "keep", num, k)))
    swaps.sort(key=lambda item: -item[0])
    recomputes.sort(key=lambda item: -item[0])
    return [move for _, move in swaps] + [move for _, move in recomputes]


@dataclass(frozen=True)
class _Move:
    """Set layer ``layer`` (or one of its activations) to ``keep``, ``swap`` or ``recompute``."""

    layer: int
    kind: str
    num_activations: int
    activation: int | None = None

    def __call__(self, decisions: Sequence[LayerDecision]) -> list[LayerDecision] | None:
        old = decisions[self.layer]
        num = self.num_activations
        if self.kind == "recompute":
            new = LayerDecision.recomputed(num)
        elif self.activation is None:
            new = LayerDecision.swap_all(num) if self.kind == "swap" else (
                LayerDecision.keep_all(num)
            )
        else:
            base = list(old.swap) if not old.recompute else [False] * num
            base[self.activation] = self.kind == "swap"
            new = LayerDecision(False, tuple(base))
        if new == old:
            return None
        changed = list(decisions)
        changed[self.layer] = new
        return changed
