"""Spilled training of one job: shard tasks that promote, compute, update and demote.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device by *spilling*: the model is cut into shards
(:mod:`~sweepmaster.runtime.planning.partition`), and parameters, gradients and optimizer state
live on the host between uses (pinned on CUDA). One optimizer step of a job with shards ``0..S-1``
is ``2S - 1`` **shard tasks**:

* ``forward`` of shard ``i < S-1``: promote its parameters, run it without grad over every
  microbatch (Harmony's input-batch grouping: the resident shard serves the whole minibatch before
  it leaves), demote the boundary activations it produced (the only activations kept);
* ``backward`` of shard ``S-1`` (jit-compute): forward, loss and backward at once;
* ``backward`` of shard ``i < S-1``: promote, recompute its forward from the boundary input with
  the dropout RNG restored, backpropagate the boundary gradient, and step the optimizer for the
  shard while it is resident (Harmony's just-in-time update); demote parameters and state.

With a memory plan (:mod:`~sweepmaster.runtime.planning.memplan`, mu-TWO), a forward task instead
keeps each layer's autograd graph with its saved activations swapped to the host (a layer the plan
recomputes keeps only its input, checkpointed to the host), and the backward task fetches them
back layer by layer ahead of use, recomputing only those layers, with the dropout RNG replayed
from the layer's first random op (:mod:`~sweepmaster.runtime.training.layerpass`); the last shard
keeps on the device what fits.

A job's tasks run strictly in order, each on any device (all state is on the host between tasks),
so a scheduler (SHARP, Sharded-LRTF) can interleave the tasks of many jobs over many devices::

    job = SpilledJob(spec, plan, memory_plan=plan_memory(spec, plan, device=device))
    while (task := job.next_task()) is not None:
        job.prefetch(job.peek_task(), device)  # double buffering, optional
        job.run(task, device)
    result = job.result()

Exactness (``tests/runtime/training/test_conformance.py``): the numbers are those of
``train_plain``.

* Data order, init, LR schedule and optimizer math are plain's (``minibatch_indices``,
  ``build_optimizer`` over each shard's parameters, ``lr_factor``). Per-shard AdamW / SGD steps are
  elementwise, so they equal one optimizer over all parameters.
* Dropout: the job draws from its own generator, seeded like plain's stream (the CPU generator as
  left by the model build, or the CUDA device's generator seeded with ``spec.seed``). A
  ``TorchDispatchMode`` records the generator state before every random op of a shard's first pass
  and replays it for the other microbatches and the recompute. With microbatches, each random op
  draws the *whole minibatch's* tensor and keeps its rows, so masks equal those of plain's single
  full-batch pass (a transient of one full-batch mask; only the dropout ops ``bernoulli_`` and
  ``native_dropout`` are supported that way).
* Tied weights (GPT-2 ``wte`` / ``lm_head``): a parameter belongs to the first shard that uses
  it; later shards send their gradient contribution to the host, and the owner adds it before its
  one update per step.
* ``grad_clip``: the global norm needs every gradient, so backward tasks keep their gradients on
  the host and record per-tensor norms; shard 0, last, computes the total norm exactly as
  ``clip_grad_norm_`` does and updates at once; every other shard applies its clipped update the
  next time it is promoted: the next step, an evaluation, or ``update`` tasks after a step that
  ends the job or writes a checkpoint without evaluating
  (:func:`~sweepmaster.runtime.training.tasks.after_step_phase`).

Checkpoints (:mod:`~sweepmaster.runtime.training.training_state`): as in ``train_plain``, with
``spec.state_dir`` the job resumes from the newest intact checkpoint of the same job (written by
any path: weights by name, optimizer state per parameter name, the dropout stream), and with
``spec.checkpoint_every`` it writes one after every that many steps, once the step (and its
evaluation or the ``update`` tasks that apply the deferred clipped updates) is done.

Bookkeeping: the job's one trial is a
:class:`~sweepmaster.runtime.training.member_runs.MemberRun` (its metrics, events, pruning,
training seconds, checkpoints and result), kept by the trainer's bookkeeping exactly as a fused
array keeps each of its members
(:class:`~sweepmaster.runtime.training.bookkeeping.TrialBookkeeping`); what fails the trial (a
callback raising, a non-finite loss, a checkpoint that cannot be written) fails the job.

:class:`SpilledJob` is the one trainer
(:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`) over the members part of
one member, :class:`ModuleMember`: the module runs directly, so on CUDA its attention keeps
``torch``'s fused (flash) kernels.

Shape legend: B batch, b microbatch, T tokens per block, C hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.events import TrainCallbacks
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.flat import flat_views, flatten_slots
from sweepmaster.runtime.training.fused_optim import clip_coefficients
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.layers import decompose
from sweepmaster.runtime.training.member_runs import MemberRun
from sweepmaster.runtime.training.optimizers import optimizer_entry
from sweepmaster.runtime.training.plain import (
    HOST_RNG_LOCK,
    _check,
    build_optimizer,
    host_rng_guard,
    lr_factor,
    minibatch_indices,
    preserved_rng,
)
from sweepmaster.runtime.training.replay import JobRng, RandomReplay
from sweepmaster.runtime.training.shard_trainer import ShardTrainer
from sweepmaster.runtime.training.tasks import ShardTask, StateSlot, TensorKey
from sweepmaster.runtime.training.training_state import (
    TrainingState,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
)
from sweepmaster.workload.causal_lm import build_model, causal_lm_loss
from sweepmaster.workload.spec import TrainResult, TrainSpec

__all__ = ["ModuleMember", "SpilledJob", "train_spilled"]

class ModuleMember:
    """One member: the model's module run directly, its shards flat (the members part, K = 1).

    What a :class:`SpilledJob`'s parts read of its one trial
    (:class:`~sweepmaster.runtime.training.shard_members.ShardMembers`): the module's
    parameters and buffers are the tensors the job computes with (a promote installs its device
    copies as their data), its layers run as they are (on CUDA: ``torch``'s own attention
    kernels), a ``torch.optim`` optimizer per shard, its dropout recorded and replayed
    (:class:`~sweepmaster.runtime.training.replay.RandomReplay`).

    Args:
        spec: The job.
        plan: Its plan (shards, microbatch size); its device's type (``cpu`` or ``cuda``) fixes
            the job's RNG stream and host pinning, so its tasks must run on devices of that type.
        callbacks: Progress receiver, called on the thread running the task.

    Attributes:
        pad_attention: Run attention with dropout over the whole minibatch in microbatched
            passes (:class:`~sweepmaster.runtime.training.replay.FullBatchAttention`): ``None``
            (default) on CUDA only, where the dropout is drawn inside a fused kernel.

    Raises:
        ValueError: Invalid spec (see ``train_plain``), or a plan for another model.
    """

    row_dim = 0  # token ids and host boundaries are (B, ...)
    prefetches_within_step = False  # any task of the job's may be prefetched
    #: One trial: what fails it (a callback raising, a non-finite loss, a checkpoint that
    #: cannot be written) fails the job, raised from the task that met it.
    fail_alone = False
    job: ShardTrainer  # the trainer holding it (:meth:`bind`)

    def __init__(self, spec: TrainSpec, plan: JobPlan,
                 callbacks: TrainCallbacks | None = None) -> None:
        self.spec = spec
        self.plan = plan
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
        self.pad_attention: bool | None = None
        num_blocks, block_size = (int(n) for n in spec.train_data.shape)
        #: The job's one trial: its metrics, events, pruning, seconds and result.
        self.trial = MemberRun(0, spec, callbacks if callbacks is not None else TrainCallbacks())
        _check(spec, block_size, self.trial.eval_data)
        self.eval_data = self.trial.eval_data
        self.model, self.rng = _build(spec, self.device_type)
        self.stack = decompose(self.model)
        if plan.shards[-1].stop != len(self.stack):
            raise ValueError(
                f"plan has {plan.shards[-1].stop} layers, model {spec.name!r} has "
                f"{len(self.stack)}"
            )
        #: Shards whose optimizer state is all zeros still (the store's ``fresh_state``).
        self.fresh_shards: set[int] = set()
        self._init_shards()
        self.trial.num_parameters = sum(
            p.numel() for p in self.model.parameters() if p.requires_grad)
        self.runs, self.live = [self.trial], [self.trial]
        self.epochs: list[int] = []
        self.lrs: list[float] = []
        self._input_ids_BT = spec.train_data[:0]
        self._targets_BT: torch.Tensor | None = None  # with a loss mask: the step's labels
        resumed = self.trial.latest_state(self.device_type)
        if resumed is not None:
            self._resume(resumed)
        #: Step the job started (or resumed) from.
        self.resumed_from_step = self.step
        self._batches = minibatch_indices(num_blocks, spec.batch_size, spec.seed,
                                          start_step=self.step)
        self._tapes: dict[int, list[torch.Tensor]] = {}  # shard -> RNG state before each op

    def bind(self, job: ShardTrainer) -> None:
        """Be the members part of ``job`` (its shard store holds the installed copies)."""
        self.job = job

    # ------------------------------------------------------------------ task API

    @property
    def step(self) -> int:
        """Optimizer steps the job finished: its trial's (:attr:`MemberRun.step`)."""
        return self.trial.step

    @property
    def stopped(self) -> bool:
        """Whether the job was pruned (it runs no task after that)."""
        return self.trial.pruned

    def settle(self, device: Device) -> None:
        """Nothing: the trial's result is taken (:meth:`ShardTrainer.result`)."""
        del device

    # ------------------------------------------------------------------ checkpoints

    def _resume(self, state: TrainingState) -> None:
        """Continue from a checkpoint: weights, per-shard optimizer state, dropout stream."""
        self.model.load_state_dict(state.model)  # copies into the (pinned) host tensors
        for owned, optimizer in zip(self._owned, self._optimizers, strict=True):
            if optimizer is not None:
                names = [self._names[id(p)] for p in owned]
                load_optimizer_state_by_name(optimizer, state.optimizer, names)
        for shard in range(len(self.plan.shards)):
            self._flatten_state(shard)  # loading replaced the flat state
        self.rng.load_state(state.rng[f"dropout:{self.device_type}"])
        self.trial.resume(state)

    def member_state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """The trial's weights as its model's ``state_dict`` (CPU copies); ``index`` is 0."""
        del index
        self.job.store.settle_hosts()  # the host copies are read
        return {name: tensor.detach().to("cpu", copy=True)
                for name, tensor in self.model.state_dict().items()}

    def member_module(self, index: int) -> nn.Module:
        """The job's model, its weights on the host (to save them); ``index`` is 0."""
        del index
        self.job.store.settle_hosts()  # the host copies are read
        return self.model

    def member_training_state(self, index: int) -> TrainingState:
        """The job's training state (weights and optimizer state from the host); ``index`` 0.

        Call it between steps, with no clipped update deferred.
        """
        del index
        self.job.store.settle_hosts()  # the checkpoint reads the host copies
        names = self._names
        optimizer_state: dict[str, dict[str, Any]] = {}
        for owned, optimizer in zip(self._owned, self._optimizers, strict=True):
            if optimizer is not None:
                optimizer_state |= optimizer_state_by_name(
                    optimizer, [names[id(p)] for p in owned])
        return TrainingState(
            step=self.step, model=self.model.state_dict(), optimizer=optimizer_state,
            rng={f"dropout:{self.device_type}": self.rng.saved_state()},
            metrics=list(self.trial.metrics),
            elapsed_s=self.trial.seconds(self.job.bookkeeping.save_s),
        )

    # ------------------------------------------------------------------ sequence

    @property
    def num_steps(self) -> int:
        """The step the job trains to (``total_steps``)."""
        return self.spec.total_steps

    def evaluates_after(self, step: int) -> bool:
        """Whether the trial evaluates after ``step`` (a resumed job: not at its checkpoint)."""
        if step == self.resumed_from_step:  # a resumed job evaluated before its checkpoint
            return self.eval_data is not None and step == 0
        return self.trial.eval_due(step)

    def settles_after(self, step: int) -> bool:
        """Whether the trial ends or writes a checkpoint after ``step``."""
        return self.trial.settles(step)

    # ------------------------------------------------------------------ one trial's records

    def evaluated(self, run: MemberRun) -> bool:
        """Always: the evaluation that ran is the trial's."""
        del run
        return True

    def members_change(self) -> bool:
        """Never: one trial."""
        return False

    def after_start(self, task: ShardTask) -> None:
        """Nothing: the trial started."""
        del task

    def step_done(self) -> None:
        """Nothing: the trial's step counts the job's (the bookkeeping counts it)."""

    def at_step_boundary(self) -> None:
        """Nothing: one trial neither leaves nor is joined."""

    def updates(self, shard: int) -> bool:
        """Whether ``shard`` owns parameters to update (it has an optimizer)."""
        return self._optimizers[shard] is not None

    # ------------------------------------------------------------------ state

    def _init_shards(self) -> None:
        names = self.stack.parameter_names()
        order = {id(p): i for i, p in enumerate(self.model.parameters())}
        self._params: list[list[nn.Parameter]] = []
        self._resident: list[list[torch.Tensor]] = []  # promoted with the shard: params, buffers
        self._owned: list[list[nn.Parameter]] = []
        self._optimizers: list[torch.optim.Optimizer | None] = []
        owner: dict[int, int] = {}
        for index, shard in enumerate(self.plan.shards):
            seen: dict[int, nn.Parameter] = {}
            for layer in range(shard.start, shard.stop):
                for param in self.stack.layer_parameters(layer):
                    seen.setdefault(id(param), param)
            params = sorted(seen.values(), key=lambda p: order[id(p)])
            owned = [p for p in params if owner.setdefault(id(p), index) == index]
            layers = self.stack.layers[shard.start : shard.stop]
            frozen = {id(p): p for layer in layers for p in layer.parameters()
                      if not p.requires_grad}  # e.g. a LoRA base: promoted, never updated
            buffers = {id(b): b for layer in layers for b in layer.buffers()}
            self._params.append(params)
            self._resident.append([*params, *frozen.values(), *buffers.values()])
            self._owned.append(owned)
            self._optimizers.append(build_optimizer(owned, self.spec.optimizer) if owned else None)
        #: id(tensor) -> every tensor a shard promotes (its :data:`TensorKey`)
        self._tensors: dict[TensorKey, torch.Tensor] = {
            id(t): t for tensors in self._resident for t in tensors}
        self._names = names
        self._flatten_shards()

    def _flatten_shards(self) -> None:
        """Make every shard flat (:mod:`~sweepmaster.runtime.training.flat`).

        Per shard: its owned parameters in one buffer per dtype (an update changes them
        together: their write-back is one copy), its other tensors that no earlier shard holds
        (frozen parameters, buffers) in another, and its optimizer state (:meth:`_flatten_state`).
        A parameter of an earlier shard (a tied one) stays a view of that shard's buffer.
        """
        pin = self.device_type == "cuda"
        placed: set[int] = set()
        for shard in range(len(self.plan.shards)):
            owned = self._owned[shard]
            owned_ids = {id(p) for p in owned}
            rest = [t for t in self._resident[shard]
                    if id(t) not in placed and id(t) not in owned_ids]
            for group in (owned, rest):
                for tensor, view in zip(group, flat_views([t.data for t in group], pin),
                                        strict=True):
                    tensor.data = view
                    placed.add(id(tensor))
            self._flatten_state(shard)

    def _flatten_state(self, shard: int) -> None:
        """Make the shard's optimizer state (made now if it has none yet) flat, values kept.

        The state ``torch.optim`` would make at its first step, made before it: AdamW's zero
        moments and step 0, SGD's zero momentum buffer (with momentum; its first step
        ``0 * momentum + d`` is ``d``, the buffer ``torch.optim`` clones, exactly).
        """
        optimizer = self._optimizers[shard]
        if optimizer is None:
            return
        spec = self.spec.optimizer
        if any(optimizer.state.get(param) for param in self._owned[shard]):
            self.fresh_shards.discard(shard)  # e.g. loaded from a checkpoint
        else:
            self.fresh_shards.add(shard)  # zeros: its first promote copies nothing
        for param in self._owned[shard]:
            state = optimizer.state[param]
            if state:
                continue
            optimizer_entry(spec.name).fill_state(param, state, spec)
        flatten_slots(self.state_slots(shard), pin=self.device_type == "cuda")

    def shard_tensors(self, shard: int) -> list[torch.Tensor]:
        """The parameters and buffers a promote of ``shard`` copies to a device."""
        return list(self._resident[shard])

    # ------------------------------------------------------------------ compute

    def _layers(self, shard: int) -> list[nn.Module]:
        plan = self.plan.shards[shard]
        return list(self.stack.layers[plan.start : plan.stop])

    def _run_layers(self, shard: int, x: torch.Tensor,
                    overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the shard's layers on ``x``.

        ``overrides``: ``id(tensor) -> tensor`` used in place of those parameters or buffers
        (a pipeline pack's own copies of tied parameters another pack holds).
        """
        for layer in self._layers(shard):
            named = {} if not overrides else {
                name: overrides[id(t)] for name, t in _named_tensors(layer) if id(t) in overrides}
            x = torch.func.functional_call(layer, named, (x,)) if named else layer(x)
        return x

    def start_step(self, device: Device) -> None:
        """Start a training step: its minibatch (plain's data order), fresh dropout tapes."""
        del device
        epoch, index_B = next(self._batches)
        spec = self.spec.optimizer
        self.epochs = [epoch]
        self.lrs = [spec.lr * lr_factor(self.step, spec, self.spec.total_steps)]
        self._input_ids_BT = self.spec.train_data[index_B]
        if self.spec.train_mask is not None:
            self._targets_BT = self.spec.train_targets[index_B]
        self._tapes.clear()

    # ------------------------------------------------------------------ memory plan

    def labels(self) -> torch.Tensor:  # noqa: D102
        return self._input_ids_BT

    def layer_calls(self, shard: int, rows: slice,  # noqa: D102
                     device: Device) -> tuple[list[Layer], list[list[torch.Tensor]]]:
        layers = self._layers(shard)
        return list(layers), [self._resident[shard]] * len(layers)

    def task_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """The job's dropout stream, bound to ``device`` from a task's promote to its demote."""
        return self.rng.bound(device.torch_device)

    def compute_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        """Nothing: the passes meter in their replay mode."""
        return contextlib.nullcontext()  # the passes meter in their replay mode

    def pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
                   site: int = 0, rng: JobRng | None = None) -> RandomReplay:
        """The shard pass's dispatch mode: RNG record / replay, plus the device's metering.

        ``site``: replay from the shard's random op with this index (a layer's recompute).
        ``rng``: the stream to draw from (a pipeline's pack's copy), else the job's.
        """
        recording = record and mb == 0
        if recording:
            self._tapes[shard] = []
        meter = device.meter
        mode = RandomReplay(
            self.rng if rng is None else rng,
            self._tapes[shard],
            recording,
            rows,
            self.spec.batch_size,
            restore=not record,
            meter=meter if isinstance(meter, VirtualMeter) else None,
            pad_attention=self.pad_attention,
        )
        mode.site = site
        return mode

    def task_tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The module's own parameters and buffers (installed copies are their data)."""
        return self._tensors

    def idle_data(self, host: torch.Tensor) -> torch.Tensor:
        """The host copy: the module holds it between installs."""
        return host

    def run_shard(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],  # noqa: D102
                   x: torch.Tensor, rows: slice | None, device: Device,
                   overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        del tensors, rows, device  # the module's own tensors; the mode replays the dropout
        return self._run_layers(shard, x, overrides)

    def norms_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:  # noqa: D102
        return list(torch._foreach_norm(grads, 2.0))

    def schedule(self) -> int:  # noqa: D102
        return self.step

    def lm_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return causal_lm_loss(logits, ids)

    def update(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor], step: int,
                device: Device, clip_coef: torch.Tensor | None = None) -> None:
        """The shard's ``torch.optim`` step at ``step``'s learning rate, its state on ``device``.

        ``clip_coef``: the global clip coefficient on ``device`` (0-dim), multiplied into the
        gradients first (``grad_clip``).
        """
        del tensors, device  # the module's parameters, whatever their data
        optimizer = self._optimizers[shard]
        assert optimizer is not None
        owned = self._owned[shard]
        if clip_coef is not None:
            grads = [p.grad for p in owned]
            torch._foreach_mul_(grads, clip_coef)  # type: ignore[arg-type]
        spec = self.spec.optimizer
        optimizer.param_groups[0]["lr"] = spec.lr * lr_factor(step, spec, self.spec.total_steps)
        try:
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)

    def state_slots(self, shard: int) -> list[StateSlot]:
        """Each ``torch.optim`` state tensor of the shard's optimizer that moves (``_moves``)."""
        optimizer = self._optimizers[shard]
        assert optimizer is not None
        return [(state, key) for state in optimizer.state.values()
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and _moves(key, value)]

    @contextlib.contextmanager
    def eval_guard(self, device: Device) -> Iterator[None]:
        """The job's device RNG, untouched by an evaluation task (and locked on the CPU)."""
        with host_rng_guard(device.torch_device), preserved_rng(device.torch_device):
            yield

    # ------------------------------------------------------------------ per-shard interface

    @property
    def name(self) -> str:  # noqa: D102
        return self.spec.name

    @property
    def clips(self) -> bool:  # noqa: D102
        return self.spec.optimizer.grad_clip is not None

    def dropout_stream(self, state: torch.Tensor | None) -> JobRng | None:
        """A copy of the job's dropout stream from ``state`` (``None``: the job's own)."""
        return self.rng if state is None else JobRng(self.rng.device_type, state)

    def set_dropout_state(self, state: torch.Tensor) -> None:  # noqa: D102
        self.rng.load_state(state)

    def step_ids(self) -> torch.Tensor:  # noqa: D102
        return self._input_ids_BT

    def step_targets(self) -> torch.Tensor | None:  # noqa: D102
        return self._targets_BT

    def shard_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return [id(t) for t in self._resident[shard]]

    def owned_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return [id(p) for p in self._owned[shard]]

    def trainable(self, key: TensorKey) -> bool:  # noqa: D102
        return self._tensors[key].requires_grad

    def host_tensor(self, key: TensorKey) -> torch.Tensor:  # noqa: D102
        host = self.job.store.installed_host(key)
        return host if host is not None else self._tensors[key].data

    def clip_coefficient(self, norms: Mapping[TensorKey, torch.Tensor],  # noqa: D102
                         device: Device) -> torch.Tensor:
        ordered = [norms[id(p)] for p in self.model.parameters() if id(p) in norms]
        assert self.spec.optimizer.grad_clip is not None
        del device
        total_norm = torch.linalg.vector_norm(torch.stack(ordered), 2.0)
        return clip_coefficients(total_norm.reshape(1), [self.spec.optimizer.grad_clip])[0]

    def eval_ids(self) -> torch.Tensor:  # noqa: D102
        assert self.eval_data is not None
        return self.eval_data

    def eval_targets(self) -> torch.Tensor | None:  # noqa: D102
        return self.trial.eval_targets if self.spec.eval_mask is not None else None

    @contextlib.contextmanager
    def dropout_off(self, shard: int | None) -> Iterator[None]:  # noqa: D102
        layers = self.stack.layers if shard is None else self._layers(shard)
        modes = [layer.training for layer in layers]
        for layer in layers:
            layer.eval()
        try:
            yield
        finally:
            for layer, mode in zip(layers, modes, strict=True):
                layer.train(mode)


class SpilledJob(ShardTrainer):
    """A job of one member trained by shard tasks (see the module doc); one task at a time.

    The trainer (:class:`~sweepmaster.runtime.training.shard_trainer.ShardTrainer`) over one
    member (:class:`ModuleMember`, its ``members``).

    Args:
        spec: The job.
        plan: Its plan (shards, microbatch size); its device's type (``cpu`` or ``cuda``) fixes
            the job's RNG stream and host pinning, so its tasks must run on devices of that type.
        callbacks: Progress receiver, called on the thread running the task.
        memory_plan: Keep / swap / recompute of each shard's activations
            (:func:`~sweepmaster.runtime.planning.memplan.plan_memory` for ``plan``); ``None``:
            Hydra's full recompute. With a plan, a backward task on CUDA must run on the GPU that
            ran the shard's forward task (its saved graph is bound to that GPU); elsewhere it falls
            back to recomputing that shard.

    Raises:
        ValueError: Invalid spec (see ``train_plain``), a plan for another model, or a memory
            plan for another job plan.
    """

    members: ModuleMember

    def __init__(self, spec: TrainSpec, plan: JobPlan, callbacks: TrainCallbacks | None = None,
                 memory_plan: MemoryPlan | None = None) -> None:
        super().__init__(plan, spec.batch_size, memory_plan, ModuleMember(spec, plan, callbacks))


def train_spilled(
    spec: TrainSpec,
    device: Device,
    plan: JobPlan,
    callbacks: TrainCallbacks | None = None,
    *,
    prefetch: bool = True,
    memory_plan: MemoryPlan | Literal["auto"] | None = None,
) -> TrainResult:
    """Train one job on one device by spilling, its tasks in order (see the module doc).

    Args:
        spec: The job.
        device: Where its tasks run.
        plan: Its plan for ``device`` (``plan_job``).
        callbacks: Progress receiver.
        prefetch: Double-buffer: promote the next shard while the current one computes.
        memory_plan: Swap/recompute plan of the activations (``plan_memory(spec, plan)``),
            ``"auto"`` to plan it here for ``device``, or ``None`` for Hydra's full recompute.

    Returns:
        The result (``swap_bytes``, ``num_promotes``, ``num_demotes``, ``peak_device_bytes`` set).

    Raises:
        torch.OutOfMemoryError: A task did not fit the device.
        FloatingPointError: The train loss became non-finite.
        MemoryPlanError: ``"auto"`` found no plan within the device budget.
    """
    if memory_plan == "auto":
        memory_plan = plan_memory(spec, plan, device=device)
    elif isinstance(memory_plan, str):
        raise ValueError(f"memory_plan must be a MemoryPlan, 'auto' or None, got {memory_plan!r}")
    job = SpilledJob(spec, plan, callbacks, memory_plan)
    job.run_to_end(device, prefetch=prefetch)
    return job.result()


# ---------------------------------------------------------------------- helpers

def _named_tensors(layer: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's parameters and buffers by name, tied ones under every name."""
    yield from layer.named_parameters(remove_duplicate=False)
    yield from layer.named_buffers(remove_duplicate=False)


def _moves(key: str, value: torch.Tensor) -> bool:
    """Whether an optimizer-state tensor is promoted: all but AdamW's 0-dim host step counters.

    ``torch.optim.AdamW`` keeps its step counters on the host whatever the parameters' device,
    so a virtual device moves the same bytes as a GPU.
    """
    return not (key == "step" and value.dim() == 0 and value.device.type == "cpu")


def _build(spec: TrainSpec, device_type: str) -> tuple[nn.Module, JobRng]:
    """Plain's recipe steps 1-2 on the host; returns the model and the job's dropout stream."""
    with HOST_RNG_LOCK:
        host_state = torch.get_rng_state()
        torch.random.default_generator.manual_seed(spec.seed)
        model = build_model(spec.model, spec.dtype, spec.peft)
        if device_type == "cuda":
            torch.set_rng_state(host_state)
            generator = torch.Generator(device="cuda")
            generator.manual_seed(spec.seed)
            rng = JobRng("cuda", generator.get_state())
        else:
            rng = JobRng("cpu", torch.get_rng_state())
    model.train()
    return model, rng
