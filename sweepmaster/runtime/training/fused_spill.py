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
recompute), or, with a memory plan (:func:`plan_stacked_memory`: mu-TWO's keep / swap /
recompute plan of the stacked shards, planned like a single spilled job's from a trace of the
vmapped stacked layers), kept, swapped or recomputed layer by layer by the planned passes
every spilled job shares (:meth:`~sweepmaster.runtime.training.chain.ShardChain._forward_planned`,
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
boundaries are the ones every spilled job shares
(:class:`~sweepmaster.runtime.training.chain.ShardChain`): a stacked shard whose next task runs
on the same device stays resident there.

Exactness (DESIGN, "Exactness"): each member ends with the weights of its plain training.

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
  (:class:`~sweepmaster.runtime.training.members.DropoutReplay` noise, as a fused array draws it),
  kept on the host as masks packed 8 draws a byte and each member's scale ``1 / (1 - p)``, and each
  shard task promotes its layers' mask rows for the microbatch (a 32nd of the float noise's bytes)
  and unpacks and scales them back to the drawn noise on the device. The backward's recompute (of a
  shard, or of a layer a memory plan recomputes) replays the same noise, so recompute never changes
  a mask; a swapped or kept noise is the drawn one. At a LoRA adapter's dropout each member drops
  with its own ``peft.dropout`` (its noise is ones when that is 0, as PEFT's ``nn.Identity`` draws
  nothing). A probe forward finds every draw
  (:class:`~sweepmaster.runtime.training.members.DropoutReplay`, the dropout of
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
  evaluating (:func:`~sweepmaster.runtime.training.chain.after_step_phase`, the one rule).

Checkpoints (:mod:`~sweepmaster.runtime.training.checkpoint`), per member as in
:func:`~sweepmaster.runtime.training.plain.train_plain`: a member with ``state_dir`` resumes from
the newest intact checkpoint of its job there (written by any path: weights, its optimizer state
per parameter name, its dropout stream, metrics), and with ``checkpoint_every`` writes its own
after every that many steps, once the step (its evaluation, and the deferred clipped updates) is
done. Members may resume from different steps: the array's steps count from the start of this run,
each member's from its own checkpoint, so member k at array step ``a`` is at step
``start_k + a`` of its data order, schedule and evaluations, and leaves at its ``total_steps``.

Members leave the array (unfuse) when pruned by a callback, when they reach their
``total_steps``, or when they fail alone (a non-finite loss, a callback that raises an
``Exception``, a checkpoint that cannot be written; a ``BaseException`` such as
``KeyboardInterrupt`` ends the whole array). Between steps the host state of every stacked
tensor (parameters, optimizer state) drops the member's row, so the others go on with unchanged
state and later tasks move only the remaining members.

Members join (refill, :meth:`SpilledFusedJob.join`, offered by a
:data:`~sweepmaster.runtime.training.members.RefillHook`) at a step boundary, so an array keeps its
K slots busy while a sweep has trials to give: built as alone (seeded init, its own data order,
schedule, dropout stream and step count, or its checkpoint's) and stacked last into every host
tensor, with fresh optimizer state (zeros: what ``torch.optim`` starts from), up to the K the
stacked plan was made for and no wider than the member it was made for (the plan holds). The task
sequence is made again from the next task: the joiner's step-0 evaluation, then steps until the
last member ends; each member's own step is ``start + a - joined`` at array step ``a``. A join that
fails leaves the array as it was. Members never see each other's slices, so each, joined late or
not, ends with the weights of training it alone.

Pipelined (:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP): the
array's steps may run over several devices, its stacked shards in packs, through the per-shard
interface of :class:`~sweepmaster.runtime.training.chain.ShardChain` (a pack's tensors are
installed by name; its passes, clipped updates and optimizer states are the shard tasks'), with
the numbers of its shard tasks. Its members stay the same during a pipelined step: the packs go
home at a step boundary where a member leaves, may join or checkpoints.

Shape legend: K members, B batch, b microbatch, T tokens per block, V vocabulary, M eval blocks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import vmap

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.execution.events import TrainCallbacks
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory
from sweepmaster.runtime.planning.memprofile import TracedLayers
from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.planning.profile import ModelProfile, profile_model
from sweepmaster.runtime.scheduling.scheduler import PEAK_MARGIN
from sweepmaster.runtime.training.boundaries import metering
from sweepmaster.runtime.training.chain import (
    ShardChain,
    ShardTask,
    StateSlot,
    TensorKey,
)
from sweepmaster.runtime.training.checkpoint import (
    TrainingState,
    capture_rng,
    job_key,
    load_latest,
)
from sweepmaster.runtime.training.fused_optim import (
    FusedOptimizer,
    build_fused_optimizer,
    clip_coefficients,
    member_grad_norms,
)
from sweepmaster.runtime.training.fused_shards import (
    StackedLayers,
    dropout_noise_bytes,
    stacked_profile,
    stacked_spec,
)
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.layers import LayerStack
from sweepmaster.runtime.training.members import (
    MemberEndHook,
    MemberRun,
    NoiseSite,
    RefillHook,
    SharedBases,
    load_member,
    lora_scale,
    member_noise,
    meta_template,
    same_tensors,
    unpad,
    zero_pad,
)
from sweepmaster.runtime.training.plain import _check, lr_factor
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.workload.architecture import fusion_group_key
from sweepmaster.workload.models import causal_lm_loss
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["SpilledFusedJob", "plan_stacked_memory", "train_fused_spilled"]

_CPU = torch.device("cpu")
#: Bit positions of a packed dropout mask byte (see :func:`_pack_mask`).
_BITS = torch.arange(8, dtype=torch.uint8)


class _Drawn:
    """A fused array's planned pass mode: its dropout noise is drawn, no random op runs."""

    site = 0


_DRAWN = _Drawn()


class SpilledFusedJob(ShardChain):
    """K same-architecture members trained by stacked-shard tasks (module doc); one at a time.

    The task API is :class:`~sweepmaster.runtime.training.spill.SpilledJob`'s: :meth:`next_task`,
    :meth:`peek_task`, :meth:`run`. Members report through their own callbacks and leave the
    array through ``on_member_end`` with their :class:`~sweepmaster.workload.spec.TrainResult`
    (``swap_bytes``, ``p2p_bytes``, promote / demote counts and ``peak_device_bytes`` are the
    array's so far).
    Members with ``state_dir`` resume from their checkpoints when the array is built (module
    doc); when every member resumed at its end there is no task, and :meth:`settle` hands
    them on.

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
            join it (:data:`~sweepmaster.runtime.training.members.RefillHook`; see :meth:`join`,
            which each offered member goes through: one that cannot join fails alone). Not
            asked while a clipped update is deferred: at the next boundary after an evaluation
            or a member's end.
        planned: The member the plan was made for, as wide as any member and any joiner it
            should take (a LoRA rank, adapter dropout, SGD momentum); default
            :func:`stacked_spec` of ``specs``. The stacked tensors are padded to it.
        memory_plan: Keep / swap / recompute of the stacked shards' activations
            (:func:`plan_stacked_memory` for ``plan``); ``None``: Hydra's full recompute. With
            a plan, a backward task on CUDA must run on the GPU that ran the shard's forward
            task; elsewhere it falls back to recomputing that shard.

    Raises:
        ValueError: Members that cannot fuse (LoRA members: whose frozen bases differ),
            members whose evaluation blocks differ in shape (or only some evaluate), an invalid
            spec, a plan for another model (or made without ``grad_clip`` for clipping
            members), a memory plan for another plan, or a callback list of another length.
    """

    row_dim = 1  # token ids and host boundaries are (K, B, ...)
    #: A stacked plan's peaks are K x one member's profile (a vmapped layer's transients differ
    #: from that): estimates, given the residency cache's margin.
    _prefetch_margin = PEAK_MARGIN

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
        specs = list(specs)
        members = list(callbacks) if callbacks is not None else [None] * len(specs)
        if not specs or len(members) != len(specs):
            raise ValueError(f"{len(specs)} specs but {len(members)} callbacks")
        keys = {fusion_group_key(spec) for spec in specs}
        if None in keys or len(keys) > 1:
            raise ValueError("members of a fused array must share one architecture key (model "
                             "config, dtype, batch and block size) and optimizer kind")
        clipping = [spec.name for spec in specs if spec.optimizer.grad_clip is not None]
        if clipping and len(plan.shards) > 1 and not plan.grad_clip:
            raise ValueError(f"member {clipping[0]!r} clips gradients but the plan was made "
                             "without grad_clip: plan the array for a clipping member")
        super().__init__(plan, specs[0].batch_size, memory_plan)
        self.runs = [
            MemberRun(index, spec, callback if callback is not None else TrainCallbacks())
            for index, (spec, callback) in enumerate(zip(specs, members, strict=True))
        ]
        for run in self.runs:
            _check(run.spec, int(run.spec.train_data.shape[1]), run.eval_data)
        evals = [run.eval_data for run in self.runs]
        if len({None if e is None else tuple(e.shape) for e in evals}) > 1:
            raise ValueError("members of a spilled fused array must all evaluate on blocks of "
                             "one shape (or none evaluate)")
        self.live = list(self.runs)  # live[k] is row k of every stacked tensor
        self.on_member_end = on_member_end
        self.refill = refill
        #: The member the plan and the template were made for (:func:`stacked_spec`).
        self.planned_spec = planned if planned is not None else stacked_spec(specs)
        wider = [reason for spec in specs if (reason := self._wider(spec)) is not None]
        if wider:
            raise ValueError(wider[0])
        #: Members the plan holds (K of the stacked plan): joins never take the array past it.
        self.num_slots = len(specs)
        self.layers = StackedLayers(self.planned_spec)
        if plan.shards[-1].stop != len(self.layers):
            raise ValueError(f"plan has {plan.shards[-1].stop} layers, the members' model has "
                             f"{len(self.layers)}")
        states: list[TrainingState | None] = []
        for run in self.runs:
            state = run.latest_state(self.device_type)
            if state is not None:
                run.resume(state)
            states.append(state)
        self._build(specs, states)
        del states
        for run in self.runs:
            run.num_parameters = sum(shape.numel() for shape in self._shapes[run.index].values())
        #: Per member (index in ``specs``, then joining order), the step it started (or resumed)
        #: from, and the array's steps when it joined (0: it founded the array).
        self.resumed_from_step = [run.step for run in self.runs]
        self.joined_step = [0] * len(self.runs)
        self.step = 0  # steps of the array in this run
        self._chain_start = 0  # the array step the task sequence was made at
        self._fresh = set(range(len(self.runs)))  # members whose start it begins with
        self._saved_step = 0  # the last array step whose checkpoints were written
        self._evaluate = evals[0] is not None
        # step state, on the host: ids (K, B, T), per layer its noise (K, B, ...), boundaries
        self._ids_KBT = torch.empty(0)
        self._noises: list[list[Tensor]] = []  # per layer, per site: packed masks (K, B, n/8)
        self._noise_scales: list[list[Tensor]] = []  # the same: each member's 1 / (1 - p) (K,)
        self._acts: dict[int, Tensor] = {}  # shard -> its input (K, B, ...)
        self._grads: dict[int, Tensor] = {}  # shard -> gradient of its output (K, B, ...)
        self._eval_acts: dict[int, Tensor] = {}  # shard -> its input (K, M, ...)
        self._losses = []
        # grad_clip (module doc): per-member norms (K,), gradients (K, ...) and clip
        # coefficients (K,) on the host; shard -> the lrs of its deferred update
        self._clipping = any(spec.optimizer.grad_clip is not None for spec in specs)
        #: name -> the leaf tensor every task and pipeline pack computes with (its data: the
        #: installed copy, else empty); a trainable one gets gradients
        self._leaves: dict[TensorKey, Tensor] = {
            name: torch.empty(0).requires_grad_(name in self.params)
            for name in (*self.params, *self.frozen, *self.buffers)}

    # ------------------------------------------------------------------ task API

    @property
    def stopped(self) -> bool:
        """Whether every member has left the array."""
        return not self.live

    @property
    def num_members(self) -> int:
        """K, the members still in the array."""
        return len(self.live)

    @property
    def num_steps(self) -> int:
        """Steps the array trains in this run: until the last of its members ends."""
        return max((self.joined_step[run.index] + run.spec.total_steps
                    - self.resumed_from_step[run.index] for run in self.live), default=self.step)

    @property
    def remaining_seconds(self) -> float:
        """Estimated seconds of the array's remaining steps (the Sharded-LRTF key)."""
        left = max((run.spec.total_steps - run.step for run in self.live), default=0)
        step_s = self.plan.step_s if self.memory_plan is None else self.memory_plan.step_s
        return left * step_s

    def _prefetch_window(self, current: ShardTask, task: ShardTask) -> bool:
        """Within one training step only: members leave the array between steps."""
        return (task.seq == current.seq + 1 and task.step == current.step
                and current.phase == "train" and task.phase == "train")

    def settle(self, device: Device) -> None:
        """Hand on the members that have nothing left to train (resumed at their last step).

        A run of the array whose every member resumed at its ``total_steps`` has no task;
        call this once :meth:`next_task` is ``None`` so that they leave with their results.
        """
        if self.next_task() is None and self.live:
            if not self._started:
                self._start_runs(device)
            self._retire()

    # ------------------------------------------------------------------ members

    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s weights (position in the array) as its model's ``state_dict``.

        A LoRA member's adapter has its own (unpadded) shapes; its base is the shared one.
        """
        self._settle_hosts()  # the host copies are read
        return {name: self._member_tensor(index, self.layers.aliases.get(name, name))
                .to("cpu", copy=True)
                for name in self.layers.template.state_dict(keep_vars=True)}

    def _member_tensor(self, index: int, name: str) -> Tensor:
        """Member ``index``'s tensor ``name`` (unpadded; the shared one if frozen), detached."""
        if name in self.frozen:
            return self.frozen[name]
        if name in self.params:
            return unpad(self.params[name][index], self._shapes[self.live[index].index][name])
        return self.buffers[name][index]

    def member_training_state(self, index: int) -> TrainingState:
        """Member ``index``'s training state, as an unfused trial's checkpoint holds it.

        Weights, its slice of every shard's fused optimizer state per parameter name, its step
        and dropout stream, its metrics and training seconds. Call it between steps, with no
        clipped update deferred.
        """
        assert not self._pending, "a clipped update is deferred"
        self._settle_hosts()  # the host copies are read (the optimizer state too)
        run = self.live[index]
        shapes = self._shapes[run.index]
        optimizer: dict[str, dict[str, Any]] = {}
        for owned, fused in zip(self._owned, self._optimizers, strict=True):
            if fused is not None:
                optimizer |= {
                    name: {key: unpad(value, shapes[name])
                           if isinstance(value, Tensor) and value.dim() else value
                           for key, value in entry.items()}
                    for name, entry in fused.member_state(index, owned).items()
                }
        return TrainingState(
            step=run.step, model=self.member_state_dict(index), optimizer=optimizer,
            rng=capture_rng(torch.device(self.device_type), self._generators[index]),
            metrics=list(run.metrics), elapsed_s=run.seconds(self._save_s),
        )

    def member_module(self, index: int) -> nn.Module:
        """A standalone CPU model holding member ``index``'s weights (to checkpoint it).

        A LoRA member's model carries its own unpadded adapter and PEFT config (it saves in
        PEFT's format); its frozen base shares the array's host tensors (not copied).
        """
        self._settle_hosts()  # the host copies are read
        tensors: dict[str, Tensor] = {}
        for name in {**self.params, **self.frozen, **self.buffers}:
            value = self._member_tensor(index, name).to("cpu", copy=name not in self.frozen)
            is_param = name not in self.buffers
            tensors[name] = nn.Parameter(value, name in self.params) if is_param else value
        for alias, canonical in self.layers.aliases.items():
            tensors[alias] = tensors[canonical]  # tied: one tensor under both names
        spec = self.live[index].spec
        module = (copy.deepcopy(self.layers.template) if spec.peft is None
                  else meta_template(spec))
        for name, tensor in tensors.items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, tensor)
        return module.train()

    # ------------------------------------------------------------------ state

    def _build(self, specs: list[TrainSpec], states: list[TrainingState | None]) -> None:
        """Build the members like plain training (or from their checkpoints), then stack them.

        Trainable parameters are stacked ``(K, ...)`` (a LoRA adapter zero-padded to rank R),
        buffers too; frozen parameters (a LoRA base) are kept once, from the first member, and
        every other member's are checked equal and dropped as it is built.

        Raises:
            ValueError: A member's frozen weights differ from the first member's.
        """
        torch_device = torch.device(self.device_type)
        padded = self.layers.shapes()
        member_params: list[dict[str, Tensor]] = []
        member_buffers: list[dict[str, Tensor]] = []
        frozen: dict[str, Tensor] | None = None
        self._shapes: list[dict[str, torch.Size]] = []  # by index in specs: unpadded shapes
        self._generators: list[torch.Generator] = []
        self._batches: list[Iterator[tuple[int, Tensor]]] = []
        self._bases = SharedBases()
        for spec, state in zip(specs, states, strict=True):
            member, adapted, buffers, base = load_member(spec, state, torch_device, self._bases)
            if frozen is None:
                frozen = base
            elif not same_tensors(frozen, base):
                raise ValueError(f"member {spec.name!r} has other frozen weights than "
                                 f"{specs[0].name!r}: a fused array holds one frozen base")
            self._shapes.append(member.shapes)
            member_params.append({name: zero_pad(p, padded[name])
                                  for name, p in adapted.items()})
            member_buffers.append(buffers)
            del adapted, buffers, base
            self._generators.append(member.generator)
            self._batches.append(member.batches)
        # pageable: the transfer engine stages copies through pinned blocks on CUDA
        self.params: dict[str, Tensor] = {
            name: torch.stack([params[name] for params in member_params])
            for name in self.layers.param_names
        }
        #: The frozen parameters (a LoRA base) by name: one host copy for every member.
        self.frozen: dict[str, Tensor] = dict(frozen or {})
        self.buffers: dict[str, Tensor] = {
            name: torch.stack([buffers[name] for buffers in member_buffers])
            for name in member_buffers[0]
        }
        del member_params, member_buffers, frozen
        if not self._bases.shares(self.frozen):  # kept, it would be a second host copy
            self._bases.clear()
        self._scaling_K = torch.tensor([lora_scale(spec) for spec in specs], dtype=torch.float32)
        self._sites: list[list[NoiseSite]] = self.layers.probe_dropout(
            {**{n: p[0] for n, p in self.params.items()}, **self.frozen,
             **{n: b[0] for n, b in self.buffers.items()}},
            self._scaling_K[0] if self.layers.adapted else None,
            specs[0].batch_size, int(specs[0].train_data.shape[1]),
        )
        order = {name: i for i, name in enumerate(self.params)}
        owner: dict[str, int] = {}
        self._shard_params: list[list[str]] = []
        self._shard_frozen: list[list[str]] = []
        self._shard_buffers: list[list[str]] = []
        self._owned: list[list[str]] = []
        self._optimizers: list[FusedOptimizer | None] = []
        trainable = set(self.layers.param_names)
        for index, shard in enumerate(self.plan.shards):
            layers = range(shard.start, shard.stop)
            names = {n for i in layers for n in self.layers.layer_params(i)}
            params = sorted((n for n in names if n in trainable), key=order.__getitem__)
            owned = [n for n in params if owner.setdefault(n, index) == index]
            self._shard_params.append(params)
            self._shard_frozen.append(sorted(names & self.layers.frozen_names))
            self._shard_buffers.append(list(dict.fromkeys(
                b for i in range(shard.start, shard.stop) for b in self.layers.layer_buffers(i)
            )))
            self._owned.append(owned)
            if not owned:
                self._optimizers.append(None)
                continue
            fused = build_fused_optimizer([s.optimizer for s in specs], _CPU)
            for k, state in enumerate(states):
                if state is not None:
                    fused.load_member_state(k, [self.params[n] for n in owned], state.optimizer,
                                            owned)
            self._optimizers.append(fused)

    def refusal(self, spec: TrainSpec) -> str | None:
        """Why ``spec`` does not fit the array's plan, or ``None`` when it does (:meth:`join`).

        Reads only what never changes (the plan and its member), so any thread may ask.
        """
        name = spec.name
        if fusion_group_key(spec) != fusion_group_key(self.planned_spec):
            return (f"member {name!r} cannot join: a fused array's members share one "
                    "architecture key (model config, dtype, batch and block size) and optimizer "
                    "kind (LoRA: one base and target modules)")
        wider = self._wider(spec)
        if wider is not None:
            return wider
        if spec.optimizer.grad_clip is not None and not self._clipping:
            return (f"member {name!r} cannot join: it clips gradients and the array was "
                    "planned without grad_clip")
        data, ours = MemberRun(0, spec, TrainCallbacks()).eval_data, self.runs[0].eval_data
        if (data is None) != (ours is None) or (
                data is not None and ours is not None and data.shape != ours.shape):
            return (f"member {name!r} cannot join: members of a spilled fused array all "
                    "evaluate on blocks of one shape (or none evaluate)")
        return None

    def _wider(self, spec: TrainSpec) -> str | None:
        """Why ``spec`` is wider than the member the plan was made for, if it is."""
        planned = self.planned_spec
        widened = stacked_spec([planned, spec])
        if widened.peft != planned.peft:
            assert spec.peft is not None and planned.peft is not None
            return (f"member {spec.name!r} cannot join: its LoRA adapter (rank {spec.peft.r}, "
                    f"dropout {spec.peft.dropout}) is wider than the one the array was planned "
                    f"for (rank {planned.peft.r}, dropout {planned.peft.dropout})")
        if widened.optimizer.momentum != planned.optimizer.momentum:
            return (f"member {spec.name!r} cannot join: its momentum buffer is state the array "
                    "was planned without")
        return None

    def join(self, spec: TrainSpec, state: TrainingState | None = None,
             callbacks: TrainCallbacks | None = None) -> int:
        """Refill: a new member joins the array at a step boundary, built as it would be alone.

        It is built like every member (seeded init, its own data order, learning-rate schedule,
        dropout stream and step count, or those of ``state``; a LoRA adapter zero-padded to the
        array's rank R) and stacked last into every host tensor; its optimizer state starts as a
        fresh ``torch.optim``'s (or ``state``'s). The shard kept resident and the prefetched copies
        are written back and dropped first, as when a member leaves. The task sequence is made
        again from the next task: the joiner's evaluation at its step 0 first (when it
        evaluates), then steps until the last member ends. Every member, the joiner included,
        ends with the weights of training it alone.

        The stacked plan was made for the array's founding K and widest member
        (:attr:`planned_spec`), so a member that would outgrow it is refused: one more than K
        members, a LoRA rank (or adapter dropout) wider than the plan's, an SGD momentum
        buffer or gradient clipping the plan was made without. A join is all or nothing: what
        it raises leaves the array exactly as it was.

        Call it between tasks: after a step's last task (and its evaluation), before the next
        step's first (:attr:`refill` asks at those boundaries).

        Args:
            spec: The new member.
            state: A training-state checkpoint to continue from, or ``None`` (step 0).
            callbacks: Its progress receiver; it hears ``on_start`` now when the array has
                started (else with the others).

        Returns:
            The new member's index in :attr:`runs` (its ``on_member_end`` index).

        Raises:
            ValueError: ``spec`` cannot join (see above: the message says why), its frozen
                weights differ from the array's, or it is an invalid spec.
            RuntimeError: ``state`` does not fit the member (tensors of other shapes).
        """
        reason = self.refusal(spec)
        if reason is None and len(self.live) >= self.num_slots:
            reason = (f"member {spec.name!r} cannot join: the array's stacked plan holds "
                      f"{self.num_slots} members and {len(self.live)} train in it")
        if reason is None and self._pending:
            reason = (f"member {spec.name!r} cannot join while a clipped update is deferred: "
                      "join after an evaluation or a member's end")
        if reason is not None:
            raise ValueError(reason)
        run = MemberRun(len(self.runs), spec,
                        callbacks if callbacks is not None else TrainCallbacks())
        _check(spec, int(spec.train_data.shape[1]), run.eval_data)
        member, adapted, buffers, base = load_member(spec, state, torch.device(self.device_type),
                                                      self._bases)
        if not self._bases.shares(self.frozen):
            self._bases.clear()
        if not same_tensors(self.frozen, base):
            raise ValueError(f"member {spec.name!r} has other frozen weights than the array: a "
                             "fused array holds one frozen base")
        del base
        self._unhold()  # the host copies are read: whole, and nothing of K rows on a device
        padded = self.layers.shapes()
        with torch.no_grad():  # the grown tensors; the array's own are untouched until all exist
            params = {name: torch.cat([p, zero_pad(adapted[name], padded[name]).unsqueeze(0)])
                      for name, p in self.params.items()}
            buffers_K = {name: torch.cat([b, buffers[name].unsqueeze(0).to(b.dtype)])
                         for name, b in self.buffers.items()}
            scaling_K = torch.cat([self._scaling_K, torch.tensor([lora_scale(spec)])])
        index = len(self.live)
        undo = [optimizer.undo_point() for optimizer in self._optimizers
                if optimizer is not None]
        try:
            for owned, optimizer in zip(self._owned, self._optimizers, strict=True):
                if optimizer is None:
                    continue
                grown = [params[name] for name in owned]
                optimizer.add_member(spec.optimizer, grown)
                if state is not None:
                    optimizer.load_member_state(index, grown, state.optimizer, owned)
        except BaseException:
            for undo_optimizer in undo:
                undo_optimizer()
            raise
        self.params, self.buffers, self._scaling_K = params, buffers_K, scaling_K
        self._host_grads, self._clip_coef = {}, None  # of K members; none is deferred now
        if state is not None:
            run.resume(state)
        run.key = job_key(spec) if spec.state_dir is not None else ""
        run.num_parameters = sum(shape.numel() for shape in member.shapes.values())
        self.runs.append(run)
        self.live.append(run)
        self.resumed_from_step.append(run.step)
        self.joined_step.append(self.step)
        self._shapes.append(member.shapes)
        self._generators.append(member.generator)
        self._batches.append(member.batches)
        if self._chain_start != self.step:
            self._fresh.clear()
        self._fresh.add(run.index)
        self._chain_start = self.step
        self._rechain()
        if self._started:
            run.begin(self.device_name, self._save_s)
        return run.index

    def _unhold(self) -> None:
        """Make the host copies whole and drop the prefetched copies (of K rows)."""
        self._settle_hosts()
        for _, future in self._prefetched.values():
            future.result()
        self._prefetched.clear()

    def _remove_member(self, index: int) -> None:
        """Unfuse between steps: drop row ``index`` of every stacked host tensor."""
        self._unhold()
        keep_K = torch.tensor([k for k in range(len(self.live)) if k != index], dtype=torch.long)
        self.params = {n: p.index_select(0, keep_K) for n, p in self.params.items()}
        self.buffers = {n: b.index_select(0, keep_K) for n, b in self.buffers.items()}
        self._scaling_K = self._scaling_K.index_select(0, keep_K)
        for optimizer in self._optimizers:
            if optimizer is not None:
                optimizer.remove_member(index)
        self._norms = {n: t.index_select(0, keep_K) for n, t in self._norms.items()}
        self._host_grads = {n: g.index_select(0, keep_K) for n, g in self._host_grads.items()}
        if self._clip_coef is not None:
            self._clip_coef = self._clip_coef.index_select(0, keep_K)
        for lrs in self._pending.values():
            lrs.pop(index)
        self._generators.pop(index)
        self._batches.pop(index)
        self.live.pop(index)

    # ------------------------------------------------------------------ sequence

    def _eval_due(self, index: int, step: int) -> bool:
        """Whether member ``index`` (in :attr:`runs`) evaluates after array step ``step``.

        Its own step then is ``start + step - joined``; at the step it joined (or founded the
        array at) it evaluates only when it starts at its step 0 (a resumed member evaluated
        before its checkpoint).
        """
        run, start = self.runs[index], self.resumed_from_step[index]
        joined = self.joined_step[index]
        own = start + step - joined
        return self._evaluate and step >= joined and (step > joined or start == 0) \
            and run.eval_due(own) and own <= run.spec.total_steps

    def _in_phase(self, index: int, step: int) -> bool:
        """Whether what follows array step ``step`` concerns member ``index``.

        At the step the task sequence was made at, only the members it begins with (those that
        joined there: the others' evaluation there ran before they joined); after it, all.
        """
        return step != self._chain_start or index in self._fresh

    def _evaluates_after(self, step: int) -> bool:
        return any(self._eval_due(run.index, step) and self._in_phase(run.index, step)
                   for run in self.runs if run.error is None)

    def _evaluated(self, run: MemberRun) -> bool:
        return self._eval_due(run.index, self.step) and self._in_phase(run.index, self.step)

    def _settles_after(self, step: int) -> bool:
        return any(run.settles(self.resumed_from_step[run.index] + step
                               - self.joined_step[run.index]) for run in self.runs)

    # ------------------------------------------------------------------ compute

    def start_step(self, device: Device) -> None:
        """Draw each member's minibatch and every dropout noise of the step (on the host)."""
        self._step_start = time.perf_counter()
        self._epochs, rows = [], []
        for batches, run in zip(self._batches, self.live, strict=True):
            epoch, index_B = next(batches)
            self._epochs.append(epoch)
            rows.append(run.spec.train_data[index_B])
        self._ids_KBT = torch.stack(rows)
        self._lrs = [
            run.spec.optimizer.lr * lr_factor(run.step, run.spec.optimizer, run.spec.total_steps)
            for run in self.live
        ]
        drawn = [[self._draw(site) for site in sites] for sites in self._sites]
        self._noises = [[mask_K for mask_K, _ in layer] for layer in drawn]
        self._noise_scales = [[scale_K for _, scale_K in layer] for layer in drawn]
        self._losses = []

    def _draw(self, site: NoiseSite) -> tuple[Tensor, Tensor]:
        """One dropout site's noise, member k's from its generator, as masks and scales.

        Member k's noise is plain's ``bernoulli(1 - p).div(1 - p)``; it is kept on the host as
        its mask, packed 8 draws a byte (``(K, B, ceil(n / 8))`` uint8, :func:`_pack_mask`: a
        32nd of float32's bytes to promote) and its nonzero value ``(K,)``, so that
        ``mask * scale`` is the drawn noise exactly. At an adapter's
        site member k drops with its own ``peft.dropout``; with 0 it draws nothing (PEFT's
        ``nn.Identity``) and its noise is ones (PEFT's identity draws nothing).
        """
        masks, scales = [], []
        for run, generator in zip(self.live, self._generators, strict=True):
            noise = member_noise(site, run.spec, generator, generator.device)
            masks.append(noise != 0)
            scales.append(noise.amax())
        mask_K, scale_K = torch.stack(masks).to("cpu"), torch.stack(scales).to("cpu")
        return _pack_mask(mask_K), scale_K

    def _run_layers(self, shard: int, resident: Mapping[TensorKey, Tensor], x_K: Tensor,
                    rows: slice | None, device: Device) -> Tensor:
        plan = self.plan.shards[shard]
        scaling_K = self.to_device(device, self._scaling_K) if self.layers.adapted else None
        for layer in range(plan.start, plan.stop):
            x_K = self._stacked_layer(layer, resident, rows, device, scaling_K, x_K)
        return x_K

    def _stacked_layer(self, layer: int, resident: Mapping[TensorKey, Tensor], rows: slice | None,
                       device: Device, scaling_K: Tensor | None, x_K: Tensor) -> Tensor:
        """Layer ``layer`` of every member on ``x_K`` ``(K, b, ...)``: ``(K, b, ...)``.

        With the dropout noise of the step's rows ``rows`` (promoted and unpacked here, so a
        recompute makes it again), or none (``None``: evaluation).
        """
        noises = []
        if rows is not None:
            noises = [
                self._noise(device, packed_K[:, rows], scale_K, site.shape[1:])
                for packed_K, scale_K, site in zip(self._noises[layer],
                                                   self._noise_scales[layer],
                                                   self._sites[layer], strict=True)
            ]
        tensors = cast(dict[str, Tensor], resident)  # by canonical name
        return self.layers.forward(layer, tensors, x_K, noises, scaling_K)

    def _noise(self, device: Device, packed_K: Tensor, scale_K: Tensor,
               row_shape: tuple[int, ...]) -> Tensor:
        """The drawn noise ``(K, b, *row_shape)`` on ``device``: its packed masks times scales."""
        packed_K, scale_K = self.to_device(device, packed_K), self.to_device(device, scale_K)
        num_rows, size = packed_K.shape[1], math.prod(row_shape)
        bits = packed_K.unsqueeze(-1).bitwise_right_shift(_BITS.to(packed_K.device)) & 1
        del packed_K
        noise_K = bits.reshape(len(scale_K), num_rows, -1)[..., :size].to(scale_K.dtype)
        del bits
        noise_K = noise_K.view(len(scale_K), num_rows, *row_shape)
        return noise_K.mul_(scale_K.view((-1,) + (1,) * (noise_K.dim() - 1)))

    # ------------------------------------------------------------------ memory plan

    def _labels(self) -> Tensor:
        return self._ids_KBT

    def _layer_calls(self, shard: int, rows: slice,
                     device: Device) -> tuple[list[Layer], list[list[Tensor]]]:
        """The stacked layers of ``shard`` over the leaves, each making its noise for ``rows``."""
        self.layers.train(True)
        plan = self.plan.shards[shard]
        scaling_K = self.to_device(device, self._scaling_K) if self.layers.adapted else None
        leaves = self._leaves
        calls: list[Layer] = []
        residents: list[list[Tensor]] = []
        for layer in range(plan.start, plan.stop):
            calls.append(functools.partial(self._stacked_layer, layer, leaves, rows, device,
                                           scaling_K))
            names = [*self.layers.layer_params(layer), *self.layers.layer_buffers(layer)]
            residents.append([leaves[name] for name in names])
        return calls, residents

    def _task_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the step's dropout noise is drawn at its start

    def _compute_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        return metering(device)

    def _pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
                   site: int = 0, rng: JobRng | None = None,
                   ) -> contextlib.AbstractContextManager[Any]:
        """Nothing to record or replay: the step's dropout noise is drawn already."""
        return contextlib.nullcontext(_DRAWN)

    def _task_tensors(self) -> Mapping[TensorKey, Tensor]:
        """The leaves by name (:attr:`_leaves`): installed copies are their data."""
        return self._leaves

    def _idle_data(self, host: Tensor) -> Tensor:
        """An empty tensor: the stacked host copies live in :attr:`params` and the others."""
        del host
        return torch.empty(0)

    def _run_shard(self, shard: int, tensors: Mapping[TensorKey, Tensor], x: Tensor,
                   rows: slice | None, device: Device,
                   overrides: Mapping[TensorKey, Tensor] | None = None) -> Tensor:
        """The stacked shard on ``x`` ``(K, b, ...)``: training with the noise of ``rows``."""
        self.layers.train(rows is not None)
        resident = {**tensors, **overrides} if overrides else tensors
        return self._run_layers(shard, resident, x, rows, device)

    def _norms_of(self, grads: list[Tensor]) -> list[Tensor]:
        return member_grad_norms(grads)

    def _schedule(self) -> list[float]:
        return list(self._lrs)

    def _lm_loss(self, logits: Tensor, ids: Tensor) -> Tensor:
        loss_K = vmap(causal_lm_loss)(logits, ids)
        assert isinstance(loss_K, Tensor)
        return loss_K

    def _update(self, shard: int, tensors: Mapping[TensorKey, Tensor], lrs: list[float],
                device: Device, clip_coef_K: Tensor | None = None) -> None:
        """The fused optimizer's step of the shard's owned parameters at each member's lr.

        Its state is on ``device`` already. ``clip_coef_K``: each member's clip coefficient
        ``(K,)`` on ``device``, multiplied into its gradients first.
        """
        optimizer = self._optimizers[shard]
        assert optimizer is not None
        params = [tensors[name] for name in self._owned[shard]]
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

    @contextlib.contextmanager
    def _dropout_off(self, shard: int | None) -> Iterator[None]:
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
        return self._clipping

    def start(self, device: Device, task: ShardTask) -> None:
        """Start every member (``on_start``); before a training task, those done leave now."""
        super().start(device, task)
        if task.phase != "eval":  # no evaluation first: members done already leave now
            self._retire()

    def step_ids(self) -> Tensor:  # noqa: D102
        return self._ids_KBT

    def _members_change(self) -> bool:
        """Whether a member leaves the array, or one may join, at the step boundary now."""
        leaves = any(run.error is not None or run.pruned or run.step >= run.spec.total_steps
                     for run in self.live)
        return leaves or (self.refill is not None and len(self.live) < self.num_slots)

    def shard_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return [*self._shard_params[shard], *self._shard_frozen[shard],
                *self._shard_buffers[shard]]

    def owned_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return list(self._owned[shard])

    def trainable(self, key: TensorKey) -> bool:  # noqa: D102
        return key in self.params

    def host_tensor(self, key: TensorKey) -> Tensor:  # noqa: D102
        assert isinstance(key, str)
        for tensors in (self.params, self.frozen, self.buffers):
            if key in tensors:
                return tensors[key]
        raise KeyError(key)

    def _state_slots(self, shard: int) -> list[StateSlot]:
        """Every state tensor of the shard's fused optimizer, per stacked parameter."""
        optimizer = self._optimizers[shard]
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

    # ------------------------------------------------------------------ bookkeeping

    def _finish_step(self, device: Device) -> None:
        super()._finish_step(device)
        self._noises, self._noise_scales = [], []

    def _end_step(self, device: Device) -> None:
        """A step boundary: checkpoints that are due, members leave, members join (in this order).

        The boundary may come twice at one step: again after the evaluation of members that
        joined there (its checkpoints are written once).
        """
        self._fresh.clear()
        super()._end_step(device)
        self._retire()
        while self._join_offered():
            self._retire()

    def _join_offered(self) -> bool:
        """Fill the free slots with the members ``refill`` offers; whether it offered any."""
        free = self.num_slots - len(self.live)
        if self.refill is None or free <= 0 or self._pending:
            return False
        offered = self.refill(free, self.step)
        for spec, callbacks in offered:
            try:
                key = job_key(spec) if spec.state_dir is not None else ""
                state = load_latest(spec.state_dir, key, self.device_type) if key else None
                self.join(spec, state, callbacks)
            except Exception as exc:  # it cannot join (or its checkpoint is unreadable)
                run = MemberRun(len(self.runs), spec, TrainCallbacks(), error=exc)
                self.runs.append(run)
                self.resumed_from_step.append(0)
                self.joined_step.append(self.step)
                self._shapes.append({})
                if self.on_member_end is not None:
                    self.on_member_end(run.index, None, exc)
        return bool(offered)

    def _retire(self) -> None:
        """Members that are pruned, failed or done leave the array (the module doc's rule)."""
        for k in reversed(range(len(self.live))):
            run = self.live[k]
            if run.error is None and not run.pruned and run.step < run.spec.total_steps:
                continue
            self._finish_run(k)
            self._remove_member(k)
            if self.on_member_end is not None:
                self.on_member_end(run.index, run.result, run.error)


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
        memory_plan: Keep / swap / recompute of the activations (:func:`plan_stacked_memory`
            for ``plan``), or ``None`` for Hydra's full recompute.

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
    return [results.get(index) for index in range(len(job.runs))]



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
    one = profile if profile is not None else profile_model(spec, plan.microbatch_size)
    stacked = stacked_profile(one, num_members, dropout_noise_bytes(spec))
    layers = TracedLayers(functools.partial(_traced_stack, spec, num_members), (num_members,),
                          _members_loss)
    return plan_memory(spec, plan, device=device, profile=stacked, bandwidth=bandwidth,
                       budget_bytes=budget_bytes, decisions=decisions, layers=layers)


def _members_loss(logits_K: Tensor, ids_K: Tensor) -> Tensor:
    """The sum of every member's loss (what a last stacked shard backpropagates)."""
    loss_K = vmap(causal_lm_loss)(logits_K, ids_K)
    assert isinstance(loss_K, Tensor)
    return loss_K.sum()


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
    layer, ``(K, b, ...)``, as :meth:`SpilledFusedJob._stacked_layer` unpacks it.
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


def _pack_mask(mask_K: Tensor) -> Tensor:
    """Bool masks ``(K, B, ...)`` packed 8 a byte per row: ``(K, B, ceil(n / 8))`` uint8.

    Bit ``j`` of byte ``i`` of a row is its element ``8 i + j`` (row-major); the row is padded
    with zeros to a multiple of 8. :meth:`SpilledFusedJob._noise` unpacks on the device.
    """
    num_members, num_rows = mask_K.shape[:2]
    flat = mask_K.reshape(num_members, num_rows, -1).to(torch.uint8)
    pad = -flat.shape[-1] % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(num_members, num_rows, pad)], dim=-1)
    bits = flat.view(num_members, num_rows, -1, 8).bitwise_left_shift(_BITS)
    return bits.sum(-1, dtype=torch.uint8)
