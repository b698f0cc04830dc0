"""Spilled training of one job: shard tasks that promote, compute, update and demote.

Hydra (Nagrecha & Kumar 2022, https://arxiv.org/abs/2110.08633) trains a model larger than a
device by *spilling*: the model is cut into shards (:mod:`~sweepmaster.runtime.partition`), and
parameters, gradients and optimizer state live on the host between uses (pinned on CUDA). One
optimizer step of a job with shards ``0..S-1`` is ``2S - 1`` **shard tasks**:

* ``forward`` of shard ``i < S-1``: promote its parameters, run it without grad over every
  microbatch (Harmony's input-batch grouping: the resident shard serves the whole minibatch before
  it leaves), demote the boundary activations it produced (the only activations kept);
* ``backward`` of shard ``S-1`` (jit-compute): forward, loss and backward at once;
* ``backward`` of shard ``i < S-1``: promote, recompute its forward from the boundary input with
  the dropout RNG restored, backpropagate the boundary gradient, and step the optimizer for the
  shard while it is resident (Harmony's just-in-time update); demote parameters and state.

A job's tasks run strictly in order, each on any device (all state is on the host between tasks),
so a scheduler (SHARP, Sharded-LRTF) can interleave the tasks of many jobs over many devices::

    job = SpilledJob(spec, plan)
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
  next time it is promoted (next step, evaluation, or a final ``update`` task).

Shape legend: B batch, b microbatch, T tokens per block, C hidden, V vocabulary.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sweepmaster.runtime.device import Device
from sweepmaster.runtime.events import EvalEvent, StartEvent, StepEvent, TrainCallbacks
from sweepmaster.runtime.layers import decompose
from sweepmaster.runtime.meter import VirtualMeter
from sweepmaster.runtime.partition import JobPlan
from sweepmaster.runtime.plain import (
    _HOST_RNG_LOCK,
    _THROUGHPUT_WINDOW_STEPS,
    _check,
    _host_rng_guard,
    _preserved_rng,
    build_optimizer,
    lr_factor,
    minibatch_indices,
)
from sweepmaster.workload.models import build_model, causal_lm_loss, save_weights
from sweepmaster.workload.spec import MetricPoint, TrainResult, TrainSpec

__all__ = ["ShardTask", "SpilledJob", "train_spilled"]

TaskKind = Literal["forward", "backward"]
TaskPhase = Literal["train", "eval", "update"]


@dataclass(frozen=True)
class ShardTask:
    """One shard task of one job: the unit a scheduler places on a device.

    Attributes:
        job_id: The job's name (``TrainSpec.name``).
        seq: Position in the job's task sequence (tasks run in ``seq`` order).
        step: Optimizer steps the job had finished when the task was issued.
        shard: The shard index.
        kind: ``"forward"`` or ``"backward"`` (evaluation is forward; a final deferred update
            is backward).
        phase: ``"train"``, ``"eval"`` or ``"update"``.
        est_seconds: Estimated run time (from the plan).
        promote_bytes: Parameter bytes promoted at the start (from the plan).
    """

    job_id: str
    seq: int
    step: int
    shard: int
    kind: TaskKind
    phase: TaskPhase
    est_seconds: float
    promote_bytes: int


class SpilledJob:
    """A job trained by shard tasks (see the module doc); one task at a time, any thread.

    Args:
        spec: The job.
        plan: Its plan (shards, microbatch size); its device's type (``cpu`` or ``cuda``) fixes
            the job's RNG stream and host pinning, so its tasks must run on devices of that type.
        callbacks: Progress receiver, called on the thread running the task.

    Raises:
        ValueError: Invalid spec (see ``train_plain``), or a plan for another model.
    """

    def __init__(
        self, spec: TrainSpec, plan: JobPlan, callbacks: TrainCallbacks | None = None
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.callbacks = callbacks if callbacks is not None else TrainCallbacks()
        num_blocks, block_size = (int(n) for n in spec.train_data.shape)
        eval_data = spec.eval_data
        if eval_data is not None and spec.eval_max_blocks is not None:
            eval_data = eval_data[: spec.eval_max_blocks]
        _check(spec, block_size, eval_data)
        self.eval_data = eval_data
        self.device_type = "cuda" if plan.device.startswith("cuda") else "cpu"
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
        self.swap_bytes = 0
        self.num_promotes = 0
        self.num_demotes = 0
        self.peak_device_bytes = 0
        self.step_swap_bytes: list[int] = []  # bytes moved by each training step's tasks
        self._batches = minibatch_indices(num_blocks, spec.batch_size, spec.seed)
        self._input_ids_BT = spec.train_data[:0]
        self._epoch = 0
        # Host boundaries, whole minibatch (B, ...) so shards may use different microbatches:
        self._acts: dict[int, torch.Tensor] = {}  # shard -> its input
        self._grads: dict[int, torch.Tensor] = {}  # shard -> gradient of its output
        self._eval_acts: dict[int, torch.Tensor] = {}  # shard -> its input, all eval blocks
        self._tapes: dict[int, list[torch.Tensor]] = {}  # shard -> RNG state before each op
        self._losses: list[tuple[float, float]] = []
        self._eval_sum = 0.0
        self._norms: dict[int, torch.Tensor] = {}
        self._clip_coef: torch.Tensor | None = None
        self._pending: dict[int, int] = {}  # shard -> step whose clipped update is pending
        self._future = deque[ShardTask]()
        self._tasks = self._task_sequence()
        self._prefetched: dict[int, tuple[str, concurrent.futures.Future[Any]]] = {}
        self._started = False
        self._start_time = 0.0
        self._step_start = 0.0
        self._window: deque[tuple[float, int]] = deque(maxlen=_THROUGHPUT_WINDOW_STEPS)

    # ------------------------------------------------------------------ task API

    def next_task(self) -> ShardTask | None:
        """The next task to run, or ``None`` when the job is finished (or pruned)."""
        return None if self.pruned else self.peek_task(0)

    def peek_task(self, ahead: int = 1) -> ShardTask | None:
        """The task ``ahead`` positions after the next one (if the job is not pruned)."""
        while len(self._future) <= ahead:
            task = next(self._tasks, None)
            if task is None:
                return None
            self._future.append(task)
        return self._future[ahead]

    @property
    def remaining_seconds(self) -> float:
        """Estimated seconds of the job's remaining training steps (the Sharded-LRTF key)."""
        return (self.spec.total_steps - self.step) * self.plan.step_s

    def prefetch(
        self, task: ShardTask | None, device: Device, *, headroom_bytes: int | None = None
    ) -> None:
        """Start promoting ``task``'s parameters to ``device`` in the background.

        Two cases of Hydra's double buffering:

        * ``task`` follows the job's next task (``peek_task()``): only when the plan allows it
          (the next task's peak plus this shard fits the budget) and the shard shares no
          parameter with the shard resident then;
        * ``task`` is the job's next task while the job waits (another job's task runs on
          ``device``): only when its parameters fit ``headroom_bytes``, the bytes the running
          task leaves free on ``device``.

        :meth:`run` of that task then waits for the copy (or drops it if the task runs on
        another device).
        """
        current = self.next_task()
        if task is None or current is None or task.seq in self._prefetched:
            return
        if task.seq == current.seq:
            param_bytes = self.plan.shards[task.shard].param_bytes
            if headroom_bytes is None or param_bytes > headroom_bytes:
                return
            if task.shard in self._pending:
                return
        elif not self._may_prefetch(current, task):
            return
        hosts = [t.data for t in self._resident[task.shard]]
        if device.torch_device.type == "cuda":
            stream = torch.cuda.Stream(device.torch_device)
            with torch.cuda.stream(stream):
                copies = [device.to_device(host, non_blocking=True) for host in hosts]
            done: concurrent.futures.Future[Any] = concurrent.futures.Future()
            done.set_result((copies, stream))
        else:  # allocate now (as an allocator would), copy in the background
            copies = [device.empty_like(host) for host in hosts]

            def copy() -> tuple[list[torch.Tensor], None]:
                for out, host in zip(copies, hosts, strict=True):
                    device.copy_in(out, host)
                return copies, None

            done = _COPY_POOL.submit(copy)
        self._prefetched[task.seq] = (device.name, done)

    def discard_prefetch(self, device: Device) -> None:
        """Drop copies prefetched onto ``device`` (it runs something else now), freeing them."""
        for seq in [seq for seq, (name, _) in self._prefetched.items() if name == device.name]:
            self._prefetched.pop(seq)[1].result()

    def run(self, task: ShardTask, device: Device) -> None:
        """Run the next task on ``device``: promote, compute, update, demote.

        After an exception the job holds no device memory (its state is back on the host) but
        cannot go on: the task that failed was partly done.

        Raises:
            ValueError: ``task`` is not the next task.
            torch.OutOfMemoryError: The device ran out of memory.
            FloatingPointError: The train loss of a step is not finite.
        """
        if task != self.next_task():
            raise ValueError(f"job {self.spec.name!r}: task {task} is not the next task")
        self._future.popleft()
        if not self._started:
            self._start(device)
        meter = device.meter
        if meter is not None:
            meter.reset_peak()
        swap_start = self.swap_bytes
        try:
            with self.rng.bound(device.torch_device):
                try:
                    self._promote(task, device)
                    if task.shard in self._pending:
                        self._apply_pending(task.shard, device)
                    if task.phase == "eval":
                        self._eval_shard(task.shard, device)
                    elif task.phase == "train" and task.kind == "forward":
                        self._forward_shard(task.shard, device)
                    elif task.phase == "train":
                        self._backward_shard(task.shard, device)
                finally:
                    self._demote(task.shard, device)
        except BaseException:
            for _, future in self._prefetched.values():
                future.result()
            self._prefetched.clear()
            raise
        if meter is not None:
            self.peak_device_bytes = max(self.peak_device_bytes, meter.peak_bytes)
        if task.phase == "train":
            self._task_swap += self.swap_bytes - swap_start
            if task.shard == 0 and task.kind == "backward":
                self._finish_step(device)
        if task.phase == "eval" and task.shard == len(self._params) - 1:
            self._finish_eval()

    def result(self) -> TrainResult:
        """The job's result, once :meth:`next_task` returns ``None`` (see ``train_plain``)."""
        assert self.next_task() is None, "the job still has tasks"
        train_seconds = time.perf_counter() - self._start_time if self._started else 0.0
        checkpoint_path = None
        if self.spec.checkpoint_dir is not None and not self.pruned:
            checkpoint_path = save_weights(self.model, self.spec.checkpoint_dir)
        metric = self.spec.metric if self.eval_data is not None else "train_loss"
        values = [point.value for point in self.metrics if point.name == metric]
        return TrainResult(
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
            device=self._device_name,
            swap_bytes=self.swap_bytes,
            num_promotes=self.num_promotes,
            num_demotes=self.num_demotes,
            peak_device_bytes=self.peak_device_bytes or None,
        )

    # ------------------------------------------------------------------ sequence

    def _task_sequence(self) -> Iterator[ShardTask]:
        """Every task of the job in order, assuming no pruning (pruning only truncates it)."""
        num_shards = len(self.plan.shards)
        seq = 0

        def task(step: int, shard: int, kind: TaskKind, phase: TaskPhase) -> ShardTask:
            nonlocal seq
            seq += 1
            plan = self.plan.shards[shard]
            seconds = plan.forward_s if kind == "forward" else plan.backward_s
            return ShardTask(
                self.spec.name, seq - 1, step, shard, kind, phase, seconds, plan.param_bytes
            )

        evaluate = self.eval_data is not None
        total = self.spec.total_steps
        if evaluate:
            yield from (task(0, i, "forward", "eval") for i in range(num_shards))
        for step in range(total):
            yield from (task(step, i, "forward", "train") for i in range(num_shards - 1))
            yield from (task(step, i, "backward", "train") for i in range(num_shards - 1, -1, -1))
            done = step + 1
            every = self.spec.eval_every
            due = done == total or (every is not None and done % every == 0)
            if evaluate and due:
                yield from (task(done, i, "forward", "eval") for i in range(num_shards))
        if self.spec.optimizer.grad_clip is not None and not evaluate:
            yield from (task(total, i, "backward", "update") for i in range(1, num_shards))

    def _may_prefetch(self, current: ShardTask, task: ShardTask) -> bool:
        if task.shard == current.shard or task.shard in self._pending:
            return False
        resident = {id(p) for p in self._params[current.shard]}
        if any(id(p) in resident for p in self._params[task.shard]):
            return False
        shard = self.plan.shards[current.shard]
        peak = shard.forward_peak_bytes if current.kind == "forward" else 0
        peak = max(peak, shard.backward_peak_bytes if current.kind == "backward" else 0)
        if current.phase == "eval" and current.shard == len(self.plan.shards) - 1:
            peak = shard.backward_peak_bytes
        return peak + self.plan.shards[task.shard].param_bytes <= self.plan.budget_bytes

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
            buffers = {
                id(b): b
                for layer in self.stack.layers[shard.start : shard.stop]
                for b in layer.buffers()
            }
            self._params.append(params)
            self._resident.append([*params, *buffers.values()])
            self._owned.append(owned)
            self._optimizers.append(build_optimizer(owned, self.spec.optimizer) if owned else None)
        self._owner = owner
        self._order = order
        self._names = names
        if self.device_type == "cuda":
            for param in self.model.parameters():
                param.data = param.data.pin_memory()
        self._host_data: dict[int, torch.Tensor] = {}
        self._host_grads: dict[int, torch.Tensor] = {}
        self._contrib: dict[int, torch.Tensor] = {}
        self._dirty: set[int] = set()
        self._task_swap = 0
        self._device_name = self.plan.device

    def _promote(self, task: ShardTask, device: Device) -> None:
        """Copy the shard's parameters and buffers to the device (or take prefetched copies)."""
        params = self._resident[task.shard]
        copies = None
        for seq in [seq for seq in self._prefetched if seq < task.seq]:
            self._prefetched.pop(seq)[1].result()  # stale (e.g. the task moved): drop it
        if task.seq in self._prefetched:
            name, future = self._prefetched.pop(task.seq)
            got, stream = future.result()
            if name == device.name:
                copies = got
                if stream is not None:
                    torch.cuda.current_stream(device.torch_device).wait_stream(stream)
                    for copy in copies:
                        copy.record_stream(torch.cuda.current_stream(device.torch_device))
        if copies is None:
            copies = [device.to_device(p.data, non_blocking=p.data.is_pinned()) for p in params]
        for param, copy in zip(params, copies, strict=True):
            self._host_data[id(param)] = param.data
            param.data = copy
            self.swap_bytes += copy.nbytes
        self.num_promotes += 1
        self._device_name = device.name

    def _demote(self, shard: int, device: Device) -> None:
        """Copy updated parameters back to their host tensors and drop the device copies.

        Buffers are never copied back: layers that update buffers in their forward (batch-norm
        running statistics) are not supported.
        """
        for param in self._resident[shard]:
            host = self._host_data.pop(id(param), None)
            if host is None:  # the promotion failed before installing it
                continue
            if id(param) in self._dirty:
                self._to_host(device, param.data, host)
                self._dirty.discard(id(param))
            param.data = host
            param.grad = None
        self.num_demotes += 1

    def _to_device(self, device: Device, host: torch.Tensor) -> torch.Tensor:
        self.swap_bytes += host.nbytes
        return device.to_device(host, non_blocking=host.is_pinned())

    def _to_host(
        self, device: Device, tensor: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.swap_bytes += tensor.nbytes
        return device.to_host(tensor, out)

    def _microbatches(self, shard: int) -> list[slice]:
        size = self.plan.shards[shard].microbatch_size
        rows = self.spec.batch_size
        return [slice(lo, min(lo + size, rows)) for lo in range(0, rows, size)]

    def _store(
        self,
        boundaries: dict[int, torch.Tensor],
        shard: int,
        rows: slice,
        num_rows: int,
        tensor: torch.Tensor,
        device: Device,
    ) -> None:
        """Demote a microbatch's boundary tensor into the host buffer of the whole batch."""
        buffer = boundaries.get(shard)
        if buffer is None:
            shape = (num_rows, *tensor.shape[1:])
            buffer = torch.empty(shape, dtype=tensor.dtype, pin_memory=device.pin_host_memory)
            boundaries[shard] = buffer
        self._to_host(device, tensor, buffer[rows])

    # ------------------------------------------------------------------ compute

    def _layers(self, shard: int) -> list[nn.Module]:
        plan = self.plan.shards[shard]
        return list(self.stack.layers[plan.start : plan.stop])

    def _run_layers(self, shard: int, x: torch.Tensor) -> torch.Tensor:
        for layer in self._layers(shard):
            x = layer(x)
        return x

    def _input(self, shard: int, mb: int, rows: slice, device: Device) -> torch.Tensor:
        if shard == 0:
            return self._to_device(device, self._input_ids_BT[rows])
        return self._to_device(device, self._acts[shard][rows])

    def _forward_shard(self, shard: int, device: Device) -> None:
        if shard == 0:
            self._step_start = time.perf_counter()
            self._epoch, index_B = next(self._batches)
            self._input_ids_BT = self.spec.train_data[index_B]
            self._tapes.clear()
        for mb, rows in enumerate(self._microbatches(shard)):
            x = self._input(shard, mb, rows, device)
            with torch.no_grad(), self._replay(shard, mb, rows, True, device):
                y = self._run_layers(shard, x)
            del x
            self._store(self._acts, shard + 1, rows, self.spec.batch_size, y, device)
            del y

    def _backward_shard(self, shard: int, device: Device) -> None:
        last = shard == len(self._params) - 1
        if last and shard == 0:
            self._step_start = time.perf_counter()
            self._epoch, index_B = next(self._batches)
            self._input_ids_BT = self.spec.train_data[index_B]
            self._tapes.clear()
        microbatches = self._microbatches(shard)
        weight = len(microbatches) > 1
        for mb, rows in enumerate(microbatches):
            x = self._input(shard, mb, rows, device)
            if shard > 0:
                x.requires_grad_(True)
            with self._replay(shard, mb, rows, last, device):
                y = self._run_layers(shard, x)
            with _metering(device):
                if last:
                    ids = x if shard == 0 else self._to_device(device, self._input_ids_BT[rows])
                    loss = causal_lm_loss(y, ids)
                    del y, ids
                    num_rows = rows.stop - rows.start
                    self._losses.append((loss.item(), num_rows / self.spec.batch_size))
                    if weight:
                        loss = loss * (num_rows / self.spec.batch_size)
                    loss.backward()
                    del loss
                else:
                    grad = self._to_device(device, self._grads[shard][rows])
                    torch.autograd.backward(y, grad)
                    del y, grad
            if shard > 0:
                assert x.grad is not None
                self._store(self._grads, shard - 1, rows, self.spec.batch_size, x.grad, device)
            del x
        self._acts.pop(shard, None)
        self._grads.pop(shard, None)
        with _metering(device):
            self._after_backward(shard, device)

    def _after_backward(self, shard: int, device: Device) -> None:
        """Send tied-gradient contributions, then clip-or-update the owned parameters."""
        owned = self._owned[shard]
        for param in self._params[shard]:
            if self._owner[id(param)] != shard:
                assert param.grad is not None
                earlier = self._contrib.get(id(param))
                grad = param.grad
                if earlier is not None:
                    grad = grad + self._to_device(device, earlier)
                self._contrib[id(param)] = self._to_host(device, grad, earlier)
                param.grad = None
                del grad
        for param in owned:
            contribution = self._contrib.pop(id(param), None)
            if contribution is not None:
                assert param.grad is not None
                param.grad.add_(self._to_device(device, contribution))
        if not owned:
            return
        if self.spec.optimizer.grad_clip is None:
            self._update(shard, device, self.step)
            return
        grads = [p.grad for p in owned]
        norms = torch._foreach_norm(grads, 2.0)  # type: ignore[arg-type]
        for param, norm in zip(owned, norms, strict=True):
            self._norms[id(param)] = self._to_host(device, norm)
        if shard > 0:
            for param in owned:
                assert param.grad is not None
                self._host_grads[id(param)] = self._to_host(
                    device, param.grad, self._host_grads.get(id(param))
                )
                param.grad = None
            self._pending[shard] = self.step
            return
        ordered = [self._norms.pop(id(p)) for p in self.model.parameters() if id(p) in self._norms]
        torch_device = device.torch_device
        total_norm = torch.linalg.vector_norm(
            torch.stack([n.to(torch_device) for n in ordered]), 2.0
        )
        clip_coef = self.spec.optimizer.grad_clip / (total_norm + 1e-6)
        self._clip_coef = self._to_host(device, torch.clamp(clip_coef, max=1.0))
        self._update(shard, device, self.step, clip=True)

    def _apply_pending(self, shard: int, device: Device) -> None:
        """Apply the clipped update deferred from the shard's last backward (``grad_clip``)."""
        step = self._pending.pop(shard)
        with _metering(device):
            for param in self._owned[shard]:
                param.grad = self._to_device(device, self._host_grads[id(param)])
            self._update(shard, device, step, clip=True)

    def _update(self, shard: int, device: Device, step: int, clip: bool = False) -> None:
        """Just-in-time update: promote the optimizer state, step, demote the state."""
        optimizer = self._optimizers[shard]
        assert optimizer is not None
        owned = self._owned[shard]
        if clip:
            assert self._clip_coef is not None
            grads = [p.grad for p in owned]
            clip_coef = self._to_device(device, self._clip_coef)
            torch._foreach_mul_(grads, clip_coef)  # type: ignore[arg-type]
        spec = self.spec.optimizer
        optimizer.param_groups[0]["lr"] = spec.lr * lr_factor(step, spec, self.spec.total_steps)
        host_state = self._promote_state(optimizer, device)
        try:
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
            self._demote_state(optimizer, device, host_state)
            self._dirty.update(id(p) for p in owned)

    def _promote_state(
        self, optimizer: torch.optim.Optimizer, device: Device
    ) -> dict[tuple[int, str], torch.Tensor]:
        host_state = {}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and _moves(value, device):
                    host_state[(id(param), key)] = value
                    state[key] = self._to_device(device, value)
        return host_state

    def _demote_state(
        self,
        optimizer: torch.optim.Optimizer,
        device: Device,
        host_state: dict[tuple[int, str], torch.Tensor],
    ) -> None:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and _moves(value, device):
                    state[key] = self._to_host(device, value, host_state.get((id(param), key)))

    def _eval_shard(self, shard: int, device: Device) -> None:
        assert self.eval_data is not None
        last = shard == len(self._params) - 1
        if shard == 0:
            self._eval_sum = 0.0
        layers = self._layers(shard)
        modes = [layer.training for layer in layers]
        for layer in layers:
            layer.eval()
        size = self.plan.shards[shard].microbatch_size
        num_rows = self.eval_data.shape[0]
        chunks = [  # plain's batches of batch_size, in this shard's microbatches
            slice(lo, min(lo + size, hi))
            for start in range(0, num_rows, self.spec.batch_size)
            for hi in [min(start + self.spec.batch_size, num_rows)]
            for lo in range(start, hi, size)
        ]
        torch_device = device.torch_device
        with _host_rng_guard(torch_device), _preserved_rng(torch_device), torch.no_grad():
            for rows in chunks:
                host = self.eval_data[rows] if shard == 0 else self._eval_acts[shard][rows]
                x = self._to_device(device, host)
                with _metering(device):
                    y = self._run_layers(shard, x)
                    if last:
                        ids = x if shard == 0 else self._to_device(device, self.eval_data[rows])
                        tokens = ids.shape[0] * (ids.shape[1] - 1)
                        self._eval_sum += float(causal_lm_loss(y, ids).double().item()) * tokens
                        del ids
                    else:
                        self._store(self._eval_acts, shard + 1, rows, num_rows, y, device)
                del x, y
        self._eval_acts.pop(shard, None)
        for layer, mode in zip(layers, modes, strict=True):
            layer.train(mode)

    def _replay(
        self, shard: int, mb: int, rows: slice, record: bool, device: Device
    ) -> _RandomReplay:
        """The shard pass's dispatch mode: RNG record / replay, plus the device's metering."""
        recording = record and mb == 0
        if recording:
            self._tapes[shard] = []
        meter = device.meter
        return _RandomReplay(
            self.rng,
            self._tapes[shard],
            recording,
            rows,
            self.spec.batch_size,
            restore=not record,
            meter=meter if isinstance(meter, VirtualMeter) else None,
        )

    # ------------------------------------------------------------------ bookkeeping

    def _start(self, device: Device) -> None:
        self._started = True
        self._start_time = time.perf_counter()
        self.callbacks.on_start(
            StartEvent(
                job=self.spec.name,
                total_steps=self.spec.total_steps,
                device=device.name,
                num_parameters=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            )
        )

    def _finish_step(self, device: Device) -> None:
        self.step += 1
        losses, self._losses = self._losses, []
        train_loss = losses[0][0] if len(losses) == 1 else math.fsum(v * w for v, w in losses)
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

    def _finish_eval(self) -> None:
        assert self.eval_data is not None
        num_tokens = self.eval_data.shape[0] * (self.eval_data.shape[1] - 1)
        eval_loss = self._eval_sum / num_tokens
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
) -> TrainResult:
    """Train one job on one device by spilling, its tasks in order (see the module doc).

    Args:
        spec: The job.
        device: Where its tasks run.
        plan: Its plan for ``device`` (``plan_job``).
        callbacks: Progress receiver.
        prefetch: Double-buffer: promote the next shard while the current one computes.

    Returns:
        The result (``swap_bytes``, ``num_promotes``, ``num_demotes``, ``peak_device_bytes`` set).

    Raises:
        torch.OutOfMemoryError: A task did not fit the device.
        FloatingPointError: The train loss became non-finite.
    """
    job = SpilledJob(spec, plan, callbacks)
    while (task := job.next_task()) is not None:
        if prefetch:
            job.prefetch(job.peek_task(), device)
        job.run(task, device)
    return job.result()


# ---------------------------------------------------------------------- helpers

#: Background copies of virtual-device prefetches.
_COPY_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="prefetch")


def _metering(device: Device) -> contextlib.AbstractContextManager[None]:
    meter = device.meter
    return meter.metering() if meter is not None else contextlib.nullcontext()


def _moves(value: torch.Tensor, device: Device) -> bool:
    """Whether an optimizer-state tensor is promoted (CUDA keeps 0-dim step counters on host)."""
    return not (device.torch_device.type == "cuda" and value.dim() == 0 and not value.is_cuda)


def _build(spec: TrainSpec, device_type: str) -> tuple[nn.Module, _JobRng]:
    """Plain's recipe steps 1-2 on the host; returns the model and the job's dropout stream."""
    with _HOST_RNG_LOCK:
        host_state = torch.get_rng_state()
        torch.random.default_generator.manual_seed(spec.seed)
        model = build_model(spec.model, spec.dtype)
        if device_type == "cuda":
            torch.set_rng_state(host_state)
            generator = torch.Generator(device="cuda")
            generator.manual_seed(spec.seed)
            rng = _JobRng("cuda", generator.get_state())
        else:
            rng = _JobRng("cpu", torch.get_rng_state())
    model.train()
    return model, rng


class _JobRng:
    """A job's own dropout stream: a CPU generator, or a CUDA state swapped in per task."""

    def __init__(self, device_type: str, state: torch.Tensor) -> None:
        self.device_type = device_type
        self.generator: torch.Generator | None = None
        if device_type == "cpu":
            self.generator = torch.Generator()
            self.generator.set_state(state)
        self._state = state

    @contextlib.contextmanager
    def bound(self, torch_device: torch.device) -> Iterator[None]:
        """On CUDA, install the job's state in the device's default generator for a task."""
        if self.device_type == "cpu":
            yield
            return
        index = torch_device.index if torch_device.index is not None else 0
        generator = torch.cuda.default_generators[index]
        previous = generator.get_state()
        generator.set_state(self._state)
        self.generator = generator
        try:
            yield
        finally:
            self._state = generator.get_state()
            generator.set_state(previous)
            self.generator = None

    def get_state(self) -> torch.Tensor:
        assert self.generator is not None
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        assert self.generator is not None
        self.generator.set_state(state)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.device_type == "cpu":
            if not any(a.name == "generator" for a in func._schema.arguments):
                raise RuntimeError(f"random op {func} has no generator argument to replay")
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


class _RandomReplay(TorchDispatchMode):
    """Record or replay the job's RNG state before each random op of one shard pass.

    ``record``: append the state before each random op to ``tape`` and run the op (advancing the
    job's stream like plain's pass). Otherwise set the state from ``tape`` before each op. For a
    microbatch (``rows`` of ``full_rows``), the op is run on the full-minibatch shape and the rows
    are kept; when replaying a CPU ``bernoulli_``, only the leading rows up to ``rows.stop`` are
    drawn (element k of a CPU draw depends only on the generator state and k). ``restore``: put
    the job's stream back as it was when the pass began (recompute).

    It also does the virtual device's metering (``meter``), so each op pays for one Python mode.
    """

    def __init__(
        self,
        rng: _JobRng,
        tape: list[torch.Tensor],
        record: bool,
        rows: slice,
        full_rows: int,
        restore: bool,
        meter: VirtualMeter | None = None,
    ) -> None:
        super().__init__()
        self.meter = meter
        self.rng = rng
        self.tape = tape
        self.record = record
        self.rows = rows
        self.full_rows = full_rows
        self.restore = restore
        self.site = 0
        self._start: torch.Tensor | None = None

    def __enter__(self) -> _RandomReplay:
        self._start = self.rng.get_state()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self.record:
            self.tape.append(self.rng.get_state())  # the state after the pass
        elif self.restore:
            assert self._start is not None
            self.rng.set_state(self._start)
        else:
            self.rng.set_state(self.tape[-1])

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            out = func(*args, **kwargs)
            if self.meter is not None:
                self.meter.account(args, kwargs, out)
            return out
        if self.record:
            self.tape.append(self.rng.get_state())
        else:
            self.rng.set_state(self.tape[self.site])
        self.site += 1
        if self.rows.stop - self.rows.start == self.full_rows:
            out = self.rng.call(func, args, kwargs)
            if self.meter is not None:
                self.meter.account(args, kwargs, out)
            return out
        return self._full_batch_rows(func, args, kwargs)

    def _full_batch_rows(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rows = self.rows
        target = args[0]
        if target.shape[0] != rows.stop - rows.start or not target.is_contiguous():
            raise RuntimeError(f"cannot replay {func} per microbatch: rows are not dim 0")
        if func is torch.ops.aten.bernoulli_.float:
            prefix = not self.record and target.device.type == "cpu"
            drawn = rows.stop if prefix else self.full_rows
            shape = (drawn, *target.shape[1:])
            full = torch.empty(shape, dtype=target.dtype, device=target.device)
            self._track(full)
            self.rng.call(func, (full, *args[1:]), kwargs)
            target.copy_(full[rows])
            return target
        if func is torch.ops.aten.native_dropout.default:
            full_input = target.new_zeros((self.full_rows, *target.shape[1:]))
            self._track(full_input)
            full_input[rows] = target
            output, mask = self.rng.call(func, (full_input, *args[1:]), kwargs)
            outputs = output[rows].clone(), mask[rows].clone()
            for tensor in outputs:
                self._track(tensor)
            return outputs
        raise ValueError(
            f"random op {func} cannot be replayed per microbatch; train this model with "
            "microbatch_size equal to batch_size"
        )

    def _track(self, tensor: torch.Tensor) -> None:
        if self.meter is not None:
            self.meter.track(tensor)

