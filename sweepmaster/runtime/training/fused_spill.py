"""Fused arrays: K same-architecture trials trained as one job of stacked-shard tasks.

Horizontal fusion: HFTA (Wang et al., MLSys 2021, https://arxiv.org/abs/2102.02344) and mu-TWO
(Purandare et al., MLSys 2023, https://arxiv.org/abs/2301.09313) train K models that share an
architecture as one array: every trainable parameter is stacked to ``(K, ...)`` and one vmapped
forward / backward runs the K models as K-times-larger kernels. Here that is ``torch.func``: the
members are built like :func:`~sweepmaster.runtime.training.plain.train_plain` builds them (seed,
then init; :mod:`~sweepmaster.runtime.training.members`), stacked, and run layer by layer through
a parameterless template (built under ``torch.device("meta")``) with ``functional_call`` inside
``vmap`` (:class:`~sweepmaster.runtime.training.fused_shards.StackedLayers`). A fused optimizer
(:mod:`~sweepmaster.runtime.training.fused_optim`) updates each member with its own
hyperparameters. How many members to fuse is
:mod:`~sweepmaster.runtime.planning.fusion_degree`'s question.

:class:`SpilledFusedJob` is the one fused trainer. An array that fits its device is one stacked
shard holding the whole array (S = 1,
:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked` with ``whole=True``: one task per
step, kept resident between its tasks); an array whose stacked parameters do not fit is cut into
**stacked shards** (planned for K x one member's working set) and spills (Hydra, Nagrecha &
Kumar 2022), trained with Hydra's task chain exactly as :mod:`~sweepmaster.runtime.training.spill`
trains one job:

* ``forward`` of shard ``i < S-1``: promote the K members' parameters of the shard, run it
  without grad over every microbatch (``vmap`` over members), demote the boundary activations
  ``(K, B, ...)`` to the host;
* ``backward`` of shard ``S-1`` (jit-compute): forward, each member's loss, backward of their sum;
* ``backward`` of shard ``i < S-1``: promote, recompute the forward from the boundary input,
  backpropagate the boundary gradient, then update the shard's owned parameters with the fused
  optimizer (:mod:`~sweepmaster.runtime.training.fused_optim`, per-member hyperparameters) while it
  is resident (Harmony's just-in-time update), its state promoted and demoted with it.

Parameters, optimizer state and boundaries live on the host between tasks (pinned on CUDA),
but for a shard kept resident for its next task (``run(keep=True)``): an array of one stacked
shard keeps its weights, and its optimizer state while a next step's task follows, on its device
(as :class:`~sweepmaster.runtime.training.spill.SpilledJob` does). Every promotion is a device
allocation the device's meter counts, every copy is counted in ``swap_bytes`` (none on the
host CPU, whose transfers are in place:
:attr:`~sweepmaster.runtime.devices.transfer.TransferEngine.in_place`). The next stacked shard
of the same step is promoted in the background while the current one computes when both fit
the budget (Hydra's double buffering). Activations inside a shard are recomputed (Hydra's full
recompute), or, with a memory plan
(:func:`~sweepmaster.runtime.training.fused_memplan.plan_stacked_memory`: mu-TWO's keep / swap /
recompute plan of the stacked shards, planned like a single spilled job's from a trace of the
vmapped stacked layers), kept, swapped or recomputed layer by layer by the planned passes
every spilled job shares (:meth:`~sweepmaster.runtime.training.planned.PlannedPasses.\
_forward_planned`,
:mod:`~sweepmaster.runtime.training.layerpass`): a layer's saved activations are the physical
``(K, ...)`` tensors autograd saves under ``vmap``. The stacked parameters are the same leaf
tensors in every task (each promote installs its device copies as their data, each demote
puts an empty tensor back, as :class:`~sweepmaster.runtime.training.spill.SpilledJob` does with
its parameters), so a graph kept from a forward task to its backward task names the backward
task's copies and leaves their gradients there. The plan is made for the stacked plan's K and
bounds the array while fewer members train (every byte it counts scales with K); a joiner
never takes it past K.
Evaluation passes are ``eval`` forward tasks of every shard, as in
:mod:`~sweepmaster.runtime.training.spill`. The task chain, prefetch, residency cache and host
boundaries are the parts of the one trainer every spilled job is
(:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`): a stacked shard whose next
task runs on the same device stays resident there.

Exactness (docs/design.md, "Fused arrays"): each member ends with the weights of its plain
training.

* Init, data order (``minibatch_indices`` with the member's seed), learning-rate schedule
  (``lr_factor`` per member), loss (``causal_lm_loss`` in float32), clipping (the member's own
  global norm) and evaluation are plain's, per member (members built as alone:
  :func:`~sweepmaster.runtime.training.members.load_member`). Gradients over microbatches are
  weighted like :mod:`~sweepmaster.runtime.training.spill` weights them. Without dropout a
  member's loss and gradients equal separate training up to float rounding of batched kernels,
  so its weights match plain training (SGD allclose 1e-6; AdamW within an lr-scaled tolerance:
  Adam's normalisation amplifies 1e-7 differences where a gradient is rounding noise).
* Dropout is per member and not drawn by ``vmap``: at the start of each step every dropout draw of
  the whole forward is drawn from each member's own generator in plain's order and shape
  (:class:`~sweepmaster.runtime.training.member_dropout.DropoutReplay` noise, as a fused array
  draws it), keeping each member's generator state before each draw
  (:func:`~sweepmaster.runtime.training.fused_noise.draw_states`), and each layer pass draws its
  microbatch's rows of the noise again on the device from those states
  (:func:`~sweepmaster.runtime.training.fused_noise.member_noises`): no mask leaves the device.
  The backward's recompute (of a shard, or of a layer a memory plan recomputes) draws the same
  noise, so recompute never changes a mask; a swapped or kept noise is the drawn one. At a LoRA
  adapter's dropout each member drops with its own ``peft.dropout`` (its noise is ones when that
  is 0, as PEFT's ``nn.Identity`` draws nothing). A probe forward finds every draw
  (:class:`~sweepmaster.runtime.training.member_dropout.DropoutReplay`, the dropout of
  ``F.scaled_dot_product_attention`` included, then computed as ATen's math attention); any other
  random op in the model refuses to fuse. On the CPU a member with dropout therefore equals its
  plain training, independently of the other members and of members leaving. On CUDA, plain dropout
  uses fused Philox kernels this cannot replay: members draw independent streams from per-member
  CUDA generators seeded with their seeds, but do not equal plain training.
* LoRA (multi-LoRA training over one shared frozen base: mLoRA / ASPEN, VLDB 2025; LoRAFusion):
  members sharing one :func:`~sweepmaster.workload.architecture.fusion_key` may differ in rank,
  alpha, dropout and learning rate. The frozen base is held on the host once (``frozen``, from
  the first member; the others' are checked equal and dropped as they are built), promoted once
  per shard task for all K members, never demoted (it never changes) and never given gradients
  or optimizer state; the adapters are stacked ``(K, ...)`` and zero-padded to the largest rank
  R: member k's ``A`` ``(r_k, in)`` and ``B`` ``(out, r_k)`` padded give ``B_pad A_pad = B A``,
  and the padded rows of ``A`` and columns of ``B`` get exactly zero gradient (each is a product
  with the other's zero padding), so AdamW (weight decay included) and SGD keep them exactly
  zero. Each member's scaling ``alpha_k / r_k`` replaces PEFT's per-layer scaling inside the
  vmapped forward. A member leaves with its unpadded adapter (saved in PEFT's format). Members of
  one base (source, dtype, seed) build it once
  (:class:`~sweepmaster.runtime.training.members.SharedBases`: every member's adapter is drawn
  from the host generator's state after the base's init, over a copy sharing the base's tensors,
  which is exactly what building the member alone gives); a member of another base (a pretrained
  one, another seed) is built whole and its frozen weights checked equal to the array's and
  dropped. On the CPU the array keeps its base, so a joining member of the same base builds only
  its adapter. A first shard that trains nothing (the base's embeddings) skips its backward's
  recompute.
* Tied weights (GPT-2 ``wte`` / ``lm_head``): a tied parameter is stacked once (the template's
  tie intact); the first shard using it owns it; later shards send their gradient contribution to
  the host and the owner adds it before its update, so it gets both contributions and one update.
* ``grad_clip`` (each member's own ``clip_grad_norm_``):
  :mod:`~sweepmaster.runtime.training.spill`'s deferred clipped update, per member. Backward tasks
  of shards ``i > 0`` keep their owned gradients ``(K, ...)`` on the host with each member's
  per-tensor norms ``(K,)``; shard 0, the last backward of the step, combines them into each
  member's global norm ``(K,)``
  (:func:`~sweepmaster.runtime.training.fused_optim.member_grad_norms`,
  :func:`~sweepmaster.runtime.training.fused_optim.clip_coefficients`) and updates at once; every
  other shard applies its clipped update the next time it is promoted: the next step, an
  evaluation, or ``update`` tasks after a step after which a member leaves or checkpoints without
  evaluating (:func:`~sweepmaster.runtime.training.tasks.after_step_phase`, the one rule).

Members resume from their own checkpoints, checkpoint, leave the array (unfuse) and join it
(refill) at step boundaries, each ending with the weights of training it alone: the array's
members part is :class:`FusedMembers` (its stacked layers, noise, losses and fused optimizers'
steps), holding a :class:`~sweepmaster.runtime.training.fused_members.StackedMembers` as its
``stacked`` part (stacking, a member's views, members changing: read there, e.g.
``job.members.stacked.join``); :class:`SpilledFusedJob` is the trainer over it.

Pipelined (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP): the
array's steps may run over several devices, its stacked shards in packs, through the parts of
:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer` (a pack's tensors are
installed by name; its passes, clipped updates and optimizer states are the shard tasks'), with
the numbers of its shard tasks. Its members stay the same during a pipelined step: the packs go
home at a step boundary where a member leaves, may join or checkpoints.

Shape legend: K members, B batch, b microbatch, T tokens per block, V vocabulary, M eval blocks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import metering
from sweepmaster.runtime.training.fused_members import StackedMembers
from sweepmaster.runtime.training.fused_noise import draw_states, member_noises
from sweepmaster.runtime.training.fused_optim import clip_coefficients, member_grad_norms
from sweepmaster.runtime.training.fused_shards import members_losses
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.member_dropout import NoiseSite
from sweepmaster.runtime.training.member_runs import MemberEndHook, MemberRun, RefillHook
from sweepmaster.runtime.training.plain import lr_factor
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.shard_trainer import ShardTrainer
from sweepmaster.runtime.training.tasks import ShardTask, StateSlot, TensorKey
from sweepmaster.runtime.training.training_state import TrainingState
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["FusedMembers", "SpilledFusedJob", "train_fused_spilled"]

_CPU = torch.device("cpu")


class _Drawn:
    """A fused array's planned pass mode: its dropout noise is drawn, no random op runs."""

    site = 0


_DRAWN = _Drawn()


class FusedMembers:
    """K stacked members run under ``vmap``: the members part of a :class:`SpilledFusedJob`.

    What the job's parts read of the members
    (:class:`~sweepmaster.runtime.training.shard_members.ShardMembers`): the stacked tensors
    by name (leaf tensors whose data is the installed copy, else empty), the stacked layers run
    through the template with each member's dropout noise drawn at the step's start, each
    member's loss ``(K,)``, the fused optimizers, the members' clip coefficients ``(K,)``. The
    members themselves (their stacked host tensors, a member's views, joins and leaves) are the
    part it holds, :attr:`stacked`
    (:class:`~sweepmaster.runtime.training.fused_members.StackedMembers`): callers read them
    there (``job.members.stacked.join``). Arguments and errors: :class:`SpilledFusedJob`'s, but
    for the memory plan, which is the trainer's.

    Attributes:
        stacked: The stacked members.
    """

    fail_alone = True  # a member's failure fails it alone
    row_dim = 1  # token ids and host boundaries are (K, B, ...)
    prefetches_within_step = True  # members leave the array between steps

    def __init__(self, specs: Sequence[TrainSpec], plan: JobPlan,
                 callbacks: Sequence[TrainCallbacks | None] | None,
                 on_member_end: MemberEndHook | None, refill: RefillHook | None,
                 planned: TrainSpec | None) -> None:
        self.stacked = stacked = StackedMembers(list(specs), plan, callbacks,
                                                on_member_end=on_member_end, refill=refill,
                                                planned=planned)
        self.plan = plan
        self.device_type = stacked.device_type  # of the job's devices: ``cpu`` or ``cuda``
        self.layers = stacked.layers
        self.epochs: list[int] = []
        self.lrs: list[float] = []
        first = stacked.runs[0].spec
        #: per layer, its dropout sites (in one member's training forward)
        self._sites: list[list[NoiseSite]] = self.layers.probe_dropout(
            {**{n: p[0] for n, p in stacked.params.items()}, **stacked.frozen,
             **{n: b[0] for n, b in stacked.buffers.items()}},
            stacked.scaling_K[0] if self.layers.adapted else None,
            first.batch_size, int(first.train_data.shape[1]),
        )
        # step state, on the host: ids (K, B, T), per layer its dropout draws, boundaries
        self._ids_KBT = torch.empty(0)
        #: per layer, per dropout site: each live member's generator state before its draw
        self._noise_states: list[list[list[Tensor]]] = []
        # (device, thread) -> the generator noise is drawn again on (a pipeline's packs run
        # on several threads at once)
        self._scratch: dict[tuple[str, int], torch.Generator] = {}
        self._targets_KBT: Tensor | None = None  # with a loss mask: the step's labels
        #: name -> the leaf tensor every task and pipeline pack computes with (its data: the
        #: installed copy, else empty); a trainable one gets gradients
        self._leaves: dict[TensorKey, Tensor] = {
            name: torch.empty(0).requires_grad_(name in stacked.params)
            for name in (*stacked.params, *stacked.frozen, *stacked.buffers)}

    def bind(self, job: ShardTrainer) -> None:  # noqa: D102
        self.job = job
        self.stacked.bind(job)

    # ------------------------------------------------------------------ the members (stacked)

    @property
    def runs(self) -> list[MemberRun]:  # noqa: D102
        return self.stacked.runs

    @property
    def live(self) -> list[MemberRun]:  # noqa: D102
        return self.stacked.live

    @property
    def fresh_shards(self) -> set[int]:  # noqa: D102
        return self.stacked.fresh_shards

    @property
    def step(self) -> int:  # noqa: D102
        return self.stacked.step

    def evaluates_after(self, step: int) -> bool:  # noqa: D102
        return self.stacked.evaluates_after(step)

    def settles_after(self, step: int) -> bool:  # noqa: D102
        return self.stacked.settles_after(step)

    def evaluated(self, run: MemberRun) -> bool:  # noqa: D102
        return self.stacked.evaluated(run)

    def members_change(self) -> bool:  # noqa: D102
        return self.stacked.members_change()

    def at_step_boundary(self) -> None:  # noqa: D102
        self.stacked.at_step_boundary()

    def member_state_dict(self, index: int) -> dict[str, Tensor]:  # noqa: D102
        return self.stacked.member_state_dict(index)

    def member_module(self, index: int) -> nn.Module:  # noqa: D102
        return self.stacked.member_module(index)

    def member_training_state(self, index: int) -> TrainingState:  # noqa: D102
        return self.stacked.member_training_state(index)

    # ------------------------------------------------------------------ task API

    @property
    def stopped(self) -> bool:
        """Whether every member has left the array."""
        return not self.live

    @property
    def num_steps(self) -> int:
        """Steps the array trains in this run: until the last of its members ends."""
        stacked = self.stacked
        return max((stacked.joined_step[run.index] + run.spec.total_steps
                    - stacked.resumed_from_step[run.index] for run in self.live),
                   default=self.step)

    def settle(self, device: Device) -> None:
        """Hand on the members that have nothing left to train (resumed at their last step).

        A run of the array whose every member resumed at its ``total_steps`` has no task; call this
        once the trainer's ``next_task`` is ``None`` so that they leave with their results.
        """
        if self.live:
            if not self.job.bookkeeping.started:
                self.job.bookkeeping.start_runs(device)
            self.stacked.retire()

    # ------------------------------------------------------------------ compute

    def start_step(self, device: Device) -> None:
        """Draw each member's minibatch and every dropout noise of the step (its states)."""
        self.epochs, rows, indices = [], [], []
        for batches, run in zip(self.stacked.batches, self.live, strict=True):
            epoch, index_B = next(batches)
            self.epochs.append(epoch)
            rows.append(run.spec.train_data[index_B])
            indices.append(index_B)
        self._ids_KBT = torch.stack(rows)
        self._targets_KBT = None if all(run.spec.train_mask is None for run in self.live) else \
            torch.stack([run.spec.train_targets[index] for run, index in zip(
                self.live, indices, strict=True)])
        self.lrs = [
            run.spec.optimizer.lr * lr_factor(run.step, run.spec.optimizer, run.spec.total_steps)
            for run in self.live
        ]
        specs = [run.spec for run in self.live]
        self._noise_states = [[draw_states(site, specs, self.stacked.generators) for site in sites]
                              for sites in self._sites]
        self.job.passes.clear_losses()

    def _run_layers(self, shard: int, resident: Mapping[TensorKey, Tensor], x_K: Tensor,
                    rows: slice | None, device: Device) -> Tensor:
        plan = self.plan.shards[shard]
        scaling_K = self._scalings(shard, device)
        for layer in range(plan.start, plan.stop):
            x_K = self._stacked_layer(layer, resident, rows, device, scaling_K, x_K)
        return x_K

    def _scalings(self, shard: int, device: Device) -> Tensor | None:
        """The members' LoRA scalings ``(K,)`` promoted to ``device`` for a pass of ``shard``.

        ``None`` (nothing promoted) for a shard without adapter layers (a LoRA base's
        embeddings or head) or members without adapters: as the plan's ``scaling_bytes``
        counts them.
        """
        plan = self.plan.shards[shard]
        if not any(self.layers.has_adapter(layer) for layer in range(plan.start, plan.stop)):
            return None
        return self.job.boundaries.to_device(device, self.stacked.scaling_K)

    def _stacked_layer(self, layer: int, resident: Mapping[TensorKey, Tensor], rows: slice | None,
                       device: Device, scaling_K: Tensor | None, x_K: Tensor) -> Tensor:
        """Layer ``layer`` of every member on ``x_K`` ``(K, b, ...)``: ``(K, b, ...)``.

        With the dropout noise of the step's rows ``rows`` (drawn again here from the members'
        states, so a recompute makes it again), or none (``None``: evaluation).
        """
        noises = []
        if rows is not None:
            specs = [run.spec for run in self.live]
            generator = self._scratch_generator(device)
            noises = [member_noises(site, specs, states, rows, generator)
                      for site, states in zip(self._sites[layer], self._noise_states[layer],
                                              strict=True)]
        tensors = cast(dict[str, Tensor], resident)  # by canonical name
        return self.layers.forward(layer, tensors, x_K, noises, scaling_K)

    def _scratch_generator(self, device: Device) -> torch.Generator:
        """The calling thread's generator the members' noise is drawn again on, for ``device``.

        The members' generators are of the job's device type (:attr:`device_type`): a virtual
        device's are the CPU's.
        """
        where = device.torch_device if self.device_type == "cuda" else _CPU
        key = (str(where), threading.get_ident())
        with self.job.boundaries.counter_lock:
            generator = self._scratch.get(key)
            if generator is None:
                generator = self._scratch[key] = torch.Generator(where)
        return generator

    # ------------------------------------------------------------------ memory plan

    def labels(self) -> Tensor:  # noqa: D102
        return self._ids_KBT

    def layer_calls(self, shard: int, rows: slice,
                     device: Device) -> tuple[list[Layer], list[list[Tensor]]]:
        """The stacked layers of ``shard`` over the leaves, each making its noise for ``rows``."""
        self.layers.train(True)
        plan = self.plan.shards[shard]
        scaling_K = self._scalings(shard, device)
        leaves = self._leaves
        calls: list[Layer] = []
        residents: list[list[Tensor]] = []
        for layer in range(plan.start, plan.stop):
            calls.append(functools.partial(self._stacked_layer, layer, leaves, rows, device,
                                           scaling_K))
            names = [*self.layers.layer_params(layer), *self.layers.layer_buffers(layer)]
            residents.append([leaves[name] for name in names])
        return calls, residents

    def task_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """Nothing: the step's dropout noise is drawn at its start."""
        return contextlib.nullcontext()  # the step's dropout noise is drawn at its start

    def compute_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """The device's metering (the stacked layers' passes record nothing)."""
        return metering(device)

    def pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
                   site: int = 0, rng: JobRng | None = None,
                   ) -> contextlib.AbstractContextManager[Any]:
        """Nothing to record or replay: the step's dropout noise is drawn already."""
        return contextlib.nullcontext(_DRAWN)

    def task_tensors(self) -> Mapping[TensorKey, Tensor]:
        """The leaves by name (:attr:`_leaves`): installed copies are their data."""
        return self._leaves

    def idle_data(self, host: Tensor) -> Tensor:
        """An empty tensor: the stacked host copies live in :attr:`params` and the others."""
        del host
        return torch.empty(0)

    def run_shard(self, shard: int, tensors: Mapping[TensorKey, Tensor], x: Tensor,
                   rows: slice | None, device: Device,
                   overrides: Mapping[TensorKey, Tensor] | None = None) -> Tensor:
        """The stacked shard on ``x`` ``(K, b, ...)``: training with the noise of ``rows``."""
        self.layers.train(rows is not None)
        resident = {**tensors, **overrides} if overrides else tensors
        return self._run_layers(shard, resident, x, rows, device)

    def norms_of(self, grads: list[Tensor]) -> list[Tensor]:  # noqa: D102
        return member_grad_norms(grads)

    def schedule(self) -> list[float]:  # noqa: D102
        return list(self.lrs)

    def lm_loss(self, logits: Tensor, ids: Tensor) -> Tensor:  # noqa: D102
        return members_losses(logits, ids)

    def update(self, shard: int, tensors: Mapping[TensorKey, Tensor], lrs: list[float],
                device: Device, clip_coef_K: Tensor | None = None) -> None:
        """The fused optimizer's step of the shard's owned parameters at each member's lr.

        Its state is on ``device`` already. ``clip_coef_K``: each member's clip coefficient
        ``(K,)`` on ``device``, multiplied into its gradients first.
        """
        optimizer = self.stacked.optimizers[shard]
        assert optimizer is not None
        params = [tensors[name] for name in self.stacked.owned[shard]]
        if clip_coef_K is not None:
            with torch.no_grad():
                for param in params:
                    assert param.grad is not None
                    param.grad.mul_(clip_coef_K.view((-1,) + (1,) * (param.dim() - 1)))
            del clip_coef_K
        optimizer._device = device.torch_device
        try:
            optimizer.step(params, lrs)
        finally:
            optimizer._device = _CPU
            for param in params:
                param.grad = None

    def dropout_stream(self, state: Tensor | None) -> JobRng | None:
        """None: the step's dropout noise is drawn at its start (:meth:`start_step`)."""
        del state
        return None

    def set_dropout_state(self, state: Tensor) -> None:
        """Nothing: the members' generators moved when the step's noise was drawn."""
        del state

    def eval_guard(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """Nothing: an evaluation draws no noise."""
        del device
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def dropout_off(self, shard: int | None) -> Iterator[None]:  # noqa: D102
        del shard  # the stacked layers are one module
        self.layers.train(False)
        try:
            yield
        finally:
            self.layers.train(True)

    # ------------------------------------------------------------------ per-shard interface
    # (a pipeline's packs: training/pipelined.py; their tensors are installed by name)

    @property
    def name(self) -> str:  # noqa: D102
        return self.runs[0].spec.name

    @property
    def clips(self) -> bool:  # noqa: D102
        return self.stacked.clipping

    def after_start(self, task: ShardTask) -> None:
        """Before a training task (no evaluation first), members done already leave now."""
        if task.phase != "eval":
            self.stacked.retire()

    def step_ids(self) -> Tensor:  # noqa: D102
        return self._ids_KBT

    def step_targets(self) -> Tensor | None:  # noqa: D102
        return self._targets_KBT


    def shard_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return [*self.stacked.shard_params[shard], *self.stacked.shard_frozen[shard],
                *self.stacked.shard_buffers[shard]]

    def owned_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return list(self.stacked.owned[shard])

    def trainable(self, key: TensorKey) -> bool:  # noqa: D102
        return key in self.stacked.params

    def host_tensor(self, key: TensorKey) -> Tensor:  # noqa: D102
        assert isinstance(key, str)
        for tensors in (self.stacked.params, self.stacked.frozen, self.stacked.buffers):
            if key in tensors:
                return tensors[key]
        raise KeyError(key)

    def updates(self, shard: int) -> bool:
        """Whether ``shard`` owns parameters to update (it has a fused optimizer)."""
        return self.stacked.optimizers[shard] is not None

    def state_slots(self, shard: int) -> list[StateSlot]:
        """Every state tensor of the shard's fused optimizer, per stacked parameter."""
        optimizer = self.stacked.optimizers[shard]
        assert optimizer is not None
        return [(state, key) for state in optimizer.state for key in state]

    def clip_coefficient(self, norms: Mapping[TensorKey, Tensor],  # noqa: D102
                         device: Device) -> Tensor:
        del device
        ordered = [norms[n] for n in self.layers.param_names if n in norms]
        total_norm_K = torch.linalg.vector_norm(torch.stack(ordered), dim=0)
        return clip_coefficients(total_norm_K,
                                 [run.spec.optimizer.grad_clip for run in self.live])

    def eval_ids(self) -> Tensor:  # noqa: D102
        blocks = [run.eval_data for run in self.live]
        return torch.stack([b for b in blocks if b is not None])

    def eval_targets(self) -> Tensor | None:  # noqa: D102
        if all(run.spec.eval_mask is None for run in self.live):
            return None
        targets = [run.eval_targets for run in self.live]
        return torch.stack([t for t in targets if t is not None])

    # ------------------------------------------------------------------ bookkeeping

    def step_done(self) -> None:
        """The array's step count goes on; the step's noise states are spent."""
        self.stacked.step_done()
        self._noise_states = []


class SpilledFusedJob(ShardTrainer):
    """K same-architecture members trained by stacked-shard tasks (module doc); one at a time.

    The trainer (:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`) over K
    stacked members (:class:`FusedMembers`, its ``members``); the task API is
    :class:`~sweepmaster.runtime.training.spill.SpilledJob`'s: ``next_task``, ``peek_task``,
    ``run``. Members report through their own callbacks and leave the
    array through ``on_member_end`` with their :class:`~sweepmaster.workload.spec.TrainResult`
    (``swap_bytes``, ``p2p_bytes``, promote / demote counts and ``peak_device_bytes`` are the
    array's so far).
    Members with ``state_dir`` resume from their checkpoints when the array is built (module
    doc); when every member resumed at its end there is no task, and ``settle`` hands them
    on.

    Example:
        >>> plan = plan_stacked(specs[0], len(specs), device)  # doctest: +SKIP
        >>> job = SpilledFusedJob(specs, plan)  # doctest: +SKIP
        >>> while (task := job.next_task()) is not None:  # doctest: +SKIP
        ...     job.run(task, device)

    Args:
        specs: The members, sharing one
            :func:`~sweepmaster.workload.architecture.fusion_group_key`.
        plan: The stacked plan (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked` for
            ``len(specs)`` members); its device's type (``cpu`` or ``cuda``) is where tasks run.
        callbacks: One progress receiver (or ``None``) per member.
        on_member_end: Called when a member leaves: ``(index, result, error)``, the index in
            ``specs``, then ``len(specs)`` onwards for members offered by ``refill`` in order.
        refill: Asked at a step boundary where members have left the array for members to
            join it (:data:`~sweepmaster.runtime.training.member_runs.RefillHook`; see
            :meth:`~sweepmaster.runtime.training.fused_members.StackedMembers.join`, of the
            members' ``stacked`` part, which each offered member goes through: one that cannot
            join fails alone). Not asked while a clipped update is deferred: at the next
            boundary after an evaluation or a member's end.
        planned: The member the plan was made for, as wide as any member and any joiner it
            should take (a LoRA rank, adapter dropout, SGD momentum); default
            :func:`stacked_spec` of ``specs``. The stacked tensors are padded to it.
        memory_plan: Keep / swap / recompute of the stacked shards' activations
            (:func:`~sweepmaster.runtime.training.fused_memplan.plan_stacked_memory` for
            ``plan``); ``None``: Hydra's full recompute. With a plan, a backward task on CUDA
            must run on the GPU that ran the shard's forward task; elsewhere it falls back to
            recomputing that shard.

    Raises:
        ValueError: Members that cannot fuse (LoRA members: whose frozen bases differ),
            members whose evaluation blocks differ in shape (or only some evaluate), an invalid
            spec, a plan for another model (or made without ``grad_clip`` for clipping
            members), a memory plan for another plan, or a callback list of another length.
    """

    members: FusedMembers

    def __init__(
        self,
        specs: Sequence[TrainSpec],
        plan: JobPlan,
        callbacks: Sequence[TrainCallbacks | None] | None = None,
        *,
        on_member_end: MemberEndHook | None = None,
        refill: RefillHook | None = None,
        planned: TrainSpec | None = None,
        memory_plan: MemoryPlan | None = None,
    ) -> None:
        members = FusedMembers(specs, plan, callbacks, on_member_end, refill, planned)
        super().__init__(plan, members.runs[0].spec.batch_size, memory_plan, members)


def train_fused_spilled(
    specs: Sequence[TrainSpec],
    device: Device,
    plan: JobPlan,
    callbacks: Sequence[TrainCallbacks | None] | None = None,
    *,
    prefetch: bool = True,
    on_member_end: MemberEndHook | None = None,
    refill: RefillHook | None = None,
    memory_plan: MemoryPlan | None = None,
) -> list[TrainResult | None]:
    """Train K members as one spilled fused array on one device, its tasks in order.

    With a plan of one stacked shard holding the whole array
    (:func:`~sweepmaster.runtime.training.fused_shards.plan_stacked` with ``whole=True``), this
    is the job the executor trains for an array that fits its device (S = 1: nothing spills).

    Args:
        specs: The members (see :class:`SpilledFusedJob`).
        device: Where the tasks run.
        plan: The stacked plan for ``len(specs)`` members on ``device``.
        callbacks: One progress receiver (or ``None``) per member.
        prefetch: Double-buffer: promote the next stacked shard while the current one computes.
        on_member_end: Called as soon as a member leaves the array, with its index, its
            result and its error (see :class:`SpilledFusedJob`): e.g. to see why one failed.
        refill: Asked for members to join where members have left (see
            :class:`SpilledFusedJob`).
        memory_plan: Keep / swap / recompute of the activations
            (:func:`~sweepmaster.runtime.training.fused_memplan.plan_stacked_memory` for
            ``plan``), or ``None`` for Hydra's full recompute.

    Returns:
        Per member, in the order of ``specs`` and then of joining: its result, or ``None`` if
        it failed.

    Raises:
        ValueError: See :class:`SpilledFusedJob`.
        torch.OutOfMemoryError: A task did not fit the device.
    """
    results: dict[int, TrainResult | None] = {}

    def ended(index: int, result: TrainResult | None, error: Exception | None) -> None:
        results[index] = result
        if on_member_end is not None:
            on_member_end(index, result, error)

    job = SpilledFusedJob(specs, plan, callbacks, on_member_end=ended, refill=refill,
                          memory_plan=memory_plan)
    job.run_to_end(device, prefetch=prefetch)
    return [results.get(index) for index in range(len(job.members.runs))]
