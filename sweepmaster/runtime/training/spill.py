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

Exactness (DESIGN, "Exactness"): the numbers are those of ``train_plain``.

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
  (:func:`~sweepmaster.runtime.training.chain.after_step_phase`).

Checkpoints (:mod:`~sweepmaster.runtime.training.checkpoint`): as in ``train_plain``, with
``spec.state_dir`` the job resumes from the newest intact checkpoint of the same job (written by
any path: weights by name, optimizer state per parameter name, the dropout stream), and with
``spec.checkpoint_every`` it writes one after every that many steps, once the step (and its
evaluation or the ``update`` tasks that apply the deferred clipped updates) is done.

Shape legend: B batch, b microbatch, T tokens per block, C hidden, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.meter import VirtualMeter
from sweepmaster.runtime.execution.events import EvalEvent, StartEvent, StepEvent, TrainCallbacks
from sweepmaster.runtime.planning.memplan import MemoryPlan, plan_memory
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.chain import (
    ShardChain,
    ShardTask,
    StateSlot,
    TensorKey,
)
from sweepmaster.runtime.training.checkpoint import (
    TrainingState,
    job_key,
    load_latest,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    save_checkpoint,
)
from sweepmaster.runtime.training.fused_optim import clip_coefficients
from sweepmaster.runtime.training.layerpass import Layer
from sweepmaster.runtime.training.layers import decompose
from sweepmaster.runtime.training.plain import (
    _THROUGHPUT_WINDOW_STEPS,
    HOST_RNG_LOCK,
    _check,
    build_optimizer,
    host_rng_guard,
    lr_factor,
    minibatch_indices,
    preserved_rng,
)
from sweepmaster.runtime.training.replay import JobRng, RandomReplay
from sweepmaster.workload.models import build_model, causal_lm_loss, save_weights
from sweepmaster.workload.spec import MetricPoint, TrainResult, TrainSpec

__all__ = ["SpilledJob", "train_spilled"]

class SpilledJob(ShardChain):
    """A job trained by shard tasks (see the module doc); one task at a time, any thread.

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

    Attributes:
        pad_attention: Run attention with dropout over the whole minibatch in microbatched
            passes (:class:`~sweepmaster.runtime.training.replay.FullBatchAttention`): ``None``
                (default)
            on CUDA only, where the dropout is drawn inside a fused kernel.

    Raises:
        ValueError: Invalid spec (see ``train_plain``), a plan for another model, or a memory
            plan for another job plan.
    """

    def __init__(
        self,
        spec: TrainSpec,
        plan: JobPlan,
        callbacks: TrainCallbacks | None = None,
        memory_plan: MemoryPlan | None = None,
    ) -> None:
        super().__init__(plan, spec.batch_size, memory_plan)
        self.spec = spec
        self.pad_attention: bool | None = None
        self.callbacks = callbacks if callbacks is not None else TrainCallbacks()
        num_blocks, block_size = (int(n) for n in spec.train_data.shape)
        eval_data = spec.eval_data
        if eval_data is not None and spec.eval_max_blocks is not None:
            eval_data = eval_data[: spec.eval_max_blocks]
        _check(spec, block_size, eval_data)
        self.eval_data = eval_data
        self.model, self.rng = _build(spec, self.device_type)
        self.stack = decompose(self.model)
        if plan.shards[-1].stop != len(self.stack):
            raise ValueError(
                f"plan has {plan.shards[-1].stop} layers, model {spec.name!r} has "
                f"{len(self.stack)}"
            )
        self._init_shards()
        self.step = 0
        self.pruned = False
        self.metrics: list[MetricPoint] = []
        self.step_swap_bytes: list[int] = []  # bytes moved by each training step's tasks
        self._input_ids_BT = spec.train_data[:0]
        self._epoch = 0
        self._earlier_s = 0.0  # training seconds of earlier runs (resumed)
        self._save_s = 0.0  # seconds spent writing checkpoints (not training)
        self._key = job_key(spec) if spec.state_dir is not None else ""
        resumed = load_latest(spec.state_dir, self._key, self.device_type) if self._key else None
        if resumed is not None:
            self._resume(resumed)
        #: Step the job started (or resumed) from.
        self.resumed_from_step = self.step
        self._last_saved = self.step
        self._batches = minibatch_indices(num_blocks, spec.batch_size, spec.seed,
                                          start_step=self.step)
        # Host boundaries, whole minibatch (B, ...) so shards may use different microbatches:
        self._acts: dict[int, torch.Tensor] = {}  # shard -> its input
        self._grads: dict[int, torch.Tensor] = {}  # shard -> gradient of its output
        self._eval_acts: dict[int, torch.Tensor] = {}  # shard -> its input, all eval blocks
        self._tapes: dict[int, list[torch.Tensor]] = {}  # shard -> RNG state before each op
        self._losses = []
        self._started = False
        self._start_time = 0.0
        self._step_start = 0.0
        self._window: deque[tuple[float, int]] = deque(maxlen=_THROUGHPUT_WINDOW_STEPS)

    # ------------------------------------------------------------------ task API

    @property
    def stopped(self) -> bool:
        """Whether the job was pruned (it runs no task after that)."""
        return self.pruned

    @property
    def remaining_seconds(self) -> float:
        """Estimated seconds of the job's remaining training steps (the Sharded-LRTF key)."""
        step_s = self.plan.step_s if self.memory_plan is None else self.memory_plan.step_s
        return (self.spec.total_steps - self.step) * step_s

    def result(self) -> TrainResult:
        """The job's result, once :meth:`next_task` returns ``None`` (see ``train_plain``)."""
        assert self.next_task() is None, "the job still has tasks"
        self._settle_hosts()  # the host copies are read
        train_seconds = self._earlier_s + (
            time.perf_counter() - self._start_time - self._save_s if self._started else 0.0)
        checkpoint_path = None
        if self.spec.checkpoint_dir is not None and not self.pruned:
            checkpoint_path = save_weights(self.model, self.spec.checkpoint_dir)
        metric = self.spec.metric if self.eval_data is not None else "train_loss"
        values = [point.value for point in self.metrics if point.name == metric]
        return self._counted(TrainResult(
            objective=values[-1] if values else math.nan,
            metrics=self.metrics,
            state_dict={
                name: tensor.detach().to("cpu", copy=True)
                for name, tensor in self.model.state_dict().items()
            },
            steps=self.step,
            tokens=self.step * self.spec.tokens_per_step,
            train_seconds=train_seconds,
            pruned=self.pruned,
            checkpoint_path=checkpoint_path,
        ))

    # ------------------------------------------------------------------ checkpoints

    def _resume(self, state: TrainingState) -> None:
        """Continue from a checkpoint: weights, per-shard optimizer state, dropout stream."""
        self.model.load_state_dict(state.model)  # copies into the (pinned) host tensors
        for owned, optimizer in zip(self._owned, self._optimizers, strict=True):
            if optimizer is not None:
                names = [self._names[id(p)] for p in owned]
                load_optimizer_state_by_name(optimizer, state.optimizer, names)
        self.rng.load_state(state.rng[f"dropout:{self.device_type}"])
        self.step = state.step
        self.metrics = list(state.metrics)
        self._earlier_s = state.elapsed_s
        self._epoch = state.data_position(self.spec.steps_per_epoch)[0]

    def _eval_due(self, step: int) -> bool:
        every = self.spec.eval_every
        return self.eval_data is not None and (
            step == self.spec.total_steps or (every is not None and step % every == 0))

    def checkpoint_due(self, task: ShardTask) -> bool:
        """Whether a checkpoint is due once ``task`` (the job's last) has run.

        Due at the end of a step whose number passed a multiple of ``checkpoint_every`` since
        the last one (a deferred clipped update may have held back the boundary at the multiple
        itself; see the module doc), after the step's evaluation if it has one.
        """
        every = self.spec.checkpoint_every
        if every is None or self.pruned or self.step == self._last_saved:
            return False
        if task.phase in ("eval", "update"):
            boundary = task.shard == len(self._params) - 1
        else:
            boundary = (task.phase == "train" and task.kind == "backward" and task.shard == 0
                        and not self._eval_due(self.step))
        return boundary and self.step // every != self._last_saved // every

    def write_checkpoint(self) -> None:
        """Write the job's training state now (weights and optimizer state from the host).

        Raises:
            OSError: The checkpoint could not be written.
        """
        start = time.perf_counter()
        self._settle_hosts()  # the checkpoint reads the host copies
        names = self._names
        optimizer_state: dict[str, dict[str, Any]] = {}
        for owned, optimizer in zip(self._owned, self._optimizers, strict=True):
            if optimizer is not None:
                optimizer_state |= optimizer_state_by_name(
                    optimizer, [names[id(p)] for p in owned])
        elapsed = self._earlier_s + time.perf_counter() - self._start_time - self._save_s
        state = TrainingState(
            step=self.step, model=self.model.state_dict(), optimizer=optimizer_state,
            rng={f"dropout:{self.device_type}": self.rng.saved_state()},
            metrics=list(self.metrics), elapsed_s=elapsed,
        )
        assert self.spec.state_dir is not None
        save_checkpoint(self.spec.state_dir, state, self._key, keep=self.spec.keep_checkpoints)
        self._last_saved = self.step
        self._save_s += time.perf_counter() - start

    # ------------------------------------------------------------------ sequence

    @property
    def num_steps(self) -> int:
        """The step the job trains to (``total_steps``)."""
        return self.spec.total_steps

    def _evaluates_after(self, step: int) -> bool:
        if step == self.resumed_from_step:  # a resumed job evaluated before its checkpoint
            return self.eval_data is not None and step == 0
        return self._eval_due(step)

    def _settles_after(self, step: int) -> bool:
        every = self.spec.checkpoint_every if self._key else None
        return step == self.spec.total_steps or (every is not None and step % every == 0)

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
        self.device_name = self.plan.device

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
        self._step_start = time.perf_counter()
        self._epoch, index_B = next(self._batches)
        self._input_ids_BT = self.spec.train_data[index_B]
        self._tapes.clear()

    # ------------------------------------------------------------------ memory plan

    def _labels(self) -> torch.Tensor:
        return self._input_ids_BT

    def _layer_calls(self, shard: int, rows: slice,
                     device: Device) -> tuple[list[Layer], list[list[torch.Tensor]]]:
        layers = self._layers(shard)
        return list(layers), [self._resident[shard]] * len(layers)

    def _task_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        return self.rng.bound(device.torch_device)

    def _compute_mode(self, device: Device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the passes meter in their replay mode

    def _pass_mode(self, shard: int, mb: int, rows: slice, record: bool, device: Device,
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

    def _task_tensors(self) -> Mapping[TensorKey, torch.Tensor]:
        """The module's own parameters and buffers (installed copies are their data)."""
        return self._tensors

    def _idle_data(self, host: torch.Tensor) -> torch.Tensor:
        """The host copy: the module holds it between installs."""
        return host

    def _run_shard(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                   x: torch.Tensor, rows: slice | None, device: Device,
                   overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        del tensors, rows, device  # the module's own tensors; the mode replays the dropout
        return self._run_layers(shard, x, overrides)

    def _norms_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch._foreach_norm(grads, 2.0))

    def _schedule(self) -> int:
        return self.step

    def _lm_loss(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(logits, ids)

    def _update(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor], step: int,
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

    def _state_slots(self, shard: int) -> list[StateSlot]:
        """Each ``torch.optim`` state tensor of the shard's optimizer that moves (``_moves``)."""
        optimizer = self._optimizers[shard]
        assert optimizer is not None
        return [(state, key) for state in optimizer.state.values()
                for key, value in state.items()
                if isinstance(value, torch.Tensor) and _moves(key, value)]

    @contextlib.contextmanager
    def _eval_guard(self, device: Device) -> Iterator[None]:
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

    def host_due(self, task: ShardTask) -> bool:  # noqa: D102
        return self.checkpoint_due(task)

    def end_tasks(self, task: ShardTask, device: Device) -> None:
        """Write a checkpoint if ``task`` ended a due step (and its evaluation, if any)."""
        del device
        if not self._pending and self.checkpoint_due(task):
            self.write_checkpoint()

    def shard_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return [id(t) for t in self._resident[shard]]

    def owned_keys(self, shard: int) -> list[TensorKey]:  # noqa: D102
        return [id(p) for p in self._owned[shard]]

    def trainable(self, key: TensorKey) -> bool:  # noqa: D102
        return self._tensors[key].requires_grad

    def host_tensor(self, key: TensorKey) -> torch.Tensor:  # noqa: D102
        return self._host_data.get(key, self._tensors[key].data)

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

    @contextlib.contextmanager
    def _dropout_off(self, shard: int | None) -> Iterator[None]:
        layers = self.stack.layers if shard is None else self._layers(shard)
        modes = [layer.training for layer in layers]
        for layer in layers:
            layer.eval()
        try:
            yield
        finally:
            for layer, mode in zip(layers, modes, strict=True):
                layer.train(mode)

    # ------------------------------------------------------------------ bookkeeping

    def start(self, device: Device, task: ShardTask) -> None:  # noqa: D102
        del task
        self._started = True
        self._start_time = time.perf_counter()
        self.callbacks.on_start(
            StartEvent(
                job=self.spec.name,
                total_steps=self.spec.total_steps,
                device=device.name,
                num_parameters=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
                resumed_from_step=self.resumed_from_step,
            )
        )

    def _finish_step(self, device: Device) -> None:
        self.step += 1
        (train_loss,) = self._train_losses()
        spec = self.spec.optimizer
        lr = spec.lr * lr_factor(self.step - 1, spec, self.spec.total_steps)
        if not math.isfinite(train_loss):
            raise FloatingPointError(
                f"job {self.spec.name!r}: non-finite train loss {train_loss} at step {self.step}"
            )
        self.step_swap_bytes.append(self._task_swap)
        self._task_swap = 0
        self._window.append((time.perf_counter() - self._step_start, self.spec.tokens_per_step))
        tokens_per_s = sum(n for _, n in self._window) / max(sum(s for s, _ in self._window), 1e-9)
        self.metrics.append(MetricPoint(self.step, "train_loss", train_loss))
        self.metrics.append(MetricPoint(self.step, "lr", lr))
        self.metrics.append(MetricPoint(self.step, "tokens_per_s", tokens_per_s))
        self.callbacks.on_step(
            StepEvent(
                job=self.spec.name,
                step=self.step,
                total_steps=self.spec.total_steps,
                epoch=self._epoch,
                train_loss=train_loss,
                lr=lr,
                tokens_per_s=tokens_per_s,
                device=device.name,
            )
        )

    def finish_eval(self) -> None:  # noqa: D102
        (eval_loss,) = self._eval_losses()
        eval_perplexity = math.exp(eval_loss) if eval_loss < 700 else math.inf
        self.metrics.append(MetricPoint(self.step, "eval_loss", eval_loss))
        self.metrics.append(MetricPoint(self.step, "eval_perplexity", eval_perplexity))
        event = EvalEvent(
            self.spec.name, self.step, self.spec.total_steps, eval_loss, eval_perplexity
        )
        self.pruned = bool(self.callbacks.on_eval(event))


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
