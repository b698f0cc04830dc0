"""Stacked shards: the layers of K fused members, each parameter stacked ``(K, ...)``.

A fused array (HFTA, Wang et al. MLSys 2021; mu-TWO, Purandare et al. MLSys 2023) stacks every
parameter of its K same-architecture members along a leading member dimension. Spilling it
(Hydra, Nagrecha & Kumar 2022) cuts the *stacked* model into shards: a **stacked shard** is a
contiguous range of layers with the K members' parameters of those layers, promoted and demoted
as one. This module holds what does not depend on training:

* :func:`stacked_profile` scales a one-member
  :class:`~sweepmaster.runtime.planning.profile.ModelProfile` to K members (every trainable
  parameter, activation and transient is K times one member's, and so is every layer's compute;
  each layer also holds its members' pre-drawn dropout noise, :func:`dropout_noise_bytes`), so the
  partitioner (:func:`~sweepmaster.runtime.planning.packing.estimate_partition`, Harmony
  Algorithm 2) cuts shards whose *stacked* working set fits the budget;
* :func:`plan_stacked` plans K members for a device (:func:`stacked_spec` is the one member it
  plans for), its shards counting the packed dropout noise and LoRA scalings their passes
  promote from when the partitioner weighs them; when one layer of K members does not fit,
  :class:`StackedLayerTooLargeError` names the layer, its bytes and the budget;
* :class:`StackedLayers` runs one layer of the K members as a ``vmap`` over members of
  ``functional_call`` on a parameterless template layer (built on the meta device,
  :func:`~sweepmaster.runtime.training.members.meta_template`), with per-member dropout noise
  replayed by :class:`~sweepmaster.runtime.training.member_dropout.DropoutReplay`.

LoRA members (multi-LoRA training over one shared frozen base: mLoRA / ASPEN, VLDB 2025;
LoRAFusion) stack only their adapters, zero-padded to the largest rank R
(:func:`~sweepmaster.runtime.training.members.padded_adapter`; why the padding stays exactly
zero: :mod:`~sweepmaster.runtime.training.fused_spill`): the template carries the
padded adapter (:func:`stacked_spec`), the frozen base is one unstacked tensor per name passed to
``vmap`` with ``in_dims=None``, and each member's ``alpha / r`` replaces PEFT's scaling. The
planner charges the base once and the adapters K times.

Shape legend: K members, B batch, b microbatch, T tokens per block, C hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call, vmap

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import format_bytes
from sweepmaster.runtime.planning.packing import estimate_partition, make_plan
from sweepmaster.runtime.planning.plans import JobPlan, LayerTooLargeError, ShardPlan
from sweepmaster.runtime.planning.profile import (
    LayerProfile,
    ModelProfile,
    build_fake_model,
    forked_host_rng,
    plain_footprint_bytes,
    profile_model,
)
from sweepmaster.runtime.scheduling.residency import PEAK_MARGIN
from sweepmaster.runtime.training.layers import decompose
from sweepmaster.runtime.training.member_dropout import (
    DropoutReplay,
    NoiseSite,
    SeededOpDetector,
    marking_adapter_dropout,
)
from sweepmaster.runtime.training.members import (
    lora_layers,
    lora_scaling,
    meta_template,
    padded_adapter,
    tied_aliases,
)
from sweepmaster.workload.causal_lm import causal_lm_loss
from sweepmaster.workload.spec import TrainSpec

__all__ = [
    "StackedLayerTooLargeError",
    "StackedLayers",
    "dropout_noise_bytes",
    "members_losses",
    "plan_stacked",
    "stacked_profile",
    "stacked_spec",
]


class StackedLayerTooLargeError(LayerTooLargeError):
    """One layer of K stacked members does not fit the device budget (fuse fewer members).

    Attributes:
        num_members: K.
    """

    def __init__(self, layer: str, num_bytes: int, budget_bytes: int, num_members: int) -> None:
        super().__init__(layer, num_bytes, budget_bytes)
        self.num_members = num_members
        self.args = (
            f"layer {layer!r} of {num_members} fused members needs {format_bytes(num_bytes)} "
            f"to train, more than the device budget of {format_bytes(budget_bytes)}: fuse "
            "fewer members (resources.fusion) or use a device with more memory",
        )

    def __str__(self) -> str:  # noqa: D105
        return str(self.args[0])


def stacked_profile(
    profile: ModelProfile, num_members: int, noise_bytes_per_row: Sequence[int] | None = None
) -> ModelProfile:
    """One member's profile scaled to ``num_members`` stacked members (see the module doc).

    Bytes and seconds of every layer, every trainable parameter and the plain activation peak
    are multiplied by K: a stacked layer's tensors are ``(K, ...)`` versions of one member's, and
    its vmapped kernels do K members' work. Frozen parameters (a LoRA base) are held once for
    all members: their bytes stay one member's.

    Args:
        profile: One member's profile.
        num_members: K.
        noise_bytes_per_row: Per layer, the dropout noise one block draws (bytes,
            :func:`dropout_noise_bytes`): a stacked layer holds its members' pre-drawn noise
            from its forward to its backward, so it is added to the layer's saved bytes and
            peaks.

    Raises:
        ValueError: ``num_members < 1``.
    """
    if num_members < 1:
        raise ValueError(f"a stacked profile needs at least one member, got {num_members}")
    noise = list(noise_bytes_per_row or [0] * len(profile.layers))

    def scale(layer: LayerProfile, noise_bytes: int) -> LayerProfile:
        values = {
            field.name: getattr(layer, field.name) * num_members
            for field in dataclasses.fields(layer)
            if field.name not in ("name", "param_names", "frozen_param_names")
        }
        for name in ("forward_peak_bytes", "saved_bytes", "train_forward_peak_bytes",
                     "backward_peak_bytes"):
            values[name] += num_members * noise_bytes
        return dataclasses.replace(layer, **values)

    rows = profile.microbatch_size
    return dataclasses.replace(
        profile,
        layers=tuple(scale(layer, n * rows) for layer, n in zip(profile.layers, noise,
                                                                  strict=True)),
        unit_layers=tuple(scale(layer, n) for layer, n in zip(profile.unit_layers, noise,
                                                                strict=True)),
        param_bytes={name: n * num_members for name, n in profile.param_bytes.items()},
        plain_activation_peak_bytes=profile.plain_activation_peak_bytes * num_members,
    )


def plan_stacked(
    spec: TrainSpec,
    num_members: int,
    device: Device,
    *,
    microbatch_size: int | None = None,
    profile: ModelProfile | None = None,
    budget_bytes: int | None = None,
    whole: bool = False,
) -> JobPlan:
    """Partition K stacked members of ``spec``'s architecture for ``device`` (never trains).

    An array whose plain footprint (K members', a LoRA base once) fits the budget is one stacked
    shard holding the whole array at ``microbatch_size`` (S = 1: it stays resident between its
    steps), as :func:`~sweepmaster.runtime.planning.partition.plan_job` plans a single job that
    fits. A larger one is cut into the fewest stacked shards whose working sets (parameters,
    gradients, optimizer state, activations of one microbatch, all K members'; a LoRA base
    once) fit the budget. ``plan.plain_bytes`` is K members' plain footprint, ``plan.spill``
    whether the array must spill. Each stacked shard counts what its layer passes promote
    besides it: its LoRA members' scalings
    (:attr:`~sweepmaster.runtime.planning.plans.ShardPlan.scaling_bytes`; dropout noise is
    drawn on the device, its ``noise_bytes`` are 0), from when the
    partitioner weighs it, so the bytes its tasks move
    (:meth:`~sweepmaster.runtime.planning.plans.JobPlan.task_bytes`), the plan's swap volume
    and its estimated seconds are the array's. Its peaks are K times one member's (estimates):
    its prefetches keep
    :data:`~sweepmaster.runtime.scheduling.residency.PEAK_MARGIN` of a task's peak free
    (:attr:`~sweepmaster.runtime.planning.plans.JobPlan.prefetch_margin`), as the array does.

    Args:
        spec: One member (all share its architecture); for members that differ,
            :func:`stacked_spec` of them.
        num_members: K.
        device: The device planned for.
        microbatch_size: The largest blocks per layer pass; default the batch size.
        profile: One member's profile to reuse.
        budget_bytes: Plan for this budget instead of the device's (bytes), e.g. a re-plan's.
        whole: One stacked shard holding the whole array whatever the budget (an array that
            must not spill; on a metered device it runs out of memory if it does not fit).

    Returns:
        The stacked plan (its bytes and seconds are the array's).

    Raises:
        StackedLayerTooLargeError: One layer of K members does not fit, even one block at a time.
    """
    if profile is None:
        profile = profile_model(spec, microbatch_size, device=device)
    noise_rows = _noise_rows(spec)
    stacked = stacked_profile(profile, num_members, _float_bytes(noise_rows))
    # a LoRA member's trainable parameters are its adapters: the layers using any hold adapters
    adapted = frozenset(index for index, layer in enumerate(stacked.layers)
                        if spec.peft is not None and layer.param_names)
    pass_bytes = functools.partial(_with_pass_bytes, noise_rows=noise_rows,
                                   num_members=num_members, adapted=adapted,
                                   batch_size=stacked.batch_size)
    budget = device.budget_bytes if budget_bytes is None else budget_bytes
    plain = plain_footprint_bytes(stacked.param_bytes, stacked.plain_activation_peak_bytes,
                                  spec.optimizer, sum(stacked.frozen_param_bytes.values()),
                                  stacked.foreach_optimizer)
    if whole or plain <= budget:
        cuts, rows = [0, len(stacked.layers)], [stacked.microbatch_size]
    else:
        try:
            cuts, rows = estimate_partition(stacked, spec.optimizer, budget,
                                            device.torch_device.type, pass_bytes, PEAK_MARGIN)
        except LayerTooLargeError as err:
            raise StackedLayerTooLargeError(
                err.layer, err.num_bytes, err.budget_bytes, num_members
            ) from None
    return make_plan(stacked, spec.optimizer, cuts, device, microbatch_sizes=rows,
                     budget_bytes=budget, pass_bytes=pass_bytes, prefetch_margin=PEAK_MARGIN)


def stacked_spec(specs: Sequence[TrainSpec]) -> TrainSpec:
    """The one member a fused array of ``specs`` is planned, estimated and templated for.

    The widest of them: a clipping member if any (its deferred updates need room in the plan),
    with the largest SGD momentum of any member (a momentum buffer is optimizer state); LoRA
    members' adapter padded to their largest rank R, with a dropout site if any member drops
    (:func:`~sweepmaster.runtime.training.members.padded_adapter`). Every member of the
    array needs at most the bytes this one does, so an array of K of them bounds the array.

    Raises:
        ValueError: No specs.
    """
    if not specs:
        raise ValueError("a stacked array needs at least one member")
    clipping = [spec for spec in specs if spec.optimizer.grad_clip is not None]
    first = (clipping or list(specs))[0]
    adapter = padded_adapter(specs)
    momentum = max(spec.optimizer.momentum for spec in specs)
    optimizer = first.optimizer if momentum == first.optimizer.momentum else \
        dataclasses.replace(first.optimizer, momentum=momentum)
    if adapter == first.peft and optimizer is first.optimizer:
        return first
    return dataclasses.replace(first, peft=adapter, optimizer=optimizer)


def dropout_noise_bytes(spec: TrainSpec) -> list[int]:
    """Per layer, the bytes of dropout noise one member draws for one block (no memory used).

    Runs one training forward of one block under ``FakeTensorMode``, recording each layer's
    dropout draws (what :class:`~sweepmaster.runtime.training.member_dropout.DropoutReplay`
    would replay).
    """
    return _float_bytes(_noise_rows(spec))


def _float_bytes(noise_rows: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """Per layer, the bytes of its drawn noise of one row (:func:`_noise_rows`, unpacked)."""
    return [sum(num * itemsize for num, itemsize in layer) for layer in noise_rows]


def _noise_rows(spec: TrainSpec) -> list[list[tuple[int, int]]]:
    """Per layer, per dropout draw of one block: its elements and the bytes of one element.

    One training forward of one block under ``FakeTensorMode`` (see
    :func:`dropout_noise_bytes`): each draw's shape has a leading batch dimension of 1, so its
    elements are one row's.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_model(spec, fake_mode)
    model.train()
    stack = decompose(model)
    recorder = DropoutReplay(None)
    rows = []
    with forked_host_rng(), fake_mode, torch.no_grad(), recorder:
        hidden = torch.zeros((1, int(spec.train_data.shape[1])), dtype=torch.int64)
        for layer in stack.layers:
            first = len(recorder.sites)
            hidden = layer(hidden)
            rows.append([(math.prod(site.shape), site.dtype.itemsize)
                         for site in recorder.sites[first:]])
    return rows


def _with_pass_bytes(shard: ShardPlan, *, noise_rows: Sequence[Sequence[tuple[int, int]]],
                     num_members: int, adapted: frozenset[int], batch_size: int) -> ShardPlan:
    """``shard`` of a stacked plan counting what its passes promote besides the shard.

    No dropout noise: each pass draws its members' noise again on the device
    (:func:`~sweepmaster.runtime.training.fused_noise.member_noises`), so
    :attr:`~sweepmaster.runtime.planning.plans.ShardPlan.noise_bytes` is 0 for each layer.
    Each pass of a shard holding one of the ``adapted`` layers (LoRA adapters) promotes the
    members' scalings, ``(K,)`` fp32
    (:attr:`~sweepmaster.runtime.planning.plans.ShardPlan.scaling_bytes`); a shard without
    adapters (a LoRA base's embeddings or head) promotes none. The partitioner applies it to
    every shard it weighs, so the plan's swap volume and seconds count them.
    """
    del noise_rows, batch_size
    scaled = any(layer in adapted for layer in range(shard.start, shard.stop))
    return dataclasses.replace(shard, noise_bytes=(0,) * (shard.stop - shard.start),
                               noise_scale_bytes=0,
                               scaling_bytes=4 * num_members if scaled else 0)


def members_losses(logits_K: Tensor, ids_K: Tensor) -> Tensor:
    """Each member's causal LM loss ``(K,)`` (float32), ``vmap`` over the member dimension.

    ``logits_K``: ``(K, b, T, V)``; ``ids_K``: ``(K, b, T)``.
    """
    loss_K = vmap(causal_lm_loss)(logits_K, ids_K)
    assert isinstance(loss_K, Tensor)
    return loss_K


@dataclass(frozen=True)
class _LayerNames:
    """A template layer's tensors: its own name -> the model's canonical name."""

    params: dict[str, str]
    buffers: dict[str, str]


class StackedLayers:
    """The layers of a fused array's template, run over K members' stacked tensors.

    Args:
        spec: The array's :func:`stacked_spec` (the template is built from its model config and
            padded adapter on the meta device).

    Attributes:
        template: The parameterless model (meta device; ties intact).
        names: Layer names (``LayerStack.names``).
        aliases: ``state_dict`` name -> canonical name of tied tensors.
        param_names: Canonical trainable parameter names, in ``named_parameters`` order.
        frozen_names: Canonical frozen parameter names (a LoRA base: held once, not stacked).
        adapted: Whether the template carries a LoRA adapter.
    """

    def __init__(self, spec: TrainSpec) -> None:
        self.template = meta_template(spec)
        stack = decompose(self.template)
        self.layers: tuple[nn.Module, ...] = stack.layers
        self.names = stack.names
        self.aliases = tied_aliases(self.template)
        canonical = {id(p): n for n, p in self.template.named_parameters()}
        canonical_buffers = {id(b): n for n, b in self.template.named_buffers()}
        self.param_names = [n for n, p in self.template.named_parameters() if p.requires_grad]
        self.frozen_names = {n for n, p in self.template.named_parameters()
                             if not p.requires_grad}
        self.adapted = spec.peft is not None
        self._lora = [lora_layers(layer) for layer in self.layers]
        self._names = [
            _LayerNames(
                {n: canonical[id(p)] for n, p in layer.named_parameters(remove_duplicate=False)},
                {n: canonical_buffers[id(b)] for n, b in layer.named_buffers()},
            )
            for layer in self.layers
        ]

    def __len__(self) -> int:
        return len(self.layers)

    def layer_params(self, index: int) -> list[str]:
        """Canonical names of the parameters layer ``index`` uses (each once; frozen too)."""
        return list(dict.fromkeys(self._names[index].params.values()))

    def has_adapter(self, index: int) -> bool:
        """Whether layer ``index`` holds LoRA adapter layers (it uses the members' scalings)."""
        return bool(self._lora[index])

    def layer_buffers(self, index: int) -> list[str]:
        """Canonical names of the buffers layer ``index`` uses (each once)."""
        return list(dict.fromkeys(self._names[index].buffers.values()))

    def shapes(self) -> dict[str, torch.Size]:
        """Shapes of the template's trainable parameters (a LoRA adapter padded to rank R)."""
        named = dict(self.template.named_parameters())
        return {name: named[name].shape for name in self.param_names}

    def train(self, mode: bool = True) -> None:
        """Set the template's training mode (dropout on or off)."""
        self.template.train(mode)

    def forward(
        self,
        index: int,
        tensors: dict[str, Tensor],
        x_K: Tensor,
        noises: Sequence[Tensor] = (),
        scaling_K: Tensor | None = None,
    ) -> Tensor:
        """Layer ``index`` of every member: ``vmap`` over the leading member dimension.

        Args:
            index: The layer.
            tensors: Stacked ``(K, ...)`` parameters and buffers by canonical name (at least
                the layer's); frozen parameters (:attr:`frozen_names`) unstacked, shared by
                every member.
            x_K: The members' inputs ``(K, b, ...)`` (token ids ``(K, b, T)`` for the first).
            noises: The layer's dropout noise, one ``(K, b, ...)`` tensor per dropout site in
                forward order (empty in eval mode or without dropout).
            scaling_K: Each member's LoRA scaling ``alpha / r`` ``(K,)`` (needed when
                :attr:`adapted`).

        Returns:
            The members' outputs ``(K, b, ...)``.
        """
        names = self._names[index]
        params = {local: tensors[name] for local, name in names.params.items()
                  if name not in self.frozen_names}
        frozen = {local: tensors[name] for local, name in names.params.items()
                  if name in self.frozen_names}
        buffers = {local: tensors[name] for local, name in names.buffers.items()}
        layer, lora = self.layers[index], self._lora[index]

        def member(
            params: dict[str, Tensor], frozen: dict[str, Tensor], buffers: dict[str, Tensor],
            scaling: Tensor | None, x: Tensor, noises: list[Tensor]
        ) -> Tensor:
            return self._member_forward(layer, lora, {**frozen, **params}, buffers, scaling, x,
                                        noises)

        in_dims = (0, None, 0, None if scaling_K is None else 0, 0, 0)
        out_K = vmap(member, in_dims=in_dims, randomness="error")(
            params, frozen, buffers, scaling_K, x_K, list(noises))
        assert isinstance(out_K, Tensor)
        return out_K

    @staticmethod
    def _member_forward(layer: nn.Module, lora: list[Any], params: dict[str, Tensor],
                        buffers: dict[str, Tensor], scaling: Tensor | None, x: Tensor,
                        noises: list[Tensor] | None) -> Tensor:
        """One member's layer: its tensors, LoRA scaling and dropout noise (recorded if None)."""
        replay = DropoutReplay(noises) if noises else contextlib.nullcontext()
        scaled = (lora_scaling(lora, scaling) if lora and scaling is not None
                  else contextlib.nullcontext())
        with replay, scaled:
            out = functional_call(layer, (params, buffers), (x,), strict=True)
        assert isinstance(out, Tensor)
        return out

    def probe_dropout(self, tensors: dict[str, Tensor], scaling: Tensor | None,
                      batch_size: int, block_size: int) -> list[list[NoiseSite]]:
        """The dropout draws of each layer in one training forward of one member.

        Runs the template's layers on the host without grad on zeros input; draws nothing.
        Adapter dropout sites (the padded adapter's, present when any member drops) are marked,
        so each member draws them with its own ``peft.dropout``.

        Args:
            tensors: One member's (unstacked) parameters and buffers by canonical name.
            scaling: Its LoRA scaling (``None`` without an adapter).
            batch_size: B.
            block_size: T.

        Returns:
            Per layer, its dropout sites in forward order.

        Raises:
            ValueError: The forward draws random numbers other than dropout, or a dropout
                draw has no leading batch dimension (microbatches could not
                slice it).
        """
        sites: list[list[NoiseSite]] = []
        hidden = torch.zeros(batch_size, block_size, dtype=torch.long)
        recorder = DropoutReplay(None)
        detector = SeededOpDetector()
        lora = [layer for layers in self._lora for layer in layers]
        self.template.train()
        with torch.no_grad(), recorder, detector, marking_adapter_dropout(lora, recorder):
            for index, layer in enumerate(self.layers):
                names = self._names[index]
                first = len(recorder.sites)
                hidden = self._member_forward(
                    layer, self._lora[index],
                    {local: tensors[name] for local, name in names.params.items()},
                    {local: tensors[name] for local, name in names.buffers.items()},
                    scaling, hidden, None)
                sites.append(recorder.sites[first:])
        if detector.ops:
            raise ValueError(
                f"the model cannot fuse: its forward draws random numbers outside dropout "
                f"({', '.join(sorted(detector.ops))}), which a fused array cannot reproduce "
                "per member"
            )
        for layer_sites, name in zip(sites, self.names, strict=True):
            for site in layer_sites:
                if not site.shape or site.shape[0] != batch_size:
                    raise ValueError(
                        f"layer {name!r} draws dropout of shape {site.shape} without a leading "
                        f"batch dimension of {batch_size}; a spilled fused array cannot slice it"
                    )
        return sites
