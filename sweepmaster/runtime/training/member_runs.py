"""The records of each trial a spilled job trains: metrics, events, pruning, result.

:class:`MemberRun` keeps what ``train_plain`` keeps locally per trial (metrics, throughput
window, start, step and evaluation events, pruning, training seconds, resume, its error, its
result), for a single job's one trial
(:class:`~sweepmaster.runtime.training.spill.SpilledJob`) and a fused array's K members
(:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`) alike; the job's
:class:`~sweepmaster.runtime.training.bookkeeping.TrialBookkeeping` drives them. A member's
weights come from its job (:class:`MemberSource`); a fused array tells who leaves it
(:data:`MemberEndHook`) and asks who may join it (:data:`RefillHook`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor, nn

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.events import (
    EvalEvent,
    StartEvent,
    StepEvent,
    TrainCallbacks,
)
from sweepmaster.runtime.training.plain import _THROUGHPUT_WINDOW_STEPS
from sweepmaster.runtime.training.training_state import TrainingState, job_key, load_latest
from sweepmaster.workload.causal_lm import save_weights
from sweepmaster.workload.spec import MetricPoint, TrainResult, TrainSpec

__all__ = ["MemberEndHook", "MemberRun", "MemberSource", "RefillHook"]


class MemberSource(Protocol):
    """Where a leaving member's weights come from (a fused array)."""

    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s weights by name, unstacked (CPU)."""
        ...

    def member_module(self, index: int) -> nn.Module:
        """Member ``index`` as a module of its own (to save in its model's format)."""
        ...


@dataclass(eq=False)
class MemberRun:
    """Bookkeeping of one trial trained by a job (what ``train_plain`` keeps locally).

    One implementation for every K: a single job
    (:class:`~sweepmaster.runtime.training.spill.SpilledJob`, K = 1) keeps its trial in one, a
    fused array (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`) one per
    member; the trainer's bookkeeping
    (:class:`~sweepmaster.runtime.training.bookkeeping.TrialBookkeeping`) records them over its
    members' ``runs``. A callback that raises, a non-finite loss or a failed checkpoint sets
    :attr:`error`: a fused array's member fails alone, a single job raises it (the members'
    ``fail_alone``).
    """

    index: int
    spec: TrainSpec
    callbacks: TrainCallbacks
    metrics: list[MetricPoint] = field(default_factory=list)
    window: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=_THROUGHPUT_WINDOW_STEPS)
    )
    pruned: bool = False
    error: Exception | None = None
    result: TrainResult | None = None
    step: int = 0  # optimizer steps done (earlier runs' included)
    key: str = ""  # job_key of the member when it has a state_dir
    num_parameters: int = 0  # its trainable parameters (unpadded), for ``on_start``
    earlier_s: float = 0.0  # training seconds of earlier runs (resumed)
    started: float | None = None  # perf_counter when it started (or joined) this run
    save_s_before: float = 0.0  # the job's checkpoint-writing seconds before it started

    @property
    def eval_data(self) -> Tensor | None:
        """The member's evaluation blocks ``(M, T)``, at most ``eval_max_blocks``; or None."""
        return self._evaluated(self.spec.eval_data)

    @property
    def eval_targets(self) -> Tensor | None:
        """The labels of :attr:`eval_data` (``TrainSpec.eval_targets``), or None."""
        return self._evaluated(self.spec.eval_targets)

    def _evaluated(self, blocks: Tensor | None) -> Tensor | None:
        """The first ``eval_max_blocks`` rows of ``blocks`` (all without a limit; None stays)."""
        limit = self.spec.eval_max_blocks
        return blocks if blocks is None or limit is None else blocks[:limit]

    def latest_state(self, device_type: str) -> TrainingState | None:
        """The newest intact checkpoint of the member's job in its ``state_dir``, if any.

        Sets :attr:`key` (:func:`~sweepmaster.runtime.training.training_state.job_key`; empty
        without a ``state_dir``).

        Raises:
            As :func:`~sweepmaster.runtime.training.training_state.load_latest`.
        """
        self.key = job_key(self.spec) if self.spec.state_dir is not None else ""
        return load_latest(self.spec.state_dir, self.key, device_type) if self.key else None

    def resume(self, state: TrainingState) -> None:
        """Continue the bookkeeping of ``state``: its step, metrics and training seconds."""
        self.step, self.earlier_s, self.metrics = state.step, state.elapsed_s, list(state.metrics)

    def call(self, method: Callable[[Any], Any], event: Any) -> Any:
        """A callback of this member; what it raises is kept in :attr:`error`."""
        if self.error is not None:
            return None
        try:
            return method(event)
        except Exception as exc:
            self.error = exc
            return None

    def begin(self, device_name: str, save_s: float) -> None:
        """Start (or join) this run on ``device_name``: ``on_start`` with its step.

        ``save_s``: the job's checkpoint-writing seconds so far (not this member's training).
        """
        self.started, self.save_s_before = time.perf_counter(), save_s
        self.call(self.callbacks.on_start, StartEvent(
            self.spec.name, self.spec.total_steps, device_name, self.num_parameters,
            resumed_from_step=self.step))

    def seconds(self, save_s: float) -> float:
        """Training seconds: earlier runs' and this one's, less checkpoint writes.

        ``save_s``: the job's checkpoint-writing seconds so far (seconds, as
        :meth:`begin`'s).
        """
        if self.started is None:
            return self.earlier_s
        saving = save_s - self.save_s_before
        return self.earlier_s + time.perf_counter() - self.started - saving

    def eval_due(self, step: int) -> bool:
        """Whether the member evaluates after ``step`` (0, its last, and every ``eval_every``)."""
        every = self.spec.eval_every
        return (
            self.error is None
            and self.spec.eval_data is not None
            and (step in (0, self.spec.total_steps) or (every is not None and step % every == 0))
        )

    def settles(self, step: int) -> bool:
        """Whether the member ends or writes a checkpoint after its ``step``.

        Its weights must then be whole: deferred clipped updates are applied first
        (:func:`~sweepmaster.runtime.training.tasks.after_step_phase`).
        """
        every = self.spec.checkpoint_every if self.key else None
        return self.error is None and (
            step == self.spec.total_steps or (every is not None and step % every == 0))

    def record_eval(self, step: int, eval_loss: float) -> None:
        """Record an evaluation (loss in nats per token) and hear whether the member is pruned."""
        eval_perplexity = math.exp(eval_loss) if eval_loss < 700 else math.inf
        self.metrics.append(MetricPoint(step, "eval_loss", eval_loss))
        self.metrics.append(MetricPoint(step, "eval_perplexity", eval_perplexity))
        event = EvalEvent(self.spec.name, step, self.spec.total_steps, eval_loss, eval_perplexity)
        self.pruned = bool(self.call(self.callbacks.on_eval, event))

    def record_step(
        self, step: int, loss: float, lr: float, epoch: int, seconds: float, device: Device
    ) -> None:
        """Record a step (loss in nats per token, ``seconds`` of the step) and tell the callback.

        A non-finite loss fails the member (``FloatingPointError``, as ``train_plain`` raises).
        """
        if self.error is not None:
            return
        if not math.isfinite(loss):
            self.error = FloatingPointError(
                f"job {self.spec.name!r}: non-finite train loss {loss} at step {step}"
            )
            return
        self.window.append((seconds, self.spec.tokens_per_step))
        tokens_per_s = sum(n for _, n in self.window) / max(sum(s for s, _ in self.window), 1e-9)
        self.metrics += [
            MetricPoint(step, "train_loss", loss),
            MetricPoint(step, "lr", lr),
            MetricPoint(step, "tokens_per_s", tokens_per_s),
        ]
        total = self.spec.total_steps
        self.call(
            self.callbacks.on_step,
            StepEvent(self.spec.name, step, total, epoch, loss, lr, tokens_per_s, device.name),
        )

    def finish(self, array: MemberSource, index: int, seconds: float) -> None:
        """Build the member's :class:`TrainResult` from member ``index`` of ``array``.

        Its weights are saved to ``checkpoint_dir`` unless it was pruned; ``seconds``: its
        training seconds (:meth:`seconds`). The job sets the result's device and counters.

        Raises:
            OSError: The weights could not be saved.
        """
        checkpoint_path = None
        if self.spec.checkpoint_dir is not None and not self.pruned:
            checkpoint_path = save_weights(array.member_module(index), self.spec.checkpoint_dir)
        metric = self.spec.metric if self.spec.eval_data is not None else "train_loss"
        values = [point.value for point in self.metrics if point.name == metric]
        self.result = TrainResult(
            objective=values[-1] if values else math.nan,
            metrics=self.metrics,
            state_dict=array.member_state_dict(index),
            steps=self.step,
            tokens=self.step * self.spec.tokens_per_step,
            train_seconds=seconds,
            pruned=self.pruned,
            checkpoint_path=checkpoint_path,
        )


#: Called when a member leaves its fused array: ``(index, result, error)``, one of the last two
#: ``None``; the index is in the array's ``specs``, then in joining order
#: (:class:`~sweepmaster.runtime.training.fused_spill.SpilledFusedJob`).
MemberEndHook = Callable[[int, TrainResult | None, Exception | None], None]

#: Asked at a step boundary where a fused array has free slots (members left it):
#: ``(free slots, the array's steps so far)`` -> at most that many new members to join it, each
#: its spec and progress receiver
#: (:meth:`~sweepmaster.runtime.training.fused_members.StackedMembers.join`).
RefillHook = Callable[[int, int], Sequence[tuple[TrainSpec, TrainCallbacks | None]]]
