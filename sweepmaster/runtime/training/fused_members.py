"""A fused array's members: stacked into its host tensors, unstacked as they leave, joined late.

The members of a fused array (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`)
are built like plain training builds them (:func:`~sweepmaster.runtime.training.members.\
load_member`), then stacked ``(K, ...)`` into its host tensors (a LoRA adapter zero-padded to the
array's rank R; a LoRA base held once). :class:`StackedMembers` is a part the array's members
part (:class:`~sweepmaster.runtime.training.fused_spill.FusedMembers`, which runs them under
``vmap``) holds as ``stacked``: the stacking, a member's own view of its rows (its weights, its
model, its training state), and the members changing at step boundaries. It is built from the
members' specs and the plan (no hook of its holder's), and reads the trainer's parts (store,
compute, bookkeeping) once bound. Callers reach it as ``job.members.stacked``.

Checkpoints (:mod:`~sweepmaster.runtime.training.training_state`), per member as in
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

Members join (refill, :meth:`StackedMembers.join`, offered by a
:data:`~sweepmaster.runtime.training.member_runs.RefillHook`) at a step boundary, so an array keeps
its K slots busy while a sweep has trials to give: built as alone (seeded init, its own data order,
schedule, dropout stream and step count, or its checkpoint's) and stacked last into every host
tensor, with fresh optimizer state (zeros: what ``torch.optim`` starts from), up to the K the
stacked plan was made for and no wider than the member it was made for (the plan holds). The task
sequence is made again from the next task: the joiner's step-0 evaluation, then steps until the
last member ends; each member's own step is ``start + a - joined`` at array step ``a``. A join that
fails leaves the array as it was. Members never see each other's slices, so each, joined late or
not, ends with the weights of training it alone.

Shape legend: K members.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.flat import flat_views, flatten_slots
from sweepmaster.runtime.training.fused_optim import FusedOptimizer, build_fused_optimizer
from sweepmaster.runtime.training.fused_shards import StackedLayers, stacked_spec
from sweepmaster.runtime.training.member_runs import MemberEndHook, MemberRun, RefillHook
from sweepmaster.runtime.training.members import (
    SharedBases,
    load_member,
    lora_scale,
    meta_template,
    same_tensors,
    unpad,
    zero_pad,
)
from sweepmaster.runtime.training.plain import _check
from sweepmaster.runtime.training.training_state import (
    TrainingState,
    capture_rng,
    job_key,
    load_latest,
)
from sweepmaster.workload.architecture import check_fusable, fusion_group_key
from sweepmaster.workload.spec import TrainSpec

if TYPE_CHECKING:
    from sweepmaster.runtime.training.shard_trainer import ShardTrainer

__all__ = ["StackedMembers"]

_CPU = torch.device("cpu")


class StackedMembers:
    """A fused array's members over its stacked host tensors (the module doc).

    A part the array's members part
    (:class:`~sweepmaster.runtime.training.fused_spill.FusedMembers`, its ``stacked``) holds:
    it builds the members (like plain training, or from their checkpoints), stacks and
    unstacks them, and changes them at step boundaries (:meth:`join`, :meth:`retire`), reading
    the trainer's parts (its store, compute and bookkeeping) once bound (:meth:`bind`). Callers
    read the stacked tensors, the per-shard layout and the fused optimizers from it directly.

    Args:
        specs: The founding members, sharing one
            :func:`~sweepmaster.workload.architecture.fusion_group_key`.
        plan: The stacked plan for ``len(specs)`` members; its device's type (``cpu`` or
            ``cuda``) is where the members' generators and tensors are built.
        callbacks: One progress receiver (or ``None``) per member.
        on_member_end: Called when a member leaves: ``(index, result, error)``.
        refill: Asked at a step boundary for members to join.
        planned: The member the plan and the template were made for; ``None``:
            :func:`~sweepmaster.runtime.training.fused_shards.stacked_spec` of ``specs``.

    Raises:
        ValueError: Members that cannot fuse (LoRA members: whose frozen bases differ), members
            whose evaluation blocks differ in shape (or only some evaluate), an invalid spec, a
            member wider than ``planned``, a plan for another model (or made without
            ``grad_clip`` for clipping members), or a callback list of another length.

    Attributes:
        on_member_end: Called when a member leaves: ``(index, result, error)``.
        refill: Asked at a step boundary for members to join.
        planned_spec: The member the plan and the template were made for.
        num_slots: Members the plan holds (K of the stacked plan): joins never take the array
            past it.
        layers: The stacked layers of :attr:`planned_spec`.
        runs: Every member, in order of joining (its index: :attr:`MemberRun.index`).
        live: The members still training: ``live[k]`` is row k of every stacked tensor.
        params: The stacked trainable parameters ``(K, ...)`` by name, on the host.
        frozen: The frozen parameters (a LoRA base) by name: one host copy for every member.
        buffers: The stacked buffers ``(K, ...)`` by name, on the host.
        scaling_K: Each live member's LoRA scaling ``(K,)``.
        generators: Each live member's dropout generator.
        batches: Each live member's minibatches ``(epoch, indices (B,))``, in plain's order.
        shard_params: Per shard, the trainable parameters its layers use.
        shard_frozen: Per shard, the frozen parameters its layers use.
        shard_buffers: Per shard, the buffers its layers use.
        owned: Per shard, the parameters it updates (the first shard using each).
        optimizers: Per shard, its fused optimizer (``None``: it owns nothing).
        clipping: Whether some member clips its gradients (``grad_clip``).
        fresh_shards: Shards whose optimizer state is all zeros still (the store's
            ``fresh_state``).
        resumed_from_step: Per member (index in :attr:`runs`), the step it started (or
            resumed) from.
        joined_step: Per member, the array's steps when it joined (0: it founded the array).
    """

    job: ShardTrainer  # the trainer holding them (:meth:`bind`)

    def __init__(self, specs: list[TrainSpec], plan: JobPlan,
                 callbacks: Sequence[TrainCallbacks | None] | None, *,
                 on_member_end: MemberEndHook | None, refill: RefillHook | None,
                 planned: TrainSpec | None) -> None:
        members = list(callbacks) if callbacks is not None else [None] * len(specs)
        if not specs or len(members) != len(specs):
            raise ValueError(f"{len(specs)} specs but {len(members)} callbacks")
        check_fusable(specs)
        clipping = [spec.name for spec in specs if spec.optimizer.grad_clip is not None]
        if clipping and len(plan.shards) > 1 and not plan.grad_clip:
            raise ValueError(f"member {clipping[0]!r} clips gradients but the plan was made "
                             "without grad_clip: plan the array for a clipping member")
        self.plan = plan
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
        self.fresh_shards: set[int] = set()
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
        self.planned_spec = planned if planned is not None else stacked_spec(specs)
        wider = [reason for spec in specs if (reason := self._wider(spec)) is not None]
        if wider:
            raise ValueError(wider[0])
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
        self.resumed_from_step = [run.step for run in self.runs]
        self.joined_step = [0] * len(self.runs)
        self._array_step = 0  # steps of the array in this run (:attr:`step`)
        self._chain_start = 0  # the array step the task sequence was made at
        self._fresh = set(range(len(self.runs)))  # members whose start it begins with
        self._evaluate = evals[0] is not None  # whether the members evaluate
        self.clipping = bool(clipping)

    def bind(self, job: ShardTrainer) -> None:
        """Be the stacked members of ``job`` (its parts hold their copies, passes and records)."""
        self.job = job

    @property
    def step(self) -> int:
        """Steps of the array in this run (each member counts its own: ``MemberRun.step``)."""
        return self._array_step

    @property
    def num_members(self) -> int:
        """K, the members still in the array."""
        return len(self.live)

    def step_done(self) -> None:
        """The array's step count goes on (a training step's tasks ran)."""
        self._array_step += 1

    # ------------------------------------------------------------------ members

    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s weights (position in the array) as its model's ``state_dict``.

        A LoRA member's adapter has its own (unpadded) shapes; its base is the shared one.
        """
        self.job.store.settle_hosts()  # the host copies are read
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
        assert not self.job.compute.defers, "a clipped update is deferred"
        self.job.store.settle_hosts()  # the host copies are read (the optimizer state too)
        run = self.live[index]
        shapes = self._shapes[run.index]
        optimizer: dict[str, dict[str, Any]] = {}
        for owned, fused in zip(self.owned, self.optimizers, strict=True):
            if fused is not None:
                optimizer |= {
                    name: {key: unpad(value, shapes[name])
                           if isinstance(value, Tensor) and value.dim() else value
                           for key, value in entry.items()}
                    for name, entry in fused.member_state(index, owned).items()
                }
        return TrainingState(
            step=run.step, model=self.member_state_dict(index), optimizer=optimizer,
            rng=capture_rng(torch.device(self.device_type), self.generators[index]),
            metrics=list(run.metrics), elapsed_s=run.seconds(self.job.bookkeeping.save_s),
        )

    def member_module(self, index: int) -> nn.Module:
        """A standalone CPU model holding member ``index``'s weights (to checkpoint it).

        A LoRA member's model carries its own unpadded adapter and PEFT config (it saves in
        PEFT's format); its frozen base shares the array's host tensors (not copied).
        """
        self.job.store.settle_hosts()  # the host copies are read
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
        self.generators: list[torch.Generator] = []
        self.batches: list[Iterator[tuple[int, Tensor]]] = []
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
            self.generators.append(member.generator)
            self.batches.append(member.batches)
        # laid out flat per shard below (:meth:`_flatten`), pinned on CUDA
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
        self.scaling_K = torch.tensor([lora_scale(spec) for spec in specs], dtype=torch.float32)
        order = {name: i for i, name in enumerate(self.params)}
        owner: dict[str, int] = {}
        self.shard_params: list[list[str]] = []
        self.shard_frozen: list[list[str]] = []
        self.shard_buffers: list[list[str]] = []
        self.owned: list[list[str]] = []
        self.optimizers: list[FusedOptimizer | None] = []
        trainable = set(self.layers.param_names)
        for index, shard in enumerate(self.plan.shards):
            layers = range(shard.start, shard.stop)
            names = {n for i in layers for n in self.layers.layer_params(i)}
            params = sorted((n for n in names if n in trainable), key=order.__getitem__)
            owned = [n for n in params if owner.setdefault(n, index) == index]
            self.shard_params.append(params)
            self.shard_frozen.append(sorted(names & self.layers.frozen_names))
            self.shard_buffers.append(list(dict.fromkeys(
                b for i in range(shard.start, shard.stop) for b in self.layers.layer_buffers(i)
            )))
            self.owned.append(owned)
            if not owned:
                self.optimizers.append(None)
                continue
            fused = build_fused_optimizer([s.optimizer for s in specs], _CPU)
            for k, state in enumerate(states):
                if state is not None:
                    fused.load_member_state(k, [self.params[n] for n in owned], state.optimizer,
                                            owned)
            self.optimizers.append(fused)
            if all(state is None for state in states):  # zeros: its first promote copies nothing
                self.fresh_shards.add(index)
        self._flatten()

    def _flatten(self) -> None:
        """Make every shard flat (:mod:`~sweepmaster.runtime.training.flat`), values kept.

        Per shard: its owned stacked parameters in one buffer per dtype (an update changes them
        together: their write-back is one copy), its buffers no earlier shard holds in another,
        and its optimizer state (made now as the first step would:
        :meth:`~sweepmaster.runtime.training.fused_optim.FusedOptimizer.make_state`). The
        frozen base stays as it is: its host tensors may be shared with other arrays.
        Called again whenever the stacked tensors are remade (a member joins or leaves).
        """
        pin = self.device_type == "cuda"
        placed: set[str] = set()
        for shard, owned in enumerate(self.owned):
            rest = [n for n in self.shard_buffers[shard] if n not in placed]
            for names, tensors in ((owned, self.params), (rest, self.buffers)):
                views = flat_views([tensors[n] for n in names], pin)
                tensors.update(zip(names, views, strict=True))
                placed.update(names)
            optimizer = self.optimizers[shard]
            if optimizer is not None:
                optimizer.make_state([self.params[n] for n in owned])
                flatten_slots([(state, key) for state in optimizer.state for key in state], pin)

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
        if spec.optimizer.grad_clip is not None and not self.clipping:
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
             callbacks: TrainCallbacks | None = None, *, key: str | None = None) -> int:
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
            key: :func:`~sweepmaster.runtime.training.training_state.job_key` of ``spec`` when
                computed already (``""`` without a ``state_dir``); ``None``: computed here.

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
        if reason is None and self.job.compute.defers:
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
            scaling_K = torch.cat([self.scaling_K, torch.tensor([lora_scale(spec)])])
        index = len(self.live)
        undo = [optimizer.undo_point() for optimizer in self.optimizers
                if optimizer is not None]
        try:
            for owned, optimizer in zip(self.owned, self.optimizers, strict=True):
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
        self.params, self.buffers, self.scaling_K = params, buffers_K, scaling_K
        self._flatten()
        if state is not None:  # its loaded optimizer state is not zero
            self.job.store.fresh_state.clear()
        self.job.compute.forget_parked()  # of K members; none is deferred now
        if state is not None:
            run.resume(state)
        if key is None:
            key = job_key(spec) if spec.state_dir is not None else ""
        run.key = key
        run.num_parameters = sum(shape.numel() for shape in member.shapes.values())
        self.runs.append(run)
        self.live.append(run)
        self.resumed_from_step.append(run.step)
        self.joined_step.append(self.step)
        self._shapes.append(member.shapes)
        self.generators.append(member.generator)
        self.batches.append(member.batches)
        if self._chain_start != self.step:
            self._fresh.clear()
        self._fresh.add(run.index)
        self._chain_start = self.step
        self.job.rechain()
        if self.job.bookkeeping.started:
            run.begin(self.job.store.device_name, self.job.bookkeeping.save_s)
        return run.index

    def _unhold(self) -> None:
        """Make the host copies whole and drop the prefetched copies (of K rows)."""
        self.job.store.settle_hosts()
        self.job.store.drop_prefetched()

    def _remove_member(self, index: int) -> None:
        """Unfuse between steps: drop row ``index`` of every stacked host tensor."""
        self._unhold()
        keep_K = torch.tensor([k for k in range(len(self.live)) if k != index], dtype=torch.long)
        self.params = {n: p.index_select(0, keep_K) for n, p in self.params.items()}
        self.buffers = {n: b.index_select(0, keep_K) for n, b in self.buffers.items()}
        self.scaling_K = self.scaling_K.index_select(0, keep_K)
        for optimizer in self.optimizers:
            if optimizer is not None:
                optimizer.remove_member(index)
        self._flatten()
        self.job.compute.keep_members(keep_K, index)
        self.generators.pop(index)
        self.batches.pop(index)
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

    def evaluates_after(self, step: int) -> bool:  # noqa: D102
        return any(self._eval_due(run.index, step) and self._in_phase(run.index, step)
                   for run in self.runs if run.error is None)

    def evaluated(self, run: MemberRun) -> bool:  # noqa: D102
        return self._eval_due(run.index, self.step) and self._in_phase(run.index, self.step)

    def settles_after(self, step: int) -> bool:  # noqa: D102
        return any(run.settles(self.resumed_from_step[run.index] + step
                               - self.joined_step[run.index]) for run in self.runs)

    # ------------------------------------------------------------------ step boundaries

    def members_change(self) -> bool:
        """Whether a member leaves the array, or one may join, at the step boundary now."""
        leaves = any(run.error is not None or run.pruned or run.step >= run.spec.total_steps
                     for run in self.live)
        return leaves or (self.refill is not None and len(self.live) < self.num_slots)

    def at_step_boundary(self) -> None:
        """A step boundary, its checkpoints due written: members leave, members join.

        The boundary may come twice at one step: again after the evaluation of members that
        joined there (its checkpoints are written once).
        """
        self._fresh.clear()
        self.retire()
        while self._join_offered():
            self.retire()

    def _join_offered(self) -> bool:
        """Fill the free slots with the members ``refill`` offers; whether it offered any."""
        free = self.num_slots - len(self.live)
        if self.refill is None or free <= 0 or self.job.compute.defers:
            return False
        offered = self.refill(free, self.step)
        for spec, callbacks in offered:
            try:
                key = job_key(spec) if spec.state_dir is not None else ""
                state = load_latest(spec.state_dir, key, self.device_type) if key else None
                self.join(spec, state, callbacks, key=key)
            except Exception as exc:  # it cannot join (or its checkpoint is unreadable)
                run = MemberRun(len(self.runs), spec, TrainCallbacks(), error=exc)
                self.runs.append(run)
                self.resumed_from_step.append(0)
                self.joined_step.append(self.step)
                self._shapes.append({})
                if self.on_member_end is not None:
                    self.on_member_end(run.index, None, exc)
        return bool(offered)

    def retire(self) -> None:
        """Members that are pruned, failed or done leave the array (the module doc's rule)."""
        for k in reversed(range(len(self.live))):
            run = self.live[k]
            if run.error is None and not run.pruned and run.step < run.spec.total_steps:
                continue
            self.job.bookkeeping.finish_run(k)
            self._remove_member(k)
            if self.on_member_end is not None:
                self.on_member_end(run.index, run.result, run.error)
