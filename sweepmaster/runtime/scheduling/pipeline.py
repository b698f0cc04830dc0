"""Pipelined mode: one job's shards over several devices, microbatches flowing through.

Harmony (Li et al., "Harmony: Overcoming the Hurdles of GPU Memory Capacity to Train Massive DNN
Models on Commodity Servers", VLDB 2022, https://arxiv.org/abs/2202.01306) binds tasks to devices
late: when runnable jobs are fewer than free devices, one job's shards are split into contiguous
*packs*, one per device (balanced-time layer packing, Algorithm 2: the cut points come from
:func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_packs`), each pack's parameters and
optimizer state stay resident on its device, and the minibatch's M microbatches flow through the
packs as a pipeline with input-batch grouping, flushed at the end of each step (synchronous SGD).
Boundary activations and their gradients cross between adjacent packs device to device (p2p),
not through the host. A job whose packs do not fit one per device on the D devices it may take
(they are too few for its fewest packs that fit) runs **wrap-around** (Harmony's PP with more
packs than devices): P > D packs planned for those D devices, pack p on device ``p mod D``; each
device swaps its packs in from the host in turn (prefetching the next one where it fits beside
the current one), while the activations still flow pack to pack device to device. Between
steps device d holds its first pack, pack d: :func:`lanes` gives each device's packs.

This module holds the pure parts: what a job must tell the policy to be pipelined
(:class:`PipelineShape`), what the policy decides (:class:`PipelineDecision`, returned by
:meth:`~sweepmaster.runtime.scheduling.scheduler.Policy.next_pipeline`), and the one cost model of
a pipelined step (:func:`pipeline_step`, :func:`pipeline_unload`) that the policy, the simulator
and ``sweepmaster plan`` share.

Step time (GPipe-style schedule, all forwards then all backwards, flushed): a phase over stages
with per-minibatch times ``t_1..t_n`` (pack computes and boundary copies), each stage processing
the M microbatches in order at ``t_i / M`` apiece, takes ``(sum(t) + (M - 1) * max(t)) / M``
seconds (the makespan of a flow shop with M identical jobs). The forward phase's stages are the
input copy, pack 0's forward, the crossing to pack 1, ..., the last pack's forward (the same
token ids go to the last pack's device as its labels, over that device's own link, ahead of its
turn: counted in bytes, no stage); the backward
phase runs the packs' backwards (just-in-time update included) in reverse, with the gradient
crossings between them. A crossing is one p2p copy at ``p2p_bytes_per_s``, or without p2p a
device -> host copy then a host -> device copy at ``host_bytes_per_s`` (two stages). Wrap-around
runs the packs in rounds of D (one pack per device), each round a flow shop of its own, rounds one
after the other; each device's swaps add their seconds at ``host_bytes_per_s`` (the slowest
device's), none hidden.

Example:
    >>> shape = PipelineShape(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0),
    ...                       state_bytes=(12, 12), boundary_bytes=(4, 0), input_bytes=8,
    ...                       num_microbatches=2, packs=((0, 1, 2),))
    >>> step = pipeline_step(shape, (0, 1, 2))
    >>> step.seconds, step.p2p_bytes, step.host_to_device_bytes
    (4.5, 8, 16)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = [
    "PipelineDecision",
    "PipelineShape",
    "PipelineStep",
    "choose_packs",
    "lanes",
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
        input_bytes: The step's token ids (bytes): host -> device to the first pack (its
            input) and to the last pack (its labels), every step.
        num_microbatches: M, microbatches per minibatch flowing through the pipeline.
        packs: The pack layouts the planner offers, each the cut points ``(0, c1, ..., S)`` of
            at least two contiguous packs (one per device; the last pack's beside the step's
            token ids), fewest packs first; from
            :func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_packs`.
        tied: The trainable parameters several shards use (GPT-2's tied embeddings), one
            ``(owner, borrowers, bytes)`` each: the shard that owns it (the first that uses it:
            it updates it), the later shards that use it too, in order, and its bytes; empty:
            none. Each pack after the owner's that holds a borrower sends its gradient
            contribution to the owner's pack and gets the updated value back, once per step:
            p2p from a device's first pack; through the host from a pack that leaves before the
            owner's update (written by the borrower's device, read by the owner's at its
            update). A borrowing pack that comes back in reads the value with its parameters;
            an owner that never leaves its device (the one pack of its device) writes it to the
            host for it at the step's end.
        wrap: The wrap-around layouts, one ``(D, cuts)`` per device count D that no layout of
            ``packs`` fits one pack per device (``packs`` has none of D packs or fewer): the cut
            points ``(0, c1, ..., S)`` of more than D packs planned for D devices, pack p on
            device ``p mod D``, each pack fitting a device beside one boundary of activations
            and the step's token ids
            (:func:`~sweepmaster.runtime.planning.pipeline_plan.pipeline_wrap`); in increasing
            D, each D at most once; empty: none.
        optimizer_bytes: Optimizer state of each shard, ``(S,)`` (bytes; part of
            ``state_bytes``); empty: none. A wrap-around pack's travels at every step.
        owned_bytes: Parameters each shard updates, ``(S,)`` (bytes); empty: none. A
            wrap-around pack writes them back after its update.
        kept_bytes: Each shard's boundary input over the minibatch, kept for its recompute,
            ``(S,)`` (bytes); empty: none. A wrap-around pack that leaves its device between its
            forward and its backward parks them on the host.
        defers: Updates wait for the global gradient norm (``grad_clip``): a wrap-around pack
            that leaves before it is known parks its gradients on the host and is updated when
            it comes back.
        num_members: K, the members of a fused array whose stacked shards these are (their
            bytes are the K members'); 1 for one job. Its clip coefficients are K float32s.
        pass_bytes: Host -> device bytes each shard's passes of a pipelined training step
            promote besides their inputs, ``(S,)`` (bytes): a fused array's dropout noise and
            LoRA scalings, to the device that runs the shard's pack; empty: none.

    Raises:
        ValueError: Lengths differ from ``S``, a negative time or size, ``num_microbatches < 1``,
            a layout that is not increasing from 0 to ``S`` with at least two packs, a
            wrap-around layout for fewer than 2 devices, for no fewer devices than its packs or
            for a device count given twice, or a tied parameter whose owner and borrowers are
            not increasing shards below ``S``.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    state_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]
    input_bytes: int
    num_microbatches: int
    packs: tuple[tuple[int, ...], ...]
    tied: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    wrap: tuple[tuple[int, tuple[int, ...]], ...] = ()
    optimizer_bytes: tuple[int, ...] = ()
    owned_bytes: tuple[int, ...] = ()
    kept_bytes: tuple[int, ...] = ()
    defers: bool = False
    num_members: int = 1
    pass_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        lengths = {len(self.backward_s), len(self.state_bytes), len(self.boundary_bytes)}
        optional = (self.optimizer_bytes, self.owned_bytes, self.kept_bytes, self.pass_bytes)
        if n < 2 or lengths != {n} or any(len(v) not in (0, n) for v in optional):
            raise ValueError(f"a pipeline needs >= 2 shards and one entry per shard, got {n} "
                             f"shards and lengths {sorted(lengths)}")
        for owner, borrowers, _ in self.tied:
            shards = (owner, *borrowers)
            if (not borrowers or owner < 0 or shards[-1] >= n
                    or any(a >= b for a, b in zip(shards, shards[1:], strict=False))):
                raise ValueError(f"a tied parameter's owner {owner} and borrowers {borrowers} "
                                 f"are not increasing shards of {n}")
        values = (*self.forward_s, *self.backward_s, *self.state_bytes, *self.boundary_bytes,
                  *(b for v in optional for b in v), *(b for _, _, b in self.tied),
                  self.input_bytes)
        if min(values) < 0 or self.num_microbatches < 1 or self.num_members < 1:
            raise ValueError("pipeline times and bytes must be >= 0, num_microbatches and "
                             "num_members >= 1")
        for cuts in (*self.packs, *(cuts for _, cuts in self.wrap)):
            if (len(cuts) < 3 or cuts[0] != 0 or cuts[-1] != n
                    or any(a >= b for a, b in zip(cuts, cuts[1:], strict=False))):
                raise ValueError(f"pack cut points {cuts} are not 0 < ... < {n}")
        counts = [num_devices for num_devices, _ in self.wrap]
        for num_devices, cuts in self.wrap:
            if not 2 <= num_devices < len(cuts) - 1 or counts.count(num_devices) > 1:
                raise ValueError(f"a wrap-around layout of {len(cuts) - 1} packs cannot be the "
                                 f"one for {num_devices} devices (2 <= D < packs, one per D)")

    @property
    def num_shards(self) -> int:
        """S, the shards."""
        return len(self.forward_s)

    def per_shard(self, name: str, shard: int) -> int:
        """``name``'s bytes of ``shard`` (0 where the shape leaves that field empty)."""
        values: tuple[int, ...] = getattr(self, name)
        return values[shard] if values else 0


@dataclass(frozen=True)
class PipelineDecision:
    """A policy's decision: one step of a job pipelined over several devices.

    Attributes:
        job_id: The job.
        first_index: Its first task index of the step; the step stands for tasks
            ``first_index .. first_index + num_tasks - 1`` of the job's chain.
        num_tasks: Tasks of the step (``2 S - 1``).
        devices: The devices, D of them: pack p runs on ``devices[p % D]`` (one pack each, or
            wrap-around when the packs are more).
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
        """Per device, in device order, the shards of the pack it holds between steps (pack d).

        One pack per device: every pack, in pack order.
        """
        bounds = list(zip(self.cuts, self.cuts[1:], strict=False))
        return tuple(tuple(range(a, b)) for a, b in bounds[: len(self.devices)])

    @property
    def lane_shards(self) -> tuple[tuple[int, ...], ...]:
        """Per device, every shard of every pack it runs in a step."""
        bounds = list(zip(self.cuts, self.cuts[1:], strict=False))
        return tuple(tuple(s for p in lane for s in range(*bounds[p]))
                     for lane in lanes(len(bounds), len(self.devices)))


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
        device_host_bytes: Per device, ``(host -> device, device -> host)`` bytes.
    """

    seconds: float
    load_s: float
    host_to_device_bytes: int
    device_to_host_bytes: int
    p2p_bytes: int
    device_host_bytes: tuple[tuple[int, int], ...]


def lanes(num_packs: int, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Each device's packs in order: pack p on device ``p % num_devices`` (wrap-around).

    Example:
        >>> lanes(5, 2)
        ((0, 2, 4), (1, 3))
    """
    return tuple(tuple(range(d, num_packs, num_devices)) for d in range(num_devices))


def choose_packs(
    shape: PipelineShape,
    max_devices: int,
    *,
    step_s: float | None = None,
    speed: float = 1.0,
    p2p: bool = True,
    host_bytes_per_s: float = math.inf,
    p2p_bytes_per_s: float = math.inf,
) -> tuple[int, ...] | None:
    """The layout whose pipelined step is predicted shortest on ``max_devices`` devices, or None.

    The layouts that fit are every one of ``shape.packs`` with at most ``max_devices`` packs
    (one pack per device) and the wrap-around layout planned for exactly ``max_devices``
    devices (``shape.wrap``; more packs than devices, over all of them). Each is priced by
    :func:`pipeline_step` in the steady state (no load) at the given bandwidths: the one cost
    model the policy, the simulator and ``sweepmaster plan`` share. Of layouts within a relative
    1e-9 of the shortest, the one with the most packs is taken (one pack per device before
    wrap-around). With ``step_s``, the job's step run as shard tasks on one device, the layout
    is returned only when its step is no longer (within a relative 1e-9): Harmony's
    wrap-around over few devices swaps every pack's state each step, which a step of little
    compute does not repay (Li et al., VLDB 2022, https://arxiv.org/abs/2202.01306). A tie
    pipelines: ``step_s`` leaves out the shard tasks' own copies (what prefetch does not hide),
    so at equal predictions, e.g. one microbatch (M = 1) with instant copies, the shard tasks
    are the slower in fact, and packs held one per device move almost nothing.

    Example:
        >>> shape = PipelineShape(forward_s=(1.0,) * 3, backward_s=(2.0,) * 3,
        ...                       state_bytes=(12,) * 3, boundary_bytes=(4, 4, 0),
        ...                       input_bytes=8, num_microbatches=2, packs=((0, 1, 2, 3),),
        ...                       wrap=((2, (0, 1, 2, 3)),))
        >>> choose_packs(shape, 3), choose_packs(shape, 2), choose_packs(shape, 1)
        ((0, 1, 2, 3), (0, 1, 2, 3), None)
        >>> choose_packs(shape, 2, step_s=9.0)  # 7.5 s wrapped around 2 devices
        (0, 1, 2, 3)
        >>> choose_packs(shape, 2, step_s=9.0, host_bytes_per_s=4.0) is None  # 15 s swapping
        True

    Args:
        shape: The job's pipeline shape.
        max_devices: Devices the pipeline may take.
        step_s: Estimated seconds of the job's step as shard tasks on one device (the policy:
            the sum of its step's tasks' ``est_seconds``, promotions taken as hidden by
            prefetch; ``sweepmaster plan``: the plan's ``step_s``, with the copies prefetch
            does not hide); None: no gate, the shortest layout that fits is returned.
        speed: Measured / estimated compute seconds: ``shape``'s compute seconds and
            ``step_s`` are multiplied by it, copies are not.
        p2p: Crossings go device -> device; False: through the host (:func:`pipeline_step`).
        host_bytes_per_s: Host <-> device bandwidth of each device's link (bytes/s).
        p2p_bytes_per_s: Device -> device bandwidth (bytes/s).

    Returns:
        Cut points ``(0, c1, ..., S)`` of the packs, or None: no layout fits, fewer than two
        devices, or every layout's step is longer than ``step_s``.
    """
    fits = sorted((cuts for cuts in shape.packs if len(cuts) - 1 <= max_devices),
                  key=len, reverse=True)
    fits += [cuts for num_devices, cuts in shape.wrap if num_devices == max_devices]
    if not fits:
        return None
    if speed != 1.0:
        shape = replace(shape, forward_s=tuple(s * speed for s in shape.forward_s),
                        backward_s=tuple(s * speed for s in shape.backward_s))
    seconds = [pipeline_step(shape, cuts, num_devices=min(len(cuts) - 1, max_devices), p2p=p2p,
                             host_bytes_per_s=host_bytes_per_s,
                             p2p_bytes_per_s=p2p_bytes_per_s).seconds for cuts in fits]
    shortest = min(seconds)
    best = next(i for i, s in enumerate(seconds) if s <= shortest * (1 + 1e-9))
    if step_s is not None and seconds[best] > step_s * speed * (1 + 1e-9):
        return None
    return fits[best]


def place(
    free: Sequence[int],
    cuts: tuple[int, ...],
    held: tuple[tuple[int, ...], tuple[int, ...]] | None,
    max_devices: int | None = None,
) -> tuple[tuple[int, ...], bool]:
    """The devices of a pipelined step, and whether its packs must be loaded.

    Args:
        free: The free devices.
        cuts: The packs' cut points.
        held: ``(devices, cuts)`` of the job's packs still on devices, or None.
        max_devices: Devices the step may take (None: one per pack); with fewer than the packs
            the step wraps around.

    Returns:
        ``held``'s devices without a load when the layout and the device count are the same
        and they are all free; else the free devices of ``held`` first, then the others in
        order, with a load.
    """
    count = len(cuts) - 1 if max_devices is None else min(len(cuts) - 1, max_devices)
    if (held is not None and held[1] == cuts and len(held[0]) == count
            and set(held[0]) <= set(free)):
        return held[0], False
    previous = [] if held is None else [d for d in held[0] if d in free]
    order = previous + [d for d in free if d not in previous]
    return tuple(order[:count]), True


def _phase_s(stages_s: Sequence[float], num_microbatches: int) -> float:
    """Flow-shop makespan of M identical microbatches over stages of per-minibatch seconds."""
    return (sum(stages_s) + (num_microbatches - 1) * max(stages_s)) / num_microbatches


def pipeline_step(
    shape: PipelineShape,
    cuts: Sequence[int],
    *,
    num_devices: int | None = None,
    load: bool = False,
    p2p: bool = True,
    host_bytes_per_s: float = math.inf,
    p2p_bytes_per_s: float = math.inf,
) -> PipelineStep:
    """Time and bytes of one step of ``shape`` pipelined over the packs of ``cuts``.

    Bytes of a wrap-around device are those of a step in the steady state (its previous step
    pipelined, no evaluation between): every pack but its first comes in for its forward,
    every pack but its last comes (back) in for its backward with its parked inputs, each pack
    writes back what its update changed, and each optimizer state goes in and out once. Under
    ``defers`` a pack after its device's first is updated when it comes back for the next
    step's forward (its gradients out and in, and the clip coefficient in per shard: 4 bytes
    per member). The first step differs (a state not created yet moves nothing), so do the
    clip norms and coefficients (4 bytes per member each, p2p; not counted here) and a state
    that does not stay on a device of one pack (counted by the caller). A fused array's
    dropout noise and LoRA scalings go host -> device with its passes (``pass_bytes``, on the
    device of each pack).

    Args:
        shape: The job.
        cuts: Cut points ``(0, c1, ..., S)`` of the packs.
        num_devices: Devices D (None: one per pack); pack p runs on device ``p % D``.
        load: Load each device's first pack's state host -> device first (a new placement).
        p2p: Crossings go device -> device; False: through the host (down, then up).
        host_bytes_per_s: Host <-> device bandwidth of each device's link (bytes/s).
        p2p_bytes_per_s: Device -> device bandwidth (bytes/s).

    Returns:
        The step's seconds and bytes.

    Raises:
        ValueError: ``num_devices`` is below 1 or above the packs.
    """
    bounds = list(zip(cuts, cuts[1:], strict=False))
    num_packs = len(bounds)
    devices = num_packs if num_devices is None else num_devices
    if not 1 <= devices <= num_packs:
        raise ValueError(f"{num_packs} packs cannot run on {devices} devices")
    fwd = [sum(shape.forward_s[a:b]) for a, b in bounds]
    bwd = [sum(shape.backward_s[a:b]) for a, b in bounds]
    crossing = [shape.boundary_bytes[b - 1] for _, b in bounds[:-1]]

    def total(name: str, pack: int) -> int:
        return sum(shape.per_shard(name, s) for s in range(*bounds[pack]))

    def hops(num_bytes: int) -> list[float]:
        if p2p:
            return [num_bytes / p2p_bytes_per_s]
        return [num_bytes / host_bytes_per_s] * 2

    m = shape.num_microbatches
    phases_s = 0.0
    for first in range(0, num_packs, devices):  # rounds of one pack per device
        last = min(first + devices, num_packs)
        forward_stages = [shape.input_bytes / host_bytes_per_s] if first == 0 else []
        backward_stages: list[float] = []
        for p in range(first, last):
            forward_stages.append(fwd[p])
            if p < len(crossing):
                forward_stages += hops(crossing[p])
        for p in range(last - 1, first - 1, -1):
            backward_stages.append(bwd[p])
            if p > 0:
                backward_stages += hops(crossing[p - 1])
        phases_s += _phase_s(forward_stages, m) + _phase_s(backward_stages, m)

    lane_of = [p % devices for p in range(num_packs)]
    coef_bytes = 4 * shape.num_members  # float32 clip coefficients, one per member
    load_bytes = [sum(shape.state_bytes[a:b]) if load else 0 for a, b in bounds[:devices]]
    up = [load_bytes[d] for d in range(devices)]
    up[0] += shape.input_bytes  # the token ids: the first pack's input, the last pack's labels
    up[lane_of[-1]] += shape.input_bytes
    for p in range(num_packs):
        up[lane_of[p]] += total("pass_bytes", p)
    down = [0] * devices
    swapped = [0] * devices  # host bytes of the swaps of wrap-around devices
    for d, packs in enumerate(lanes(num_packs, devices)):
        if len(packs) < 2:
            continue
        params = [sum(shape.state_bytes[a:b]) - total("optimizer_bytes", p)
                  for p, (a, b) in ((p, bounds[p]) for p in packs)]
        state = sum(total("optimizer_bytes", p) for p in packs)
        owned = sum(total("owned_bytes", p) for p in packs)
        kept = sum(total("kept_bytes", p) for p in packs[:-1])
        swapped[d] += sum(params[1:]) + sum(params[:-1]) + kept + state
        swapped[d] += owned + kept + state
        up[d] += sum(params[1:]) + sum(params[:-1]) + kept + state
        down[d] += owned + kept + state
        if shape.defers:  # later packs: gradients out, then in with the coefficient
            deferred = [s for p in packs[1:] for s in range(*bounds[p])]
            grads = sum(shape.per_shard("owned_bytes", s) for s in deferred)
            coefs = coef_bytes * sum(1 for s in deferred if shape.per_shard("owned_bytes", s))
            up[d] += grads + coefs
            down[d] += grads
            swapped[d] += 2 * grads + coefs
    if shape.defers and num_packs > devices:
        down[0] += coef_bytes  # the coefficient, to the host for the deferred updates
    pack_of = [p for p, (a, b) in enumerate(bounds) for _ in range(a, b)]
    num_lane_packs = [len(packs) for packs in lanes(num_packs, devices)]
    tied = 0  # bytes of the contributions (and as many of the values) of devices' first packs
    for owner, borrowers, num_bytes in shape.tied:
        holder = lane_of[pack_of[owner]]
        borrowing = sorted({pack_of[s] for s in borrowers} - {pack_of[owner]})
        if num_lane_packs[holder] == 1 and any(num_lane_packs[lane_of[p]] > 1 for p in borrowing):
            down[holder] += num_bytes  # it never leaves: the value, for packs that come back in
            swapped[holder] += num_bytes
        for p in borrowing:
            if p < devices:  # a device's first pack: its contribution and the value cross p2p
                tied += num_bytes
                if not p2p:  # each through the host: written by its sender, read by the other
                    down[p] += num_bytes
                    up[holder] += num_bytes
                    down[holder] += num_bytes
                    up[p] += num_bytes
            else:  # it leaves before the owner's update: its contribution goes through the host
                down[lane_of[p]] += num_bytes
                up[holder] += num_bytes
                swapped[lane_of[p]] += num_bytes
                swapped[holder] += num_bytes
    load_s = max(load_bytes) / host_bytes_per_s
    seconds = load_s + phases_s + max(swapped) / host_bytes_per_s
    crossed = 2 * sum(crossing) + 2 * tied
    if not p2p:  # each crossing: the sender writes it to the host, the receiver reads it
        for p, num_bytes in enumerate(crossing):
            down[lane_of[p]] += num_bytes
            up[lane_of[p + 1]] += num_bytes
            up[lane_of[p]] += num_bytes  # its gradient comes back
            down[lane_of[p + 1]] += num_bytes
    return PipelineStep(
        seconds=seconds,
        load_s=load_s,
        host_to_device_bytes=sum(up),
        device_to_host_bytes=sum(down),
        p2p_bytes=crossed if p2p else 0,
        device_host_bytes=tuple(zip(up, down, strict=True)),
    )


def pipeline_unload(
    shape: PipelineShape, cuts: Sequence[int], host_bytes_per_s: float = math.inf,
    num_devices: int | None = None,
) -> tuple[float, tuple[int, ...]]:
    """Write the packs' state back to the host when a placement ends.

    Args:
        shape: The job.
        cuts: Cut points of its packs.
        host_bytes_per_s: Each device's link bandwidth (bytes/s).
        num_devices: Devices D (None: one per pack); each holds its first pack then.

    Returns:
        Seconds (the devices write back in parallel) and the bytes of each device.
    """
    bounds = list(zip(cuts, cuts[1:], strict=False))
    count = len(bounds) if num_devices is None else num_devices
    num_bytes = tuple(sum(shape.state_bytes[a:b]) for a, b in bounds[:count])
    return max(num_bytes) / host_bytes_per_s, num_bytes
