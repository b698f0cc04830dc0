"""The fusion degree: how many trials of one architecture train as one fused array.

``resources.fusion`` (``ShardExecutor(fusion=...)``) is ``"off"``, a fixed K, or ``"auto"``:
mu-TWO's sub-array selection (Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313)
measures on the device the throughput (trials x tokens per second) and peak memory of K = 1, 2, 4,
... fused members (:func:`measure_fusion`) and picks the fastest K (:func:`choose_fusion_degree`;
on a CPU often 1). K is chosen for the widest member an array may hold (LoRA adapters are padded to
the largest rank the search space allows, ``ShardExecutor.fusion_choice``). Measurements are cached
per (:func:`fusion_cache_key`, budget, device kind) in a :class:`FusionCache`;
:class:`FusionChoice` is the decision with its reason. Trials that spill fuse only with a fixed K
(:mod:`~sweepmaster.runtime.training.fused_spill`), capped to the largest K whose stacked layers
fit; ``"auto"`` measures only arrays that fit a device.

A measurement costs time that fusion must win back: ``"auto"`` measures only the degrees whose
measurement, predicted from the plan's step time, fits within :data:`FUSION_MEASURE_SHARE` of
the predicted training time of the trials the choice is for (:func:`bounded_degrees`); a job too
small to pay for measuring K = 1 and 2 trains alone, unmeasured, and the choice says so.

Example:
    >>> measurements = measure_fusion(spec, device, ks=(1, 2, 4))  # doctest: +SKIP
    >>> choose_fusion_degree(measurements)  # doctest: +SKIP
    2
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeAlias

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import CudaMeter, VirtualMeter, format_bytes
from sweepmaster.runtime.devices.settings import FusionMode, check_fusion_mode
from sweepmaster.runtime.planning.partition import device_kind, optimizer_key, plan_job
from sweepmaster.runtime.planning.plans import JobPlan, KeyedCache
from sweepmaster.runtime.planning.profile import ModelProfile, profile_model
from sweepmaster.runtime.planning.timing import _best_seconds
from sweepmaster.runtime.training.fused_shards import StackedLayerTooLargeError, plan_stacked
from sweepmaster.runtime.training.fused_spill import SpilledFusedJob
from sweepmaster.runtime.training.shard_trainer import ShardTrainer
from sweepmaster.runtime.training.spill import SpilledJob
from sweepmaster.workload.architecture import fusion_group_key
from sweepmaster.workload.causal_lm import placeholder_init
from sweepmaster.workload.spec import TrainSpec

__all__ = [
    "FUSION_FORMAT_VERSION", "FUSION_MEASURE_SHARE", "MAX_AUTO_FUSION_DEGREE",
    "MEASURE_STEPS_PER_K", "FusionCache", "FusionChoice", "FusionDegrees", "FusionMeasurement",
    "FusionMode", "auto_degrees", "bounded_degrees", "check_fusion_mode",
    "choose_fusion_degree", "fixed_choice", "fused_bytes_estimate", "fusion_cache_key",
    "measure_fusion", "measured_choice", "with_step_seconds",
]

#: ``"auto"`` measures K = 1, 2, 4, ... up to this many members (or the first K that does not fit).
MAX_AUTO_FUSION_DEGREE = 8

#: Bumped when what a measurement means changes, so cached measurements are not reused.
FUSION_FORMAT_VERSION = 1

#: The most ``"auto"`` spends measuring, as a share of the predicted seconds of training
#: :data:`MAX_AUTO_FUSION_DEGREE` trials of the job alone (the trials its choice is for: at
#: least one array of the largest K); ``None``: no bound (every degree that fits is measured).
FUSION_MEASURE_SHARE: float | None = 0.1

#: Optimizer steps :func:`measure_fusion` runs per K at its defaults, per member (two for
#: memory, then three timed blocks of five): a measurement of K costs about ``17 * K`` steps of
#: one trial.
MEASURE_STEPS_PER_K = 17

_log = logging.getLogger("sweepmaster.fusion")

#: :func:`fused_bytes_estimate`'s margin over K footprints (stacking, batched kernels): this
#: fraction of them plus this many copies of one member's parameters (measured on GPT-2s of 0.8
#: and 91 MiB footprints, K = 2 to 8: 1 to 3.1 parameter copies above K footprints).
_FUSED_BYTES_MARGIN = 0.05
_FUSED_PARAM_COPIES = 2


def fusion_cache_key(spec: TrainSpec, microbatch_size: int | None = None) -> str | None:
    """The key fusion measurements are cached under: what their numbers depend on.

    The :func:`~sweepmaster.workload.architecture.architecture_key` (model config, dtype, batch
    ``B`` and block length ``T``), the
    :func:`~sweepmaster.runtime.planning.partition.optimizer_key` and
    :data:`FUSION_FORMAT_VERSION`, e.g. ``"3f9c0e1d2b4a5c6d/adamw/f1"`` (at most 64
    characters); a LoRA trial's also names its adapter's rank and whether it drops
    (``".../adamw/r64d/f1"``), which change an array's bytes and time, and a measurement at a
    ``microbatch_size`` below ``B`` (:func:`measure_fusion`'s) its blocks per pass
    (``".../adamw/mb2/f1"``). ``None`` when the trial cannot fuse (a factory without an
    ``architecture_key`` attribute).

    Raises:
        DataError: The config of a pretrained model cannot be loaded.
    """
    group = fusion_group_key(spec)
    if group is None:
        return None
    adapter = "" if spec.peft is None else \
        f"/r{spec.peft.r}" + ("d" if spec.peft.dropout > 0 else "")
    rows = "" if microbatch_size is None or microbatch_size >= spec.batch_size else \
        f"/mb{microbatch_size}"
    return (f"{group[0]}/{optimizer_key(spec.optimizer)}{adapter}{rows}"
            f"/f{FUSION_FORMAT_VERSION}")


def fused_bytes_estimate(plan: JobPlan, k: int) -> int:
    """Estimated peak bytes of a fused array of ``k`` members planned like ``plan``.

    The frozen parameters once (a fused LoRA array holds its base once, mLoRA / ASPEN), ``k``
    times the rest of one member's plain footprint (``plan.plain_bytes``), plus 5% of that and
    two copies of one member's trainable parameters; ``plan.plain_bytes`` for K = 1.
    """
    if k <= 1:
        return plan.plain_bytes
    trainable = sum(shard.owned_param_bytes for shard in plan.shards)
    frozen = sum(shard.param_bytes - shard.owned_param_bytes - shard.borrowed_bytes
                 for shard in plan.shards)
    per_member = plan.plain_bytes - frozen
    return (math.ceil(k * per_member * (1 + _FUSED_BYTES_MARGIN)) + frozen
            + _FUSED_PARAM_COPIES * trainable)


def auto_degrees(
    plan: JobPlan, budget_bytes: int, metered: bool, max_k: int = MAX_AUTO_FUSION_DEGREE
) -> list[int]:
    """The fusion degrees ``"auto"`` measures: 1, 2, 4, ... up to ``max_k``.

    On a metered device (a GPU or a virtual device) the measurement itself stops at the first K
    that does not fit (a real or a counted out-of-memory error); on the unmetered host CPU, whose
    budget is its free RAM, degrees whose estimate (:func:`fused_bytes_estimate`) exceeds the
    budget are not tried.
    """
    ks = [1 << i for i in range(max(1, max_k).bit_length()) if 1 << i <= max_k]
    if metered:
        return ks
    return [k for k in ks if fused_bytes_estimate(plan, k) <= budget_bytes or k == 1]


def bounded_degrees(ks: Sequence[int], step_s: float, total_steps: int,
                    share: float | None = FUSION_MEASURE_SHARE,
                    num_trials: int = MAX_AUTO_FUSION_DEGREE) -> tuple[list[int], str | None]:
    """The degrees of ``ks`` whose measurement fits ``"auto"``'s time budget, and why not more.

    Measuring K costs about ``MEASURE_STEPS_PER_K * K * step_s`` seconds (K members' steps);
    the budget is ``share * num_trials * total_steps * step_s``, the share of the predicted
    time of training ``num_trials`` trials alone. Degrees are kept in increasing K while the
    sum of their costs fits; fewer than two kept (nothing to compare K = 1 with) keep none.

    Args:
        ks: The degrees ``"auto"`` would measure (:func:`auto_degrees`), increasing.
        step_s: Predicted (or recorded) seconds of one optimizer step of one trial.
        total_steps: Optimizer steps of one trial.
        share: The budget's share of the training time; ``None``: keep every K.
        num_trials: Trials the choice is for.

    Returns:
        ``(kept, why)``: the degrees to measure, and, where some were left out, why (for the
        choice's note), else ``None``.
    """
    if share is None or not ks:
        return list(ks), None
    budget_s = share * num_trials * total_steps * step_s
    kept: list[int] = []
    cost_s = 0.0
    for k in ks:
        k_cost_s = MEASURE_STEPS_PER_K * k * step_s
        if cost_s + k_cost_s > budget_s:
            break
        kept.append(k)
        cost_s += k_cost_s
    if len(kept) == len(ks):
        return kept, None
    if len(kept) < 2:
        kept, cost_s = [], 0.0
    left_out = [k for k in ks if k not in kept]
    next_ks = left_out[:1] if kept else [1, *left_out[1:2]]
    needed_s = cost_s + MEASURE_STEPS_PER_K * step_s * sum(next_ks)
    training_s = num_trials * total_steps * step_s
    return kept, (
        ("not measured" if not kept else f"K = {', '.join(map(str, left_out))} not measured")
        + ": measuring "
        f"K = {' and '.join(map(str, next_ks)) if not kept else next_ks[0]}"
        f"{' too' if kept else ''} would take about {needed_s:.3g} s, more than {share:.0%} "
        f"of the {training_s:.3g} s {num_trials} trials of {total_steps} steps are "
        f"predicted to train alone; set a fixed fusion K to fuse them anyway")


@dataclass(frozen=True)
class FusionChoice:
    """How many trials of one architecture train as one fused array here, and why.

    Attributes:
        k: The fusion degree (1: each trial trains alone).
        source: ``"off"``, ``"unfusable"`` (no architecture key), ``"spills"`` (a trial does
            not fit the device), ``"fixed"`` (the K asked for), ``"capped"`` (lowered to what
            fits), ``"measured"`` (now), ``"cached"`` (before) or ``"unmeasured"`` (``"auto"``
            for a job too small to pay for measuring: K = 1, see :func:`bounded_degrees`).
        note: The choice in words, for logs and ``sweepmaster plan``.
        measurements: What ``"measured"`` and ``"cached"`` chose from, in increasing K.
        stacked_plan: For trials that spill and fuse (K > 1): the plan of the K members'
            stacked shards (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`).
    """

    k: int
    source: Literal["off", "unfusable", "spills", "fixed", "capped", "measured", "cached",
                    "unmeasured"]
    note: str
    measurements: tuple[FusionMeasurement, ...] = ()
    stacked_plan: JobPlan | None = None


def fixed_choice(k: int, plan: JobPlan, budget_bytes: int, device: str) -> FusionChoice:
    """The choice for a fixed K: K, or fewer when K members of ``plan`` would not fit the budget.

    ``device`` is the device's name, for the note.
    """
    fitting = [n for n in range(1, k + 1) if fused_bytes_estimate(plan, n) <= budget_bytes]
    fits = max(fitting, default=1)
    if fits >= k:
        return FusionChoice(k, "fixed", f"K = {k} as asked" if k > 1 else "K = 1 as asked")
    return FusionChoice(
        fits, "capped",
        f"K = {fits}: {k} asked, but only {fits} fit {device}'s {format_bytes(budget_bytes)} "
        f"budget (about {format_bytes(plan.plain_bytes)} each)",
    )


def measured_choice(measurements: Sequence[FusionMeasurement], cached: bool) -> FusionChoice:
    """The choice ``"auto"`` makes from measurements (:func:`choose_fusion_degree`), with a note.

    Raises:
        ValueError: No measurement fits.
    """
    k = choose_fusion_degree(measurements)
    by_k = {m.k: m for m in measurements}
    rates = ", ".join(
        f"K={m.k}: {m.trials_tokens_per_s:,.0f}" if m.fits else f"K={m.k}: does not fit"
        for m in measurements
    )
    base = by_k[1].trials_tokens_per_s if 1 in by_k and by_k[1].fits else 0.0
    gain = f", {by_k[k].trials_tokens_per_s / base:.2f}x K = 1" if k > 1 and base > 0 else ""
    how = "cached measurement" if cached else "measured"
    return FusionChoice(k, "cached" if cached else "measured",
                        f"K = {k} ({how}, trials x tokens/s {rates}{gain})", tuple(measurements))


def with_step_seconds(
    measurements: Sequence[FusionMeasurement], tokens_per_step: int
) -> list[FusionMeasurement]:
    """Fill in ``step_seconds`` from ``trials_tokens_per_s`` (a cache need not keep it).

    ``step_seconds = K * tokens_per_step / trials_tokens_per_s``; 0 where nothing fit.
    """
    return [
        replace(m, step_seconds=m.k * tokens_per_step / m.trials_tokens_per_s
                if m.fits and m.trials_tokens_per_s > 0 else 0.0)
        for m in measurements
    ]


@dataclass(frozen=True)
class FusionMeasurement:
    """Throughput and memory of training K trials fused, on one device (JSON-able).

    Attributes:
        k: Fusion degree K (1: one trial alone, unfused).
        trials_tokens_per_s: Training tokens per second summed over the K trials
            (``K * B * T / step_seconds``); 0 when it does not fit.
        peak_bytes: Peak bytes of live tensors while training two steps, and building the
            members on the unmetered host CPU (the device's meter, see :func:`_probe`); 0 if an
            OOM stopped it.
        fits: Whether it ran within the device (no OOM) and the byte budget, if one was given.
        step_seconds: Wall seconds of one optimizer step of all K trials (the mean step of the
            fastest timing block, see :func:`measure_fusion`); 0 when it does not fit.
    """

    k: int
    trials_tokens_per_s: float
    peak_bytes: int
    fits: bool
    step_seconds: float


#: Measurements (increasing K) per (:func:`fusion_cache_key`, budget or 0 on the unmetered host
#: CPU, device kind); a cache need not keep ``step_seconds`` (:func:`with_step_seconds`).
#: :class:`sweepmaster.store.fusion.StoreFusionCache` keeps them in ``sm_fusion_measurements``.
FusionCache = KeyedCache[list[FusionMeasurement]]


def measure_fusion(
    spec_template: TrainSpec, device: Device, ks: Sequence[int] = (1, 2, 4, 8), steps: int = 5,
    budget_bytes: int | None = None, rounds: int = 3, microbatch_size: int | None = None,
) -> list[FusionMeasurement]:
    """Measure trials-x-tokens per second and peak memory for each fusion degree K.

    mu-TWO's sub-array selection (Purandare et al., MLSys 2023): train K copies of
    ``spec_template`` (seeds ``seed + i``) on the device, K increasing, stopping after the first
    that does not fit. Each K's members are built once (weights from
    :func:`~sweepmaster.workload.causal_lm.placeholder_init`: a seeded build's bytes, not its
    draws); the build and two steps run under the device's meter (the peak; also a warm-up),
    then ``rounds`` blocks of ``steps`` steps keep the fastest block's mean step (robust to
    bursts of load, without the rebuilds that interleaving K would need). Each K trains as the
    executor trains trials that fit the device: K = 1 a
    :class:`~sweepmaster.runtime.training.spill.SpilledJob` on one shard holding the whole model
    (no vmap: the alternative fusion has to beat), K > 1 a
    :class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob` on one stacked shard
    holding the whole array; a step is the job's tasks of one optimizer step
    (:meth:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer.run_step`), its shard kept
    resident
    between steps as the executor keeps it. The members never evaluate.

    ``budget_bytes`` is a byte budget besides the device's own (an OOM). ``microbatch_size``:
    the largest blocks per layer pass (an executor's ``microbatch_size``), which the jobs are
    planned and timed at, as the executor plans them; ``None``: the batch. Returns one
    measurement per K tried, in increasing K (the last may not fit).

    Raises:
        ValueError: ``ks`` empty or with a K < 1, ``steps < 1`` or ``rounds < 1``.
    """
    if not ks or min(ks) < 1 or steps < 1 or rounds < 1:
        raise ValueError(f"need ks, steps and rounds >= 1, got {list(ks)}, {steps}, {rounds}")
    measurements = []
    num_steps = 2 + rounds * steps
    # one member's profile serves every K
    profile = profile_model(spec_template, microbatch_size, device=device)
    for k in sorted(set(ks)):
        specs = [
            replace(spec_template, seed=spec_template.seed + i,
                    name=f"{spec_template.name}-{i}", checkpoint_dir=None, state_dir=None,
                    checkpoint_every=None, eval_data=None, eval_every=None,
                    metric="train_loss", max_steps=num_steps + 1)
            for i in range(k)
        ]
        try:
            peak, job = _probe(specs, device, profile, microbatch_size)
        except torch.OutOfMemoryError:
            measurements.append(FusionMeasurement(k, 0.0, 0, False, 0.0))
            break
        try:
            if budget_bytes is not None and peak > budget_bytes:
                measurements.append(FusionMeasurement(k, 0.0, peak, False, 0.0))
                break

            def step(job: ShardTrainer = job) -> None:
                job.run_step(device, keep=True)

            seconds = min(sum(_best_seconds(device.torch_device, step, 1)
                              for _ in range(steps)) / steps for _ in range(rounds))
        finally:
            job.store.release()  # its shard leaves the device before the next K's job is built
        del job
        measurements.append(
            FusionMeasurement(k, k * spec_template.tokens_per_step / seconds, peak, True, seconds)
        )
    return measurements


def choose_fusion_degree(measurements: Sequence[FusionMeasurement]) -> int:
    """The K with the highest measured trials-x-tokens per second among those that fit.

    Ties go to the smaller K. On a CPU this is often 1: the choice follows the measurement.

    Raises:
        ValueError: No measurement fits.
    """
    fitting = [m for m in measurements if m.fits]
    if not fitting:
        raise ValueError("no fusion degree fits the device; measure with smaller ks")
    return max(fitting, key=lambda m: (m.trials_tokens_per_s, -m.k)).k


def _probe(specs: list[TrainSpec], device: Device, profile: ModelProfile,
           microbatch_size: int | None) -> tuple[int, ShardTrainer]:
    """Build the members' job and train two steps under the device's meter (:func:`_peak_bytes`).

    On the unmetered host CPU the build is counted too (its transfers are in place: the host
    copies are what the steps use); on a metered device the host copies are not device memory,
    and the peak is the steps' (the promoted shard, its optimizer state, the activations).

    Returns:
        The peak bytes and the built job (:func:`_built_job`), its shard kept on ``device``.

    Raises:
        torch.OutOfMemoryError: They do not fit the device.
    """
    built = [] if device.meter is None else [_built_job(specs, device, profile, microbatch_size)]

    def run() -> None:
        if not built:
            built.append(_built_job(specs, device, profile, microbatch_size))
        built[0].run_step(device, keep=True)
        built[0].run_step(device, keep=True)

    try:
        return _peak_bytes(run, device), built[0]
    except BaseException:
        for job in built:
            job.store.release()
        raise


def _built_job(specs: list[TrainSpec], device: Device, profile: ModelProfile,
               microbatch_size: int | None) -> ShardTrainer:
    """The job the executor runs for ``specs`` when they fit ``device``, placeholder weights.

    One member: a :class:`~sweepmaster.runtime.training.spill.SpilledJob` on one shard holding
    the whole model; K > 1: a :class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`
    on one stacked shard holding the whole array (S = 1, as ``ShardExecutor.stacked_plan(...,
    whole=True)`` plans it), from ``profile`` (one member's), at ``microbatch_size``. The specs
    never evaluate and train more steps than are measured.
    """
    with placeholder_init():
        if len(specs) == 1:
            return SpilledJob(specs[0], plan_job(specs[0], device, profile=profile, whole=True,
                                                 microbatch_size=microbatch_size))
        plan = plan_stacked(specs[0], len(specs), device, profile=profile, whole=True,
                            microbatch_size=microbatch_size)
        return SpilledFusedJob(specs, plan)


def _peak_bytes(run: Callable[[], None], device: Device) -> int:
    """Peak live tensor bytes above the starting point while ``run()`` runs.

    Counted by the device's meter (CUDA statistics, or a virtual device's accountant, which raises
    ``torch.OutOfMemoryError`` past its budget) or, for the unmetered host CPU, a budget-less
    :class:`~sweepmaster.runtime.devices.meter.VirtualMeter`.
    """
    meter = device.meter
    if meter is None and device.torch_device.type == "cuda":
        meter = CudaMeter(device.torch_device, device.budget_bytes, device.name)
    elif meter is None:
        meter = VirtualMeter(budget_bytes=2**62, name=device.name)
    base_bytes = meter.live_bytes
    meter.reset_peak()
    with meter.metering():
        run()
    return max(0, meter.peak_bytes - base_bytes)


#: Runs a measurement of ``(spec, ks, budget_bytes)`` on a device (the executor: as a job).
Measure: TypeAlias = Callable[[TrainSpec, list[int], "int | None"], list[FusionMeasurement]]


class FusionDegrees:
    """An executor's fusion setting and the measurements behind it; thread-safe.

    Answers :meth:`~sweepmaster.runtime.executor.ShardExecutor.fusion_choice`: measurements
    are kept in memory per (:func:`fusion_cache_key`, budget, device kind), read from and written
    to ``cache`` when one is given, and measured (by ``measure``) at most once per entry.
    ``microbatch_size``: the executor's, which ``measure`` measures at (part of the key).

    Raises:
        ValueError: An invalid ``mode`` (``"auto"``, ``"off"`` or a fixed K, see
            :func:`check_fusion_mode`).
    """

    def __init__(self, mode: FusionMode, cache: FusionCache | None = None,
                 microbatch_size: int | None = None) -> None:
        self.mode = check_fusion_mode(mode)
        self.cache = cache
        self.microbatch_size = microbatch_size
        self._known: dict[tuple[str, int, str], tuple[list[FusionMeasurement], bool]] = {}
        self._lock = threading.Lock()  # guards _known
        self._measuring = threading.Lock()  # one measurement at a time

    def choose(self, spec: TrainSpec, plan: JobPlan | None, device: Device, spills: bool,
               measure: Measure, stacked: StackedPlanner | None = None) -> FusionChoice:
        """The fusion degree of ``spec``'s trials on ``device`` (the smallest budget), and why.

        Args:
            spec: The widest trial arrays of the architecture will hold (module doc).
            plan: Its plan on ``device`` (may be ``None`` when fusion is off or the trial has
                no architecture key).
            device: The device arrays must fit (the executor's planning device).
            spills: Whether the trial spills there.
            measure: Measures for ``"auto"`` on a miss.
            stacked: Plans K spilled members' stacked shards: with it, a fixed K of trials that
                spill fuses up to the largest K that fits; without it, they train alone.

        Raises:
            ValueError: No fusion degree fits (not even K = 1).
        """
        if self.mode == "off":
            return FusionChoice(1, "off", "fusion is off")
        entry = self.entry(spec, device, self.microbatch_size)
        if entry is None:
            return FusionChoice(1, "unfusable",
                                "the model has no architecture key, so its trials train alone")
        if spills:
            return _spilled_choice(self.mode, spec, device, stacked)
        assert plan is not None
        if self.mode != "auto":
            assert isinstance(self.mode, int)
            return fixed_choice(self.mode, plan, device.budget_bytes, device.name)
        with self._measuring:
            with self._lock:
                known = self._known.get(entry)
            why_not: str | None = None
            if known is None:
                stored = self.cache.get(*entry) if self.cache is not None else None
                if stored:
                    known = (with_step_seconds(stored, spec.tokens_per_step), True)
                else:
                    metered = device.meter is not None
                    ks, why_not = bounded_degrees(
                        auto_degrees(plan, device.budget_bytes, metered), plan.step_s,
                        spec.total_steps, FUSION_MEASURE_SHARE)
                    if not ks:
                        choice = FusionChoice(1, "unmeasured", f"K = 1 ({why_not})")
                        _log.info("fusion of %s: %s", spec.name, choice.note)
                        return choice
                    known = (measure(spec, ks, device.budget_bytes if metered else None), False)
                    if self.cache is not None:
                        self.cache.put(*entry, known[0])
                with self._lock:
                    self._known[entry] = known
        choice = measured_choice(*known)
        if why_not is not None:
            choice = replace(choice, note=f"{choice.note}; {why_not}")
        if not known[1]:
            _log.info("fusion of %s: %s", spec.name, choice.note)
        return choice

    def known(self, spec: TrainSpec, device: Device, k: int) -> FusionMeasurement | None:
        """The measurement of ``k`` members of ``spec``'s architecture, if one was made."""
        entry = self.entry(spec, device, self.microbatch_size)
        with self._lock:
            known = self._known.get(entry) if entry is not None else None
        return next((m for m in known[0] if m.k == k), None) if known is not None else None

    @staticmethod
    def entry(spec: TrainSpec, device: Device,
              microbatch_size: int | None = None) -> tuple[str, int, str] | None:
        """The cache entry of ``spec`` on ``device``: (key, budget or 0 on the host, kind)."""
        key = fusion_cache_key(spec, microbatch_size)
        if key is None:
            return None
        budget = device.budget_bytes if device.meter is not None else 0  # the host's RAM moves
        return key, budget, device_kind(device)


#: Plans K members' stacked shards (raises ``StackedLayerTooLargeError`` when one layer of K
#: members does not fit).
StackedPlanner = Callable[[int], JobPlan]


def _spilled_choice(mode: FusionMode, spec: TrainSpec, device: Device,
                    stacked: StackedPlanner | None) -> FusionChoice:
    """The fusion degree of trials that spill on ``device`` (see :meth:`FusionDegrees.choose`).

    ``"auto"`` does not measure spilled arrays (a measurement of K spilled members trains
    every stacked shard of K = 1, 2, 4, ... several steps), so it keeps K = 1; a fixed K fuses
    up to K members whose stacked shards fit.
    """
    where = f"trials spill on {device.name}"
    last_error: Exception | None = None
    if stacked is None or mode == "auto" or not isinstance(mode, int) or mode <= 1:
        why = ("auto measures only arrays that fit a device; set resources.fusion: K to fuse "
               "them as a spilled array") if mode == "auto" else "fused arrays must fit a device"
        return FusionChoice(1, "spills", f"{where}, so they train alone ({why})")
    for k in range(mode, 1, -1):
        try:
            plan = stacked(k)
        except StackedLayerTooLargeError as err:
            last_error = err
            continue
        shards = f"{len(plan.shards)} stacked shards, est. {plan.step_s:.3f} s per step"
        if k == mode:
            return FusionChoice(k, "fixed", f"K = {k} as asked, spilled ({shards})",
                                stacked_plan=plan)
        return FusionChoice(k, "capped", f"K = {k}: {mode} asked, but {last_error}; spilled "
                            f"({shards})", stacked_plan=plan)
    return FusionChoice(1, "spills", f"{where} and {last_error}; they train alone")
