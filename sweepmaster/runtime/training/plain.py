"""Plain (unspilled) training of one job: the reference every other path must reproduce.

Spilling, fusion, swap and recompute change where and when numbers are computed, never which
numbers (``tests/runtime/training/test_conformance.py`` checks every path against this file).
This file defines the numbers. The recipe, in order:

1. Seed with ``spec.seed`` the CPU generator and the job device's CUDA generator (what
   ``torch.manual_seed(spec.seed)`` does for this job, without touching other devices' generators).
2. ``build_model(spec.model, spec.dtype, spec.peft)``: random init (float32, on the CPU; the
   base, then a LoRA adapter's, which freezes the base) draws from the CPU generator, then the
   cast to ``dtype``; then ``.to(device)`` and ``model.train()``.
3. Optimizer over ``[p for p in model.parameters() if p.requires_grad]`` (tied weights appear
   once), one parameter group, weight decay on every parameter, torch's default implementation
   choice (foreach / for-loop): ``AdamW(lr, betas, eps, weight_decay)`` or
   ``SGD(lr, momentum, weight_decay, nesterov)``; see :func:`build_optimizer`.
4. ``LambdaLR(optimizer, lr_factor)``: step s (0-based) uses ``lr * lr_factor(s)``; linear warmup
   ``s / warmup_steps`` (so step 0 has lr 0 when warming up), then constant, linear or cosine
   decay reaching 0 at ``total_steps``; see :func:`lr_factor`.
5. Data order: a CPU ``torch.Generator`` seeded with ``spec.seed``; every epoch draws
   ``torch.randperm(N, generator=g)``; step i of the epoch trains on blocks
   ``perm[i * B:(i + 1) * B]`` (the last partial batch is dropped); see :func:`minibatch_indices`.
6. Dropout draws from the global RNG stream of the device: on the CPU the CPU generator as left
   by step 2, on CUDA the device's generator as seeded in step 1.
7. Each step: ``logits = lm_logits(model, ids)``, ``loss = causal_lm_loss(logits, labels)``
   (float32; ``labels`` are the ids, or with a loss mask ``spec.train_targets``: -100 where a
   token does not count, so the loss is the mean over the step's counted tokens, transformers'),
   ``loss.backward()``, ``clip_grad_norm_(params, grad_clip)`` if set, ``optimizer.step()``,
   ``scheduler.step()``, ``optimizer.zero_grad(set_to_none=True)``.
8. Evaluation at step 0, every ``eval_every`` steps and after the last step (once per step):
   ``model.eval()``, ``torch.no_grad()``, mean token loss over the first ``eval_max_blocks``
   validation blocks in order, in batches of ``batch_size`` (each weighted by its counted
   tokens); the job device's RNG state (CPU or CUDA generator) is saved and restored around it,
   so evaluation never changes the training numbers; then ``model.train()``.

Checkpoints (:mod:`~sweepmaster.runtime.training.training_state`): with
``spec.checkpoint_every`` the job
writes its training state to ``spec.state_dir`` after every that many optimizer steps (after the
step's evaluation). With ``spec.state_dir`` set, it resumes from the newest intact checkpoint of
this job found there, after optimizer step k: weights, optimizer state and the dropout stream
(item 6) are restored, ``LambdaLR`` continues at step k (item 4), the data order (item 5) with
minibatch k, and no step, evaluation or event up to step k is repeated. A resumed job ends with
the weights of an uninterrupted one.

Concurrency: jobs on different devices may train at once in threads (the executor). torch's CPU
generator is process-global, so ``HOST_RNG_LOCK`` is held while a job seeds and builds its model
(and the CPU generator state it found is restored after), and a job on a CPU device keeps its
dropout stream in a generator of its own that it swaps into the CPU generator, under the lock,
for each step. So no job disturbs another's random stream, and each equals the single-threaded
recipe above.

Shape legend: B batch (blocks), T tokens per block, V vocabulary, N train blocks, M eval blocks.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.events import EvalEvent, StartEvent, StepEvent, TrainCallbacks
from sweepmaster.runtime.training.optimizers import optimizer_entry
from sweepmaster.runtime.training.training_state import (
    TrainingState,
    capture_rng,
    job_key,
    load_latest,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    restore_rng,
    save_checkpoint,
)
from sweepmaster.workload.causal_lm import build_model, causal_lm_loss, lm_logits, save_weights
from sweepmaster.workload.spec import (
    IGNORED_TARGET,
    MetricPoint,
    OptimizerSpec,
    TrainResult,
    TrainSpec,
)

__all__ = [
    "build_optimizer",
    "evaluate_loss",
    "isolated_host_rng",
    "lr_factor",
    "minibatch_indices",
    "train_plain",
]

#: Steps in the sliding window that ``tokens_per_s`` is measured over.
_THROUGHPUT_WINDOW_STEPS = 20

#: Guards torch's process-global CPU generator (see "Concurrency" in the module doc).
HOST_RNG_LOCK = threading.RLock()


def build_optimizer(params: Iterable[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """Build the job's optimizer: one parameter group, weight decay on every parameter.

    The plain optimizer of ``spec.name``'s entry in the table of optimizers
    (:mod:`~sweepmaster.runtime.training.optimizers`): ``torch.optim.AdamW``,
    ``torch.optim.SGD`` or ``lion_pytorch.Lion``.

    Args:
        params: The trainable parameters, in ``model.parameters()`` order.
        spec: The optimizer; its entry says which settings it reads.

    Raises:
        ValueError: Unknown optimizer name, or settings the optimizer refuses.
    """
    entry = optimizer_entry(spec.name)
    entry.check(spec)
    return entry.build(params, spec)


def lr_factor(step: int, spec: OptimizerSpec, total_steps: int) -> float:
    """Multiplier of the peak learning rate at a 0-based optimizer step (the ``LambdaLR`` lambda).

    ``step / warmup_steps`` while ``step < warmup_steps``; then with
    ``progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)`` clamped to [0, 1]:
    ``1`` (constant), ``1 - progress`` (linear) or ``(1 + cos(pi * progress)) / 2`` (cosine).

    Args:
        step: Optimizer steps already taken (0 for the first step).
        spec: Gives ``warmup_steps`` and ``schedule``.
        total_steps: Optimizer steps of the whole job.

    Returns:
        The factor, in [0, 1].
    """
    if step < spec.warmup_steps:
        return step / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - spec.warmup_steps) / max(1, total_steps - spec.warmup_steps))
    if spec.schedule == "linear":
        return 1.0 - progress
    if spec.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule must be constant, linear or cosine, got {spec.schedule!r}")


def minibatch_indices(
    num_blocks: int, batch_size: int, seed: int, start_step: int = 0
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(epoch, index_B)`` for every optimizer step, forever.

    A CPU ``torch.Generator`` seeded with ``seed`` draws a fresh ``randperm(num_blocks)`` per
    epoch; step i of an epoch takes ``perm[i * batch_size:(i + 1) * batch_size]``; the last partial
    batch of an epoch is dropped.

    Args:
        num_blocks: N, training blocks.
        batch_size: B, blocks per step (``<= num_blocks``).
        seed: Seeds the generator.
        start_step: Skip this many minibatches: a resumed job continues the same order (the
            permutations of skipped epochs are drawn, so the generator is where it was).

    Yields:
        The zero-based epoch and int64 block indices ``(B,)`` on the CPU.
    """
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = num_blocks // batch_size
    first_epoch, first_index = divmod(start_step, steps_per_epoch)
    for _ in range(first_epoch):
        torch.randperm(num_blocks, generator=generator)
    for epoch in itertools.count(first_epoch):
        perm_N = torch.randperm(num_blocks, generator=generator)
        for index in range(first_index if epoch == first_epoch else 0, steps_per_epoch):
            yield epoch, perm_N[index * batch_size : (index + 1) * batch_size]


def evaluate_loss(
    model: nn.Module, eval_data: torch.Tensor, batch_size: int, device: Device,
    eval_targets: torch.Tensor | None = None,
) -> float:
    """Mean next-token loss (nats per token) of ``model`` on validation blocks.

    Runs in ``model.eval()`` under ``torch.no_grad()``, over ``eval_data`` in order in batches of
    ``batch_size``, weighting each batch by its counted tokens (``b * (T - 1)`` without a loss
    mask; counted on the host), then restores the model's previous train/eval mode. The RNG
    state of ``device`` (the CPU generator, or the CUDA device's generator) is restored, so the
    caller's random stream is unchanged.

    Args:
        model: The model, on ``device``.
        eval_data: Validation blocks ``(M, T)``, M >= 1, T >= 2.
        batch_size: Blocks per forward.
        device: Where the model lives.
        eval_targets: The labels ``(M, T)`` (:attr:`TrainSpec.eval_targets`: -100 where a token
            does not count); ``None``: the ids, every token counts.

    Returns:
        The mean token cross entropy.
    """
    torch_device = device.torch_device
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=torch_device)
    num_tokens = 0
    with host_rng_guard(torch_device), preserved_rng(torch_device), torch.no_grad():
        for start in range(0, eval_data.shape[0], batch_size):
            input_ids_BT = eval_data[start : start + batch_size].to(torch_device)
            targets_BT = input_ids_BT
            if eval_targets is None:
                batch_tokens = input_ids_BT.shape[0] * (input_ids_BT.shape[1] - 1)
            else:
                host_targets_BT = eval_targets[start : start + batch_size]
                batch_tokens = int((host_targets_BT[:, 1:] != IGNORED_TARGET).sum())
                targets_BT = host_targets_BT.to(torch_device)
            loss = causal_lm_loss(lm_logits(model, input_ids_BT), targets_BT)
            loss_sum += loss.double() * batch_tokens
            num_tokens += batch_tokens
    model.train(was_training)
    return float(loss_sum.item()) / num_tokens


def train_plain(
    spec: TrainSpec, device: Device, callbacks: TrainCallbacks | None = None
) -> TrainResult:
    """Train one job on one device with plain PyTorch, following the recipe in the module doc.

    Args:
        spec: What to train and how.
        device: Where to train (the whole model and optimizer state live there).
        callbacks: Progress receiver; ``on_eval`` returning ``True`` stops the job (pruning).

    Returns:
        The result: objective (last value of ``spec.metric``, or of ``train_loss`` when there is no
        ``eval_data``; nan if none was recorded), metrics, host copies of the final weights, and
        the checkpoint directory if ``spec.checkpoint_dir`` is set and the job was not pruned.
        ``train_seconds`` counts evaluation and training (of earlier runs too, when resumed), not
        model build or checkpoint save. A resumed job's metrics include the earlier runs'.

    Raises:
        ValueError: Blocks shorter than 2 tokens, an empty ``eval_data`` or ``eval_every < 1``.
        FloatingPointError: The train loss of a step is not finite (names the step).
        OSError: A training-state checkpoint cannot be written (e.g. the disk is full).
    """
    callbacks = callbacks if callbacks is not None else TrainCallbacks()
    num_blocks, block_size = (int(n) for n in spec.train_data.shape)
    eval_data = spec.eval_data
    eval_targets = spec.eval_targets if spec.eval_mask is not None else None
    if eval_data is not None and spec.eval_max_blocks is not None:
        eval_data = eval_data[: spec.eval_max_blocks]
        eval_targets = None if eval_targets is None else eval_targets[: spec.eval_max_blocks]
    _check(spec, block_size, eval_data)
    total_steps = spec.total_steps
    torch_device = device.torch_device

    key = job_key(spec) if spec.state_dir is not None else ""
    resumed = load_latest(spec.state_dir, key, torch_device.type) if key else None

    model, dropout = _seeded_model(spec, torch_device)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, spec.optimizer)
    step, earlier_seconds = 0, 0.0
    metrics: list[MetricPoint] = []
    if resumed is not None:
        model.load_state_dict(resumed.model)
        load_optimizer_state_by_name(optimizer, resumed.optimizer, names)
        for group in optimizer.param_groups:  # LambdaLR continues from the checkpoint's step
            group["initial_lr"] = group["lr"]
        with host_rng_guard(torch_device):
            restore_rng(resumed.rng, torch_device, dropout.generator)
        step, earlier_seconds, metrics = resumed.step, resumed.elapsed_s, list(resumed.metrics)
    scheduler = LambdaLR(
        optimizer,
        functools.partial(lr_factor, spec=spec.optimizer, total_steps=total_steps),
        last_epoch=step - 1,
    )
    batches = minibatch_indices(num_blocks, spec.batch_size, spec.seed, start_step=step)

    callbacks.on_start(
        StartEvent(
            job=spec.name,
            total_steps=total_steps,
            device=device.name,
            num_parameters=sum(p.numel() for p in params),
            resumed_from_step=step,
        )
    )

    def evaluate(step: int) -> bool:
        """Evaluate, record, report; return ``True`` if a callback asks to stop."""
        assert eval_data is not None
        eval_loss = evaluate_loss(model, eval_data, spec.batch_size, device, eval_targets)
        eval_perplexity = math.exp(eval_loss) if eval_loss < 700 else math.inf
        metrics.append(MetricPoint(step, "eval_loss", eval_loss))
        metrics.append(MetricPoint(step, "eval_perplexity", eval_perplexity))
        return bool(
            callbacks.on_eval(EvalEvent(spec.name, step, total_steps, eval_loss, eval_perplexity))
        )

    def save_state() -> None:
        """Write a training-state checkpoint of the job after ``step`` steps."""
        assert spec.state_dir is not None
        with host_rng_guard(torch_device):
            rng = capture_rng(torch_device, dropout.generator)
        state = TrainingState(
            step=step,
            model=model.state_dict(),
            optimizer=optimizer_state_by_name(optimizer, names),
            rng=rng,
            metrics=metrics,
            elapsed_s=earlier_seconds + time.perf_counter() - start_time - save_seconds,
        )
        save_checkpoint(spec.state_dir, state, key, keep=spec.keep_checkpoints)

    start_time = time.perf_counter()
    save_seconds = 0.0
    pruned = eval_data is not None and step == 0 and evaluate(0)
    window: deque[tuple[float, int]] = deque(maxlen=_THROUGHPUT_WINDOW_STEPS)
    while not pruned and step < total_steps:
        step_start = time.perf_counter()
        epoch, index_B = next(batches)
        input_ids_BT = spec.train_data[index_B].to(torch_device)
        targets_BT = input_ids_BT if spec.train_mask is None else \
            spec.train_targets[index_B].to(torch_device)
        lr = float(optimizer.param_groups[0]["lr"])

        with dropout.drawing():
            logits_BTV = lm_logits(model, input_ids_BT)
            loss = causal_lm_loss(logits_BTV, targets_BT)
            loss.backward()
        if spec.optimizer.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.optimizer.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        train_loss = loss.item()
        del logits_BTV, loss
        step += 1
        if not math.isfinite(train_loss):
            raise FloatingPointError(
                f"job {spec.name!r}: non-finite train loss {train_loss} at step {step}"
            )
        window.append((time.perf_counter() - step_start, spec.tokens_per_step))
        tokens_per_s = sum(n for _, n in window) / max(sum(s for s, _ in window), 1e-9)
        metrics.append(MetricPoint(step, "train_loss", train_loss))
        metrics.append(MetricPoint(step, "lr", lr))
        metrics.append(MetricPoint(step, "tokens_per_s", tokens_per_s))
        callbacks.on_step(
            StepEvent(
                job=spec.name,
                step=step,
                total_steps=total_steps,
                epoch=epoch,
                train_loss=train_loss,
                lr=lr,
                tokens_per_s=tokens_per_s,
                device=device.name,
            )
        )
        due = step == total_steps or (spec.eval_every is not None and step % spec.eval_every == 0)
        if eval_data is not None and due:
            pruned = evaluate(step)
        if spec.checkpoint_every is not None and step % spec.checkpoint_every == 0 and not pruned:
            save_start = time.perf_counter()
            save_state()
            save_seconds += time.perf_counter() - save_start
    train_seconds = earlier_seconds + time.perf_counter() - start_time - save_seconds

    checkpoint_path = None
    if spec.checkpoint_dir is not None and not pruned:
        checkpoint_path = save_weights(model, spec.checkpoint_dir)
    metric = spec.metric if eval_data is not None else "train_loss"
    values = [point.value for point in metrics if point.name == metric]
    meter = device.meter
    with meter.unmetered() if meter is not None else contextlib.nullcontext():
        state_dict = {  # host copies: not the device's memory, even on a virtual device
            name: tensor.detach().to("cpu", copy=True)
            for name, tensor in model.state_dict().items()
        }
    return TrainResult(
        objective=values[-1] if values else math.nan,
        metrics=metrics,
        state_dict=state_dict,
        steps=step,
        tokens=step * spec.tokens_per_step,
        train_seconds=train_seconds,
        pruned=pruned,
        checkpoint_path=checkpoint_path,
        device=device.name,
    )


class _DropoutStream:
    """The random stream a job draws its dropout from (recipe item 6).

    A CUDA job draws from its device's generator, which no other job uses (one job per device).
    A CPU job's stream is the CPU generator as left by its model build, but that generator is
    process-global and jobs on other (virtual) CPU devices train at the same time: the job keeps
    its stream in its own ``generator`` and swaps it into the CPU generator, under
    ``HOST_RNG_LOCK``, for each step (:meth:`drawing`), putting back what it found.

    Attributes:
        generator: The CPU job's stream between steps; ``None`` for a CUDA job.
    """

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Make the job's stream the one dropout draws from, for one step."""
        if self.generator is None:
            yield
            return
        with HOST_RNG_LOCK:
            outer = torch.get_rng_state()
            torch.set_rng_state(self.generator.get_state())
            try:
                yield
            finally:
                self.generator.set_state(torch.get_rng_state())
                torch.set_rng_state(outer)


def _seeded_model(spec: TrainSpec, torch_device: torch.device) -> tuple[nn.Module, _DropoutStream]:
    """Recipe steps 1-2: seed, build, move, train mode; return the model and its dropout stream.

    The process's CPU generator is left as it was found.
    """
    with HOST_RNG_LOCK:
        host_state = torch.get_rng_state()
        torch.random.default_generator.manual_seed(spec.seed)
        model = build_model(spec.model, spec.dtype, spec.peft)
        generator = None
        if torch_device.type == "cuda":
            with torch.cuda.device(torch_device):
                torch.cuda.manual_seed(spec.seed)
        else:
            generator = torch.Generator()
            generator.set_state(torch.get_rng_state())
        torch.set_rng_state(host_state)
    model.to(torch_device)
    model.train()
    return model, _DropoutStream(generator)


@contextlib.contextmanager
def isolated_host_rng() -> Iterator[None]:
    """Draw from the CPU generator without disturbing the jobs that train meanwhile.

    Holds ``HOST_RNG_LOCK`` (so no job on the CPU draws dropout meanwhile) and restores the CPU
    generator's state on exit, e.g. around building a model whose weights are loaded next.
    """
    with HOST_RNG_LOCK:
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)


def host_rng_guard(torch_device: torch.device) -> Any:
    """``HOST_RNG_LOCK`` for a job on the CPU (which draws dropout from the CPU generator)."""
    return HOST_RNG_LOCK if torch_device.type == "cpu" else contextlib.nullcontext()


@contextlib.contextmanager
def preserved_rng(torch_device: torch.device) -> Iterator[None]:
    """Save the RNG state of the job's device (CPU or one CUDA device) and restore it on exit."""
    if torch_device.type == "cuda":
        index = (
            torch_device.index if torch_device.index is not None else torch.cuda.current_device()
        )
        cuda_state = torch.cuda.get_rng_state(index)
        try:
            yield
        finally:
            torch.cuda.set_rng_state(cuda_state, index)
    else:
        cpu_state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(cpu_state)


def _check(spec: TrainSpec, block_size: int, eval_data: torch.Tensor | None) -> None:
    if block_size < 2:
        raise ValueError(f"blocks need at least 2 tokens for next-token loss, got {block_size}")
    if eval_data is not None and (eval_data.dim() != 2 or eval_data.shape[0] < 1):
        raise ValueError(f"eval_data must be (M, T) with M >= 1, got {tuple(eval_data.shape)}")
    if eval_data is not None and eval_data.shape[1] < 2:
        raise ValueError(f"eval blocks need at least 2 tokens, got {eval_data.shape[1]}")
    if spec.eval_every is not None and spec.eval_every < 1:
        raise ValueError(f"eval_every must be >= 1 or None, got {spec.eval_every}")
    if spec.total_steps < 1:
        raise ValueError(f"the job must run at least 1 step, got {spec.total_steps}")
