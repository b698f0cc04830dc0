"""Plan one job's pipeline over several devices: packs of its shards, what each holds.

Harmony's pipeline (Li et al. VLDB 2022; HotOS 2021) places a spilled job's shards over several
devices at once, microbatches flowing through. Its packs come from the partitioner's own packer
(:func:`~sweepmaster.runtime.planning.packing.estimate_partition`'s balanced-time packing,
Harmony Algorithm 2) with the shards as the items:

* :func:`pipeline_packs`: contiguous packs of shards, one per device, for 2..D devices;
* :func:`pipeline_wrap`: more packs than devices, run over the devices in turn (wrap-around),
  planned for one device count;
* :func:`pipeline_resident_bytes`, :func:`pipeline_state_stays`, :func:`pipeline_reserve_bytes`:
  what a pack holds on its device (bytes), whose optimizer state stays with it, and the room a
  wrap-around device keeps for a pack boundary;
* :func:`pipeline_prefetch_fits`, :func:`pipeline_device_bytes`: where a wrap-around device
  copies its next pack in beside the current one, and each device's planned peak;
* :func:`pipeline_shape`: all of it as the
  :class:`~sweepmaster.runtime.scheduling.pipeline.PipelineShape` Sharded-LRTF pipelines by.

One count of a device's bytes: its packs' resident bytes and staying optimizer states, plus
what it holds beside its packs (a pack boundary's reserve on a device of several packs, the
step's token ids on the last pack's device). The packer fits each pack beside the same bytes
that :func:`pipeline_device_bytes` adds, and which states stay and which prefetches fit are
decided within them, so every device's planned peak of a layout offered is within the budget.

Example:
    >>> shape = pipeline_shape(plan_job(spec, device), max_devices=2)  # doctest: +SKIP
    >>> shape.packs  # doctest: +SKIP
    ((0, 2, 4),)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from sweepmaster.runtime.planning.packing import _pack
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.scheduling.pipeline import PipelineShape, lanes

__all__ = [
    "pipeline_device_bytes", "pipeline_packs", "pipeline_pass_bytes", "pipeline_prefetch_fits",
    "pipeline_reserve_bytes", "pipeline_resident_bytes", "pipeline_shape", "pipeline_state_stays",
    "pipeline_tied", "pipeline_wrap",
]

def pipeline_packs(
    seconds: Sequence[float], resident_bytes: Sequence[int], budget_bytes: int, max_devices: int,
    *, label_bytes: int,
) -> list[tuple[int, ...]]:
    """Pack layouts of a job's shards for a pipeline over 2..``max_devices`` devices.

    Harmony's balanced-time packing (Li et al. VLDB 2022, Algorithm 2) with shards as the items:
    for each device count k, contiguous packs, at most k of them, that each fit their device,
    whose slowest pack is fastest. A pack fits when its resident bytes plus what its device
    holds beside it in a pipelined step fit the budget: the last pack's device holds the
    step's token ids (its labels), the others nothing (the rule
    :func:`pipeline_device_bytes` counts by, so each device's planned peak is within the
    budget). It is the partitioner's own packer (fewest packs that fit, then the fastest
    slowest pack) with a cap on a pack's seconds beside the budget: the smallest cap (bisected
    over the packs' possible seconds) at which the fewest packs are at most k.

    Args:
        seconds: Each shard's seconds per step (forward + backward), ``(S,)``.
        resident_bytes: Each shard's bytes while resident in the pipeline, ``(S,)``
            (:func:`pipeline_resident_bytes`); a pack's are their sum.
        budget_bytes: A device's budget (bytes).
        max_devices: Devices a pipeline may take.
        label_bytes: The step's token ids (bytes), which the last pack's device holds beside
            its pack (shard 0's input over the minibatch).

    Returns:
        The distinct layouts of at least two packs, each as cut points ``(0, c1, ..., S)``,
        fewest packs first (empty when none fits).
    """
    layouts: list[tuple[int, ...]] = []
    for devices in range(2, max_devices + 1):
        # one pack per device: no device keeps a reserve for a pack boundary
        beside = _beside_bytes(devices, devices, 0, label_bytes)
        found = _balanced_packs(seconds, resident_bytes, budget_bytes, beside, devices)
        if found is not None and len(found) > 2 and found not in layouts:
            layouts.append(found)
    return layouts


def _balanced_packs(seconds: Sequence[float], resident_bytes: Sequence[int], budget_bytes: int,
                    beside_bytes: Sequence[int], max_packs: int) -> tuple[int, ...] | None:
    """Cut points of at most ``max_packs`` packs that fit, whose slowest is fastest (or None).

    The smallest cap on a pack's seconds (bisected over the packs' possible seconds) at which
    the fewest packs that fit (:func:`_fewest_packs`, ``beside_bytes`` as there) are at most
    ``max_packs``.
    """
    num_shards = len(seconds)
    prefix = [0.0, *itertools.accumulate(seconds)]
    caps = sorted({prefix[b] - prefix[a] for a in range(num_shards)
                   for b in range(a + 1, num_shards + 1)})
    low, high, found = 0, len(caps) - 1, None
    while low <= high:  # the fewest packs only fall as the cap grows
        mid = (low + high) // 2
        packed = _fewest_packs(prefix, resident_bytes, budget_bytes, beside_bytes, max_packs,
                               caps[mid])
        if packed is not None and len(packed) - 1 <= max_packs:
            found, high = tuple(packed), mid - 1
        else:
            low = mid + 1
    return found


def _fewest_packs(prefix_s: list[float], resident_bytes: Sequence[int], budget_bytes: int,
                  beside_bytes: Sequence[int], num_packs: int, cap_s: float) -> list[int] | None:
    """Cut points of the fewest packs that fit and take at most ``cap_s``, the slowest fastest.

    The partitioner's packer (:func:`~sweepmaster.runtime.planning.packing.estimate_partition`)
    over the shards. ``beside_bytes``: what each device holds beside its packs when
    ``num_packs`` packs run on them (:func:`_beside_bytes`). A pack fits when its resident
    bytes fit the budget less that of its device: the last pack's device for the pack that
    ends the job; for any other, the most of the devices of packs ``0 .. num_packs - 2`` (a
    pack's device is known only once the layout is). None when none fits.
    """
    num_devices = len(beside_bytes)
    other = max(beside_bytes[p % num_devices] for p in range(num_packs - 1))
    last = beside_bytes[(num_packs - 1) % num_devices]
    packed = _pack(_PackTimes(prefix_s, resident_bytes, cap_s, last - other), len(resident_bytes),
                   budget_bytes - other, 0)
    return None if packed is None else packed[0]


def _beside_bytes(num_packs: int, num_devices: int, reserve_bytes: int,
                  label_bytes: int) -> list[int]:
    """What each device holds beside its packs in a pipelined training step, ``(D,)`` (bytes).

    ``reserve_bytes`` (:func:`pipeline_reserve_bytes`) on a device of several packs
    (wrap-around, pack p on device ``p mod D``), and ``label_bytes`` (the step's token ids:
    the last pack's labels) on the last pack's device.
    """
    return [(reserve_bytes if len(lane) > 1 else 0) + (label_bytes if num_packs - 1 in lane else 0)
            for lane in lanes(num_packs, num_devices)]


def _plan_beside_bytes(plan: JobPlan, num_packs: int, num_devices: int) -> list[int]:
    """:func:`_beside_bytes` of ``plan``'s pipeline: its reserve, its step's token ids."""
    return _beside_bytes(num_packs, num_devices, pipeline_reserve_bytes(plan),
                         plan.shards[0].input_bytes)


def pipeline_resident_bytes(plan: JobPlan) -> list[int]:
    """What each shard holds on its device in a pipeline, its optimizer state aside, ``(S,)``.

    Bytes; a pack holds the sum of its shards'. Counted conservatively: the larger of a shard's
    backward peak (its optimizer state there for the just-in-time update) and its forward peak
    plus its gradients (which stay while the pack's other shards compute), plus its boundary
    input over the minibatch (kept for the recompute of every microbatch in its backward). Its
    optimizer state stays resident too where the pack has room (:func:`pipeline_state_stays`).

    Args:
        plan: The job's plan on one device.
    """
    return [max(s.backward_peak_bytes, s.forward_peak_bytes + s.param_bytes) + s.input_bytes
            for s in plan.shards]


def pipeline_state_stays(plan: JobPlan, cuts: Sequence[int],
                         num_devices: int | None = None) -> list[bool]:
    """Per shard, whether its optimizer state stays resident with its pack.

    The one-device path's rule for a kept shard (its state stays when its backward peak plus
    the state fits the budget), per pack: shard by shard in order, the state stays while the
    pack's :func:`pipeline_resident_bytes` plus the states staying so far fit the budget less
    what the pack's device holds beside its packs (:func:`pipeline_reserve_bytes` on a device
    of several packs, the step's token ids on the last pack's: as
    :func:`pipeline_device_bytes` counts); the other shards' states are promoted for each
    update and demoted after it. A staying state stays for the whole run on a device of one
    pack, while its pack is on its device under wrap-around.

    Args:
        plan: The job's plan on one device.
        cuts: Cut points ``(0, c1, ..., S)`` of the packs.
        num_devices: Devices the packs run on (None: one per pack).

    Returns:
        One flag per shard, ``(S,)``.
    """
    resident = pipeline_resident_bytes(plan)
    num_packs = len(cuts) - 1
    devices = num_packs if num_devices is None else num_devices
    beside = _plan_beside_bytes(plan, num_packs, devices)
    stays = []
    for pack, (start, stop) in enumerate(zip(cuts, cuts[1:], strict=False)):
        budget = plan.budget_bytes - beside[pack % devices]
        total = sum(resident[start:stop])
        for shard in plan.shards[start:stop]:
            stays.append(total + shard.optimizer_bytes <= budget)
            total += shard.optimizer_bytes if stays[-1] else 0
    return stays


def pipeline_reserve_bytes(plan: JobPlan) -> int:
    """Room a wrap-around device keeps beside its pack: one pack boundary's activations.

    Bytes: the largest boundary output over the minibatch. In a training step, a device
    running one pack receives the inputs of its next one (forward), or still holds the
    gradients its previous one sent (backward: each goes when the device's pack receives the
    same microbatch's gradient). An evaluation does not use it: its blocks for a device's later
    pack wait on the host until that pack takes them, however many the evaluation has.

    Args:
        plan: The job's plan on one device.
    """
    return max(s.output_bytes for s in plan.shards[:-1])


def pipeline_prefetch_fits(plan: JobPlan, cuts: Sequence[int],
                           num_devices: int) -> dict[tuple[int, int], bool]:
    """Where a wrap-around device copies its next pack's parameters in ahead of its turn.

    For each pack and the pack after or before it on its device (the next one forward, the
    next one backward), whether that one's parameters fit beside the pack's
    :func:`pipeline_resident_bytes`, all its optimizer states and what the device holds beside
    its packs (:func:`pipeline_reserve_bytes`, and on the last pack's device the step's token
    ids) within the budget.

    Args:
        plan: The job's plan on one device.
        cuts: Cut points ``(0, c1, ..., S)`` of the packs.
        num_devices: Devices the packs run on (pack p on device ``p mod D``).

    Returns:
        ``(pack, other pack)`` -> whether the other fits beside; only pairs of neighbours on
        one device (none without wrap-around).
    """
    return {pair: num_bytes <= plan.budget_bytes
            for pair, num_bytes in _prefetch_bytes(plan, cuts, num_devices).items()}


def _prefetch_bytes(plan: JobPlan, cuts: Sequence[int],
                    num_devices: int) -> dict[tuple[int, int], int]:
    """``(pack, other pack on its device)`` -> the device's bytes while the other comes in."""
    resident = pipeline_resident_bytes(plan)
    bounds = list(zip(cuts, cuts[1:], strict=False))
    beside = _plan_beside_bytes(plan, len(bounds), num_devices)
    held = [sum(resident[s] + plan.shards[s].optimizer_bytes for s in range(a, b))
            for a, b in bounds]
    params = [sum(plan.shards[s].param_bytes for s in range(a, b)) for a, b in bounds]
    found = {}
    for device, lane in enumerate(lanes(len(bounds), num_devices)):
        for a, b in zip(lane, lane[1:], strict=False):
            for one, other in ((a, b), (b, a)):
                found[one, other] = held[one] + beside[device] + params[other]
    return found


def pipeline_device_bytes(plan: JobPlan, cuts: Sequence[int],
                          num_devices: int | None = None) -> list[int]:
    """Each device's planned peak in a pipelined step: what its packs hold at worst, ``(D,)``.

    Bytes. Per device, the largest of its packs' :func:`pipeline_resident_bytes` plus the
    optimizer states that stay (:func:`pipeline_state_stays`), plus what it holds beside its
    packs: on a device of several packs (wrap-around), :func:`pipeline_reserve_bytes` (the
    next pack's inputs arriving while the device runs an earlier one, or the gradients its
    previous pack sent, which it frees as the packs between take them); on the last pack's
    device, the step's token ids (its labels, shard 0's input over the minibatch). Where the
    next pack comes in ahead of its turn (:func:`pipeline_prefetch_fits`), the device holds
    both for a while. The runtime frees every gradient a pack sends at fixed points of its own
    device's order, so a device's peak does not depend on how far the other devices are; it
    stays within these bytes. The layouts :func:`pipeline_shape` offers fit by the same
    count: each of these is within the budget.

    Args:
        plan: The job's plan on one device.
        cuts: Cut points ``(0, c1, ..., S)`` of the packs.
        num_devices: Devices the packs run on (None: one per pack).

    Returns:
        One planned peak per device, in device order.
    """
    num_packs = len(cuts) - 1
    devices = num_packs if num_devices is None else num_devices
    resident = pipeline_resident_bytes(plan)
    stays = pipeline_state_stays(plan, cuts, devices)
    beside = _plan_beside_bytes(plan, num_packs, devices)
    prefetched = _prefetch_bytes(plan, cuts, devices)
    peaks = []
    for device, lane in enumerate(lanes(num_packs, devices)):
        packs = [sum(resident[s] + (plan.shards[s].optimizer_bytes if stays[s] else 0)
                     for s in range(cuts[p], cuts[p + 1])) for p in lane]
        peak = max(packs) + beside[device]
        for (one, _), num_bytes in prefetched.items():
            if one in lane and num_bytes <= plan.budget_bytes:
                peak = max(peak, num_bytes)
        peaks.append(peak)
    return peaks


def pipeline_wrap(plan: JobPlan, num_devices: int) -> tuple[int, ...]:
    """The wrap-around layout over ``num_devices`` devices: packs that fit, balanced in time.

    Harmony's balanced-time packing (the partitioner's packer with a cap on a pack's seconds, as
    :func:`pipeline_packs`) for more packs than devices: each pack's
    :func:`pipeline_resident_bytes` fit the budget less the most a device holds beside its
    packs (:func:`pipeline_reserve_bytes` and the step's token ids: the last pack's device
    runs other packs too), so every entry of :func:`pipeline_device_bytes` is within the
    budget on ``num_devices`` devices (and, by the same count, on any number from 2 up to the
    packs).

    The packs are at most the fewest that fit rounded up to a multiple of ``num_devices``
    (and at most S), the slowest pack fastest. That count is a cap, not a promise: the packer
    keeps the fewest packs at the smallest cap on a pack's seconds, so where more packs would
    not make the slowest one faster it returns fewer, and the devices' pack counts then differ
    by one (:func:`~sweepmaster.runtime.scheduling.pipeline.lanes`: 3 packs on 2 devices run
    as packs 0 and 2 on one device, pack 1 alone on the other, which swaps nothing). The
    memory bound above holds either way: every pack fits beside the most any device holds.

    Args:
        plan: The job's plan on one device.
        num_devices: Devices the packs run on, D >= 2.

    Returns:
        Cut points ``(0, c1, ..., S)`` of more than ``num_devices`` packs; empty when none fits
        (or the fewest that fit are ``num_devices`` or fewer: one pack per device is the
        layout then, :func:`pipeline_packs`).
    """
    seconds = [s.forward_s + s.backward_s for s in plan.shards]
    resident = pipeline_resident_bytes(plan)
    prefix = [0.0, *itertools.accumulate(seconds)]
    # any count of more packs than devices: the last pack's device runs another one too
    beside = _plan_beside_bytes(plan, num_devices + 1, num_devices)
    fewest = _fewest_packs(prefix, resident, plan.budget_bytes, beside, num_devices + 1,
                           math.inf)
    if fewest is None or len(fewest) - 1 <= num_devices:
        return ()
    count = min(-(-(len(fewest) - 1) // num_devices) * num_devices, len(plan.shards))
    found = _balanced_packs(seconds, resident, plan.budget_bytes,
                            _plan_beside_bytes(plan, count, num_devices), count)
    assert found is not None
    return found


def pipeline_pass_bytes(plan: JobPlan) -> list[int]:
    """What each shard's passes of a pipelined training step promote, ``(S,)`` (bytes).

    A fused array's pre-drawn dropout noise (:attr:`~sweepmaster.runtime.planning.plans.\
ShardPlan.noise_bytes`: masks over the minibatch, and the members' scales per microbatch) and
    its LoRA members' scalings (:attr:`~sweepmaster.runtime.planning.plans.ShardPlan.\
scaling_bytes`, per microbatch) go with every pass, over the pipeline's microbatches (those of
    the shard with the most): a shard before the last runs its forward and, in its backward,
    Hydra's recompute; the last runs one pass (forward, loss and backward); a first shard that
    trains nothing (a LoRA base's embeddings) no backward. 0 for one job.

    Args:
        plan: The job's plan on one device (a fused array's stacked plan).
    """
    last = len(plan.shards) - 1
    num_microbatches = max(plan.num_microbatches(s.index) for s in plan.shards)
    moved = []
    for shard in plan.shards:
        passes = 1 if shard.index == last else 2
        if shard.index == 0 and shard.index < last and not shard.num_owned_params:
            passes = 1
        masks = sum(shard.noise_bytes) - shard.noise_scale_bytes * plan.num_microbatches(
            shard.index)
        per_microbatch = shard.noise_scale_bytes + shard.scaling_bytes
        moved.append(passes * (masks + per_microbatch * num_microbatches))
    return moved


def pipeline_tied(plan: JobPlan) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """The tied parameters of a job's shards, one ``(owner, borrowers, bytes)`` each.

    The shard that owns the parameter (the first that uses it), the later shards that use it
    too, in order, and its bytes: from each shard's
    :attr:`~sweepmaster.runtime.planning.plans.ShardPlan.borrowed_params`, in the order of
    their first borrower.

    Args:
        plan: The job's plan on one device (a fused array's stacked plan: K members' bytes).
    """
    tied: dict[str, tuple[int, list[int], int]] = {}
    for shard in plan.shards:
        for name, owner, num_bytes in shard.borrowed_params:
            tied.setdefault(name, (owner, [], num_bytes))[1].append(shard.index)
    return tuple((owner, tuple(borrowers), num_bytes)
                 for owner, borrowers, num_bytes in tied.values())


def pipeline_shape(plan: JobPlan, max_devices: int, *,
                   num_members: int = 1) -> PipelineShape | None:
    """What Sharded-LRTF needs to pipeline a spilled job over up to ``max_devices`` devices.

    A pack's resident bytes are its shards' :func:`pipeline_resident_bytes`; the layouts offered
    (:func:`pipeline_packs`, :func:`pipeline_wrap`) are those whose every device's planned peak
    (:func:`pipeline_device_bytes`) is within the budget. The pipeline's microbatches are those
    of the shard with the most. For every device count D in 2..``max_devices`` that no layout
    of one pack per device fits (its fewest packs that fit are more than D, or none fits that
    way), the wrap-around layout planned for D devices (:func:`pipeline_wrap`) runs its packs
    over them in turn, so a job pipelines over as few devices as Sharded-LRTF can spare it
    (:func:`~sweepmaster.runtime.scheduling.pipeline.choose_packs` picks one layout per D). A
    fused array's stacked plan gives the K members' bytes already. Only the job plan counts: a
    pipelined step recomputes every activation (Hydra) whatever the job's memory plan.

    Args:
        plan: The job's plan on one device (a fused array's stacked plan).
        max_devices: Devices of its class.
        num_members: K, the members a stacked plan was made for (1: one job).

    Returns:
        The shape, or ``None`` for a job of one shard or fewer than two devices.
    """
    shards = plan.shards
    if len(shards) < 2 or max_devices < 2:
        return None
    resident = pipeline_resident_bytes(plan)
    seconds = [s.forward_s + s.backward_s for s in shards]
    packs = tuple(pipeline_packs(seconds, resident, plan.budget_bytes, max_devices,
                                 label_bytes=shards[0].input_bytes))
    # layouts come fewest packs first: fewer devices than the first's packs wrap around
    fewest = len(packs[0]) - 1 if packs else max_devices + 1
    wrap = tuple((num_devices, cuts) for num_devices in range(2, min(fewest, max_devices + 1))
                 if (cuts := pipeline_wrap(plan, num_devices)))
    return PipelineShape(
        forward_s=tuple(s.forward_s for s in shards),
        backward_s=tuple(s.backward_s for s in shards),
        state_bytes=tuple(s.param_bytes + s.optimizer_bytes for s in shards),
        boundary_bytes=tuple(s.output_bytes for s in shards),
        input_bytes=shards[0].input_bytes,
        num_microbatches=max(plan.num_microbatches(i) for i in range(len(shards))),
        packs=packs,
        tied=pipeline_tied(plan),
        wrap=wrap,
        optimizer_bytes=tuple(s.optimizer_bytes for s in shards),
        owned_bytes=tuple(s.owned_param_bytes for s in shards),
        kept_bytes=tuple(s.input_bytes for s in shards),
        defers=plan.grad_clip,
        num_members=num_members,
        pass_bytes=tuple(pipeline_pass_bytes(plan)),
    )


class _PackTimes:
    """Shards as the items :func:`_pack` packs: a pack fits its budget and a cap on seconds.

    ``last_bytes``: what the pack that ends the job has less room for than the others (bytes).
    """

    def __init__(self, prefix_s: list[float], resident_bytes: Sequence[int], cap_s: float,
                 last_bytes: int) -> None:
        self.prefix_s = prefix_s
        self.prefix_bytes = [0, *itertools.accumulate(resident_bytes)]
        self.cap_s = cap_s
        self.last_bytes = last_bytes

    def shard_rows(self, start: int, stop: int, limit: int) -> int | None:
        num_bytes = self.prefix_bytes[stop] - self.prefix_bytes[start]
        if stop == len(self.prefix_bytes) - 1:
            num_bytes += self.last_bytes
        fits = num_bytes <= limit
        return 1 if fits and self.forward_s(start, stop) <= self.cap_s else None

    def param_bytes(self, start: int, stop: int) -> int:
        return self.prefix_bytes[stop] - self.prefix_bytes[start]

    def forward_s(self, start: int, stop: int) -> float:
        return self.prefix_s[stop] - self.prefix_s[start]

    def backward_s(self, start: int, stop: int) -> float:
        return 0.0
