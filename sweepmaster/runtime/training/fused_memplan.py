"""mu-TWO's memory plan of a fused array's stacked shards, from a trace of its vmapped layers.

A spilled fused array (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`) keeps,
swaps or recomputes its activations layer by layer like a single spilled job; its plan
(:func:`plan_stacked_memory`) is made by the planner every job shares
(:func:`~sweepmaster.runtime.planning.memplan.plan_memory`), over K stacked members' layers traced
as the array runs them: ``vmap`` over members, each layer making its pre-drawn dropout noise
``(K, b, ...)``.

Shape legend: K members, b microbatch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory
from sweepmaster.runtime.planning.memprofile import TracedLayers
from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.planning.profile import ModelProfile, profile_model
from sweepmaster.runtime.training.fused_shards import (
    StackedLayers,
    dropout_noise_bytes,
    members_losses,
    stacked_profile,
)
from sweepmaster.runtime.training.layers import LayerStack
from sweepmaster.runtime.training.member_dropout import NoiseSite
from sweepmaster.workload.spec import TrainSpec

__all__ = ["plan_stacked_memory"]


def plan_stacked_memory(
    spec: TrainSpec,
    num_members: int,
    plan: JobPlan,
    *,
    device: Device | None = None,
    profile: ModelProfile | None = None,
    bandwidth: float | None = None,
    budget_bytes: int | None = None,
    decisions: Sequence[Sequence[LayerDecision]] | None = None,
) -> MemoryPlan:
    """mu-TWO's keep / swap / recompute plan of a spilled fused array's stacked shards.

    Planned like a single spilled job's
    (:func:`~sweepmaster.runtime.planning.memplan.plan_memory`, Purandare et al. MLSys 2023):
    the activations are traced on K members' stacked layers as the array runs them (``vmap``
    over members, each layer making its pre-drawn dropout noise ``(K, b, ...)``), under
    ``FakeTensorMode`` (on a GPU: a pilot pass), so each layer's slots and bytes are those the
    array's passes save; seconds and the update's bytes come from the stacked profile (K times
    one member's, :func:`~sweepmaster.runtime.training.fused_shards.stacked_profile`).

    The plan is for K members and bounds the array while fewer train (each of its bytes and
    seconds scales with K).

    Args:
        spec: The member the stacked plan was made for
            (:func:`~sweepmaster.runtime.training.fused_shards.stacked_spec` of the members).
        num_members: K of the stacked plan.
        plan: The stacked plan
            (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked`).
        device: The device (its bandwidth is measured once per process); default the host.
        profile: One member's layer profile at the plan's microbatch size (default
            ``profile_model``).
        bandwidth: Host <-> device copy bandwidth (bytes/s); default measured on ``device``.
        budget_bytes: The budget; default the plan's.
        decisions: Given decisions (per shard, per layer) to cost instead of planning.

    Returns:
        The memory plan, for :class:`SpilledFusedJob` ``(memory_plan=...)``.

    Raises:
        MemoryPlanError: A stacked shard does not fit the budget whatever is swapped or
            recomputed (or with the given ``decisions``).
    """
    one = profile if profile is not None else profile_model(spec, plan.microbatch_size,
                                                            device=device)
    stacked = stacked_profile(one, num_members, dropout_noise_bytes(spec))
    layers = TracedLayers(functools.partial(_traced_stack, spec, num_members), (num_members,),
                          _members_loss)
    return plan_memory(spec, plan, device=device, profile=stacked, bandwidth=bandwidth,
                       budget_bytes=budget_bytes, decisions=decisions, layers=layers)


def _members_loss(logits_K: Tensor, ids_K: Tensor) -> Tensor:
    """The sum of every member's loss (what a last stacked shard backpropagates)."""
    return members_losses(logits_K, ids_K).sum()


def _traced_stack(spec: TrainSpec, num_members: int, fake_mode: Any) -> LayerStack:
    """K stacked members' layers as modules to trace (fake tensors, or zeros on the host)."""
    layers = StackedLayers(spec)
    layers.train(True)
    named = dict(layers.template.named_parameters())
    buffers = dict(layers.template.named_buffers())
    block_size = int(spec.train_data.shape[1])
    mode = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with mode:
        tensors = {name: torch.zeros((num_members, *named[name].shape), dtype=named[name].dtype)
                   for name in layers.param_names}
        tensors |= {name: torch.zeros(named[name].shape, dtype=named[name].dtype)
                    for name in layers.frozen_names}
        tensors |= {name: torch.zeros((num_members, *b.shape), dtype=b.dtype)
                    for name, b in buffers.items()}
        one = {name: t if name in layers.frozen_names else t[0] for name, t in tensors.items()}
        scaling = torch.ones(()) if layers.adapted else None
        sites = layers.probe_dropout(one, scaling, 1, block_size)
    traced = tuple(_TracedLayer(layers, index, tensors, sites[index], num_members)
                   for index in range(len(layers)))
    return LayerStack(nn.ModuleList(traced), traced, layers.names)


class _TracedLayer(nn.Module):
    """One stacked layer to trace: its members' tensors; it makes its noise as the array does.

    Inputs and outputs ``(K, b, ...)``; the noise of each dropout site is made inside the
    layer, ``(K, b, ...)``, as the array's layer passes unpack it
    (:meth:`~sweepmaster.runtime.training.fused_spill.FusedMembers._stacked_layer`).
    """

    def __init__(self, layers: StackedLayers, index: int, tensors: dict[str, Tensor],
                 sites: Sequence[NoiseSite], num_members: int) -> None:
        super().__init__()
        self.stacked = layers
        self.index = index
        self.num_members = num_members
        self.noise_shapes = [(tuple(site.shape[1:]), site.dtype) for site in sites]
        self.locals: dict[str, str] = {}
        trainable = set(layers.param_names)
        for name in (*layers.layer_params(index), *layers.layer_buffers(index)):
            local = name.replace(".", "__")
            self.locals[name] = local
            if name in trainable or name in layers.frozen_names:
                self.register_parameter(local, nn.Parameter(tensors[name], name in trainable))
            else:
                self.register_buffer(local, tensors[name])

    def extra_repr(self) -> str:
        """The template layer, its noise and K: what makes two traces equal."""
        return (f"{self.stacked.layers[self.index]!r}, noise={self.noise_shapes}, "
                f"members={self.num_members}")

    def forward(self, x_K: Tensor) -> Tensor:
        """The stacked layer on ``x_K`` ``(K, b, ...)``."""
        tensors = {name: getattr(self, local) for name, local in self.locals.items()}
        num_rows = int(x_K.shape[1])
        noises = [torch.ones((self.num_members, num_rows, *shape), dtype=dtype,
                             device=x_K.device) for shape, dtype in self.noise_shapes]
        scaling_K = (torch.ones(self.num_members, device=x_K.device) if self.stacked.adapted
                     else None)
        return self.stacked.forward(self.index, tensors, x_K, noises, scaling_K)
