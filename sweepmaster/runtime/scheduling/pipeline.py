"""Pipelined mode: one job's shards over several devices, microbatches flowing through.

Harmony (Li et al., "Harmony: Overcoming the Hurdles of GPU Memory Capacity to Train Massive DNN
Models on Commodity Servers", VLDB 2022, https://arxiv.org/abs/2202.01306) binds tasks to devices
late: when runnable jobs are fewer than free devices, one job's shards are split into contiguous
*packs*, one per device (balanced-time layer packing, Algorithm 2: the cut points come from
:func:`~sweepmaster.runtime.planning.partition.pipeline_packs`), each pack's parameters and
optimizer state stay resident on its device, and the minibatch's M microbatches flow through the
packs as a pipeline with input-batch grouping, flushed at the end of each step (synchronous SGD).
Boundary activations and their gradients cross between adjacent packs device to device (p2p),
not through the host.

This module holds the pure parts: what a job must tell the policy to be pipelined
(:class:`PipelineShape`), what the policy decides (:class:`PipelineDecision`, returned by
:meth:`~sweepmaster.runtime.scheduling.scheduler.Policy.next_pipeline`), and the one cost model of
a pipelined step (:func:`pipeline_step`, :func:`pipeline_unload`) that the policy, the simulator
and ``sweepmaster plan`` share.

Step time (GPipe-style schedule, all forwards then all backwards, flushed): a phase over stages
with per-minibatch times ``t_1..t_n`` (pack computes and boundary copies), each stage processing
the M microbatches in order at ``t_i / M`` apiece, takes ``(sum(t) + (M - 1) * max(t)) / M``
seconds (the makespan of a flow shop with M identical jobs). The forward phase's stages are the
input copy, pack 0's forward, the crossing to pack 1, ..., the last pack's forward; the backward
phase runs the packs' backwards (just-in-time update included) in reverse, with the gradient
crossings between them. A crossing is one p2p copy at ``p2p_bytes_per_s``, or without p2p a
device -> host copy then a host -> device copy at ``host_bytes_per_s`` (two stages).

Example:
    >>> shape = PipelineShape(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0),
    ...                       state_bytes=(12, 12), boundary_bytes=(4, 0), input_bytes=8,
    ...                       num_microbatches=2, packs=((0, 1, 2),))
    >>> step = pipeline_step(shape, (0, 1, 2))
    >>> step.seconds, step.p2p_bytes, step.host_to_device_bytes
    (4.5, 8, 8)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PipelineDecision",
    "PipelineShape",
    "PipelineStep",
    "choose_packs",
    "pipeline_step",
    "place",
    "pipeline_unload",
]


@dataclass(frozen=True)
class PipelineShape:
    """What pipelining a job needs: per shard times and bytes, and its pack layouts.

    Attributes:
        forward_s: Seconds of each shard's forward over one minibatch, ``(S,)`` (the last
            shard's forward may be 0 when ``backward_s`` holds its forward too).
        backward_s: Seconds of each shard's backward and just-in-time update over one
            minibatch, ``(S,)``.
        state_bytes: Parameters and optimizer state of each shard, ``(S,)`` (bytes): what a pack
            keeps resident on its device, loaded once per placement and written back when the
            placement ends.
        boundary_bytes: Each shard's output activation over one minibatch, ``(S,)`` (bytes); a
            pack ending at shard ``s`` sends it to the next pack, and its gradient comes back.
            The last entry is not used.
        input_bytes: Host -> device bytes every step needs (token ids; bytes).
        num_microbatches: M, microbatches per minibatch flowing through the pipeline.
        packs: The pack layouts the planner offers, each the cut points ``(0, c1, ..., S)`` of
            at least two contiguous packs (one per device), fewest packs first; from
            :func:`~sweepmaster.runtime.planning.partition.pipeline_packs`.
        borrowed_bytes: Tied parameters each shard uses but an earlier shard owns, ``(S,)``
            (bytes); empty: none. In a pack after the first, their gradient contribution goes to
            the owner's pack and the updated values come back, once per step.

    Raises:
        ValueError: Lengths differ from ``S``, a negative time or size, ``num_microbatches < 1``,
            or a layout that is not increasing from 0 to ``S`` with at least two packs.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    state_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]
    input_bytes: int
    num_microbatches: int
    packs: tuple[tuple[int, ...], ...]
    borrowed_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        lengths = {len(self.backward_s), len(self.state_bytes), len(self.boundary_bytes)}
        if n < 2 or lengths != {n} or len(self.borrowed_bytes) not in (0, n):
            raise ValueError(f"a pipeline needs >= 2 shards and one entry per shard, got {n} "
                             f"shards and lengths {sorted(lengths)}")
        values = (*self.forward_s, *self.backward_s, *self.state_bytes, *self.boundary_bytes,
                  *self.borrowed_bytes, self.input_bytes)
        if min(values) < 0 or self.num_microbatches < 1:
            raise ValueError("pipeline times and bytes must be >= 0 and num_microbatches >= 1")
        for cuts in self.packs:
            if (len(cuts) < 3 or cuts[0] != 0 or cuts[-1] != n
                    or any(a >= b for a, b in zip(cuts, cuts[1:], strict=False))):
                raise ValueError(f"pack cut points {cuts} are not 0 < ... < {n}")

    @property
    def num_shards(self) -> int:
        """S, the shards."""
        return len(self.forward_s)


@dataclass(frozen=True)
class PipelineDecision:
    """A policy's decision: one step of a job pipelined over several devices.

    Attributes:
        job_id: The job.
        first_index: Its first task index of the step; the step stands for tasks
            ``first_index .. first_index + num_tasks - 1`` of the job's chain.
        num_tasks: Tasks of the step (``2 S - 1``).
        devices: The devices, one per pack, in pack order.
        cuts: Cut points of the packs over the shards, ``(0, c1, ..., S)``.
        load: Whether the packs must be loaded (host -> device): False when the job's previous
            step ran with the same packs on the same devices, which still hold them.
        est_seconds: Estimated compute seconds of the step (:func:`pipeline_step` with
            instant copies).
    """

    job_id: str
    first_index: int
    num_tasks: int
    devices: tuple[int, ...]
    cuts: tuple[int, ...]
    load: bool
    est_seconds: float

    @property
    def packs(self) -> tuple[tuple[int, ...], ...]:
        """The shards of each device's pack, in pack order."""
        return tuple(tuple(range(a, b)) for a, b in zip(self.cuts, self.cuts[1:], strict=False))


@dataclass(frozen=True)
class PipelineStep:
    """Time and bytes of one pipelined step (see the module doc for the model).

    Attributes:
        seconds: Step time: the packs' load when asked, then both phases.
        load_s: Seconds of loading the packs (each device over its own link; 0 without load).
        host_to_device_bytes: Host -> device bytes: inputs, the packs' state when loaded,
            crossings without p2p.
        device_to_host_bytes: Device -> host bytes (crossings without p2p).
        p2p_bytes: Device -> device bytes (boundary activations, their gradients, tied
            parameters' contributions and values).
        device_host_bytes: Per pack, ``(host -> device, device -> host)`` bytes of its device.
    """

    seconds: float
    load_s: float
    host_to_device_bytes: int
    device_to_host_bytes: int
    p2p_bytes: int
    device_host_bytes: tuple[tuple[int, int], ...]


def choose_packs(shape: PipelineShape, max_devices: int) -> tuple[int, ...] | None:
    """The layout with the most packs that fits ``max_devices`` devices, or None.

    Args:
        shape: The job's pipeline shape.
        max_devices: Devices the pipeline may take.
    """
    best = None
    for cuts in shape.packs:
        if len(cuts) - 1 <= max_devices and (best is None or len(cuts) > len(best)):
            best = cuts
    return best


def place(
    free: Sequence[int],
    cuts: tuple[int, ...],
    held: tuple[tuple[int, ...], tuple[int, ...]] | None,
) -> tuple[tuple[int, ...], bool]:
    """The devices of a pipelined step, and whether its packs must be loaded.

    Args:
        free: The free devices.
        cuts: The packs' cut points.
        held: ``(devices, cuts)`` of the job's packs still on devices, or None.

    Returns:
        ``held``'s devices without a load when the layout is the same and they are all free;
        else the free devices of ``held`` first, then the others in order, with a load.
    """
    if held is not None and held[1] == cuts and set(held[0]) <= set(free):
        return held[0], False
    previous = [] if held is None else [d for d in held[0] if d in free]
    order = previous + [d for d in free if d not in previous]
    return tuple(order[: len(cuts) - 1]), True


def _phase_s(stages_s: Sequence[float], num_microbatches: int) -> float:
    """Flow-shop makespan of M identical microbatches over stages of per-minibatch seconds."""
    return (sum(stages_s) + (num_microbatches - 1) * max(stages_s)) / num_microbatches


def pipeline_step(
    shape: PipelineShape,
    cuts: Sequence[int],
    *,
    load: bool = False,
    p2p: bool = True,
    host_bytes_per_s: float = math.inf,
    p2p_bytes_per_s: float = math.inf,
) -> PipelineStep:
    """Time and bytes of one step of ``shape`` pipelined over the packs of ``cuts``.

    Args:
        shape: The job.
        cuts: Cut points ``(0, c1, ..., S)`` of the packs.
        load: Load each pack's state host -> device first (a new placement).
        p2p: Crossings go device -> device; False: through the host (down, then up).
        host_bytes_per_s: Host <-> device bandwidth of each device's link (bytes/s).
        p2p_bytes_per_s: Device -> device bandwidth (bytes/s).

    Returns:
        The step's seconds and bytes.
    """
    bounds = list(zip(cuts, cuts[1:], strict=False))
    fwd = [sum(shape.forward_s[a:b]) for a, b in bounds]
    bwd = [sum(shape.backward_s[a:b]) for a, b in bounds]
    crossing = [shape.boundary_bytes[b - 1] for _, b in bounds[:-1]]
    tied = sum(sum(shape.borrowed_bytes[a:b]) for a, b in bounds[1:]) if shape.borrowed_bytes \
        else 0

    def hops(num_bytes: int) -> list[float]:
        if p2p:
            return [num_bytes / p2p_bytes_per_s]
        return [num_bytes / host_bytes_per_s] * 2

    forward_stages = [shape.input_bytes / host_bytes_per_s]
    backward_stages: list[float] = []
    for p in range(len(bounds)):
        forward_stages.append(fwd[p])
        backward_stages.append(bwd[-1 - p])
        if p < len(crossing):
            forward_stages += hops(crossing[p])
            backward_stages += hops(crossing[-1 - p])
    m = shape.num_microbatches
    load_bytes = [sum(shape.state_bytes[a:b]) if load else 0 for a, b in bounds]
    load_s = max(load_bytes) / host_bytes_per_s
    seconds = load_s + _phase_s(forward_stages, m) + _phase_s(backward_stages, m)
    crossed = 2 * sum(crossing) + 2 * tied
    up = [load_bytes[p] + (shape.input_bytes if p == 0 else 0) for p in range(len(bounds))]
    down = [0] * len(bounds)
    if not p2p:  # each crossing: the sender writes it to the host, the receiver reads it
        for p, num_bytes in enumerate(crossing):
            down[p] += num_bytes
            up[p + 1] += num_bytes
            up[p] += num_bytes  # its gradient comes back
            down[p + 1] += num_bytes
        for p, (a, b) in enumerate(bounds[1:], 1):
            num_bytes = sum(shape.borrowed_bytes[a:b]) if shape.borrowed_bytes else 0
            down[p] += num_bytes
            up[0] += num_bytes
            down[0] += num_bytes
            up[p] += num_bytes
    return PipelineStep(
        seconds=seconds,
        load_s=load_s,
        host_to_device_bytes=sum(up),
        device_to_host_bytes=sum(down),
        p2p_bytes=crossed if p2p else 0,
        device_host_bytes=tuple(zip(up, down, strict=True)),
    )


def pipeline_unload(
    shape: PipelineShape, cuts: Sequence[int], host_bytes_per_s: float = math.inf
) -> tuple[float, tuple[int, ...]]:
    """Write the packs' state back to the host when a placement ends.

    Args:
        shape: The job.
        cuts: Cut points of its packs.
        host_bytes_per_s: Each device's link bandwidth (bytes/s).

    Returns:
        Seconds (the devices write back in parallel) and the bytes of each pack.
    """
    num_bytes = tuple(sum(shape.state_bytes[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))
    return max(num_bytes) / host_bytes_per_s, num_bytes
