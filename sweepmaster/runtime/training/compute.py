"""The per-shard training algorithm of a spilled job, once for one member and for K.

A shard task's compute (:class:`ShardCompute`, the part a trainer holds as ``compute``): its
forward, backward or evaluation microbatch loop over the host boundaries
(:class:`~sweepmaster.runtime.training.boundaries.HostBoundaries`), under the memory plan
(:class:`~sweepmaster.runtime.training.planned.PlannedPasses`) or Hydra's recompute; the
tied-gradient exchange; Harmony's just-in-time update; or ``grad_clip``'s flow: norms ->
parked gradients -> the clip coefficient at shard 0 -> deferred updates. The same calls make
the per-shard interface a pipeline drives
(:class:`~sweepmaster.runtime.training.pipelined.PipelinedRun`, Harmony's PP): a shard's
forward or backward on a microbatch's rows, its update, the clip coefficients and evaluation
passes. What differs between one member and K is the members part
(:class:`~sweepmaster.runtime.training.shard_members.ShardMembers`): tensors are named by a
:data:`~sweepmaster.runtime.training.tasks.TensorKey`; a fused array's rows sit after its member
dimension (``row_dim``), its clip norms and coefficients are per member ``(K,)``.

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.devices.host_syncs import host_resident
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import HostBoundaries, metering
from sweepmaster.runtime.training.layers import mask_pass
from sweepmaster.runtime.training.planned import PlannedPasses
from sweepmaster.runtime.training.replay import JobRng
from sweepmaster.runtime.training.shard_members import ShardMembers
from sweepmaster.runtime.training.shard_store import ShardStore
from sweepmaster.runtime.training.tasks import TensorKey
from sweepmaster.workload.spec import IGNORED_TARGET

__all__ = ["ShardCompute"]


class ShardCompute:
    """A spilled job's per-shard algorithm and the per-shard interface a pipeline drives.

    One member or K: what differs is the members part's (a shard's forward, its dropout mode,
    the members' loss, gradient norms, owned parameters, the optimizer step, the clip
    coefficient, the evaluation blocks and dropout switch). Not thread-safe but for what a
    pipeline calls from one thread per device (its host bookkeeping under the boundaries'
    ``counter_lock``).

    Args:
        plan: The job plan (its shards).
        memory_plan: The keep / swap / recompute plan of the activations, or ``None``.
        members: The job's members (:class:`~sweepmaster.runtime.training.shard_members.\
ShardMembers`).
        boundaries: The job's host boundaries (microbatches, counted copies).
        passes: The job's planned passes (mu-TWO) and its recorded losses.
        store: The job's shard store (the optimizer state's moves, changed tensors).
    """

    #: The evaluation's chunks so far: each chunk's loss, float64 (a fused array's: per member
    #: ``(K,)``), and the tokens it counts (likewise), host copies maybe still in flight.
    _eval_parts: list[tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, plan: JobPlan, memory_plan: MemoryPlan | None, *,
                 members: ShardMembers, boundaries: HostBoundaries, passes: PlannedPasses,
                 store: ShardStore) -> None:
        self.plan = plan
        self.memory_plan = memory_plan
        self.members = members
        self.boundaries = boundaries
        self.passes = passes
        self.store = store
        self._pending: dict[int, Any] = {}  # shard -> its deferred clipped update (grad_clip)
        self._contrib: dict[TensorKey, torch.Tensor] = {}  # tied parameter -> later shards' grad
        # grad_clip: owned gradients' norms and parked gradients on the host, by parameter, and
        # the step's clip coefficient (a fused array's: per member)
        self._norms: dict[TensorKey, torch.Tensor] = {}
        self._host_grads: dict[TensorKey, torch.Tensor] = {}
        self._clip_coef: torch.Tensor | None = None
        self._reset_eval()

    # ------------------------------------------------------------------ per-shard interface
    # What a pipeline (training/pipelined.py) drives; each call between tasks of the chain's
    # own (after the trainer's ``take_tasks`` took a step's or an evaluation's tasks).

    def deferred(self, shard: int) -> bool:
        """Whether the shard's clipped update is deferred (applied when it is next promoted)."""
        return shard in self._pending

    @property
    def defers(self) -> bool:
        """Whether some shard's clipped update is deferred (the members may not change)."""
        return bool(self._pending)

    def keep_members(self, keep_K: torch.Tensor, index: int) -> None:
        """A fused array's member ``index`` left: keep rows ``keep_K`` of what is parked.

        The parked gradients' and norms' member rows ``(K, ...)``, the clip coefficients
        ``(K,)`` and each deferred update's learning rates.
        """
        self._norms = {n: t.index_select(0, keep_K) for n, t in self._norms.items()}
        self._host_grads = {n: g.index_select(0, keep_K) for n, g in self._host_grads.items()}
        if self._clip_coef is not None:
            self._clip_coef = self._clip_coef.index_select(0, keep_K)
        for lrs in self._pending.values():
            lrs.pop(index)

    def forget_parked(self) -> None:
        """Drop the parked gradients and clip coefficient (a member joined; none is deferred)."""
        assert not self._pending, "a clipped update is deferred"
        self._host_grads, self._clip_coef = {}, None

    def forward_pass(self, shard: int, mb: int, rows: slice, x: torch.Tensor, device: Device,
                     rng: JobRng | None = None,
                     overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """Microbatch ``mb``'s forward of ``shard`` without grad, on its installed tensors.

        Args:
            shard: The shard.
            mb: The microbatch's index.
            rows: Its rows of the minibatch.
            x: Its input on ``device``: token ids ``(b, T)`` or ``(b, T, C)`` (a fused array:
                ``(K, b, ...)``).
            device: Where it runs (metered).
            rng: The dropout stream (the members' ``dropout_stream``), else the job's.
            overrides: ``key -> tensor`` used instead of installed ones (a pipeline pack's
                copies of tied parameters another pack holds).

        Returns:
            Its output on ``device``, ``(b, T, C)`` (``(K, b, T, C)``).
        """
        return self._forward_rows(shard, mb, rows, x, device, self.members.task_tensors(), rng,
                                  overrides)

    def backward_pass(self, shard: int, mb: int, rows: slice, x: torch.Tensor,
                      target: Callable[[], torch.Tensor], device: Device, weight: bool,
                      rng: JobRng | None = None,
                      overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                      ) -> torch.Tensor | None:
        """Microbatch ``mb``'s backward of ``shard``, its gradients accumulated in ``.grad``.

        Recomputes the shard's forward from ``x`` with the dropout replayed (the last shard:
        forward and each member's loss) and backpropagates, on the installed tensors.

        Args:
            shard: The shard.
            mb: The microbatch's index.
            rows: Its rows of the minibatch.
            x: Its input on ``device`` (as :meth:`forward_pass`'s).
            target: Returns, on ``device``, the labels ``(b, T)`` (last shard) or the gradient
                of the shard's output ``(b, T, C)`` (a fused array: ``(K, b, ...)``); called
                once the forward ran.
            device: Where it runs (metered).
            weight: Weigh the microbatch's loss by its share of the minibatch's rows.
            rng: See :meth:`forward_pass`.
            overrides: See :meth:`forward_pass`.

        Returns:
            The gradient of ``x`` (as ``x``); ``None`` for shard 0.
        """
        if self._trains_nothing(shard):
            return None
        return self._backward_rows(shard, mb, rows, x, target, device, weight,
                                   self.members.task_tensors(), rng, overrides)

    def update_shard(self, shard: int, device: Device,
                     clip_coef: torch.Tensor | None = None) -> None:
        """Harmony's just-in-time update of the shard's installed parameters, this step's.

        The optimizer state is used where the store's ``promote_state`` put it, else promoted for
        the update; it stays there until the store's ``demote_state`` (with the shard's demote, or
        before a next task that does not update the shard). ``clip_coef``: the clip coefficients on
        ``device`` (the members' ``clip_coefficient``), multiplied into the gradients first.
        """
        members = self.members
        self._jit_update(shard, members.task_tensors(), members.schedule(), device, clip_coef)

    def grad_norms(self, shard: int) -> dict[TensorKey, torch.Tensor]:
        """The 2-norms of the shard's owned gradients: 0-dim, a fused array's ``(K,)``."""
        return self._grad_norms(shard, self.members.task_tensors())

    def park_grads(self, shard: int, device: Device) -> None:
        """Defer the shard's clipped update: its owned gradients go to the host."""
        self._park_grads(shard, self.members.task_tensors(), device)

    def defer_clip(self, coef: torch.Tensor, device: Device) -> None:
        """Keep the step's clip coefficient (on ``device``) on the host for deferred updates."""
        self._clip_coef = self.boundaries.to_host_later(device, coef)

    def apply_deferred(self, shard: int, device: Device) -> None:
        """Apply the shard's deferred clipped update to its installed parameters."""
        self._apply_pending(shard, self.members.task_tensors(), device)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Evaluation mode (dropout off) with the evaluation's loss sum reset, then back."""
        self._reset_eval()
        with self.members.dropout_off(None):
            yield

    def eval_pass(self, shard: int, x: torch.Tensor, device: Device,
                  overrides: Mapping[TensorKey, torch.Tensor] | None = None) -> torch.Tensor:
        """An evaluation chunk's forward of ``shard`` (no grad); see :meth:`forward_pass`."""
        with torch.no_grad(), mask_pass():
            return self.members.run_shard(shard, self.members.task_tensors(), x, None, device,
                                          overrides)

    def add_eval_loss(self, logits: torch.Tensor, ids: torch.Tensor, device: Device) -> None:
        """Record an evaluation chunk's loss and tokens; it leaves ``device`` without a wait.

        ``logits``: ``(b, T, V)``; ``ids``: the labels ``(b, T)`` (a fused array: ``(K, ...)``
        both), on ``device``. The evaluation's sum (:meth:`eval_losses`) is plain's: float64,
        each chunk's loss times its counted tokens (``b * (T - 1)`` without a loss mask; a fused
        array's per member).
        """
        loss = self.members.lm_loss(logits, ids).detach().double()
        tokens = (ids[..., 1:] != IGNORED_TARGET).sum(dim=(-2, -1)).double()
        boundaries = self.boundaries
        loss, tokens = boundaries.copy_out(device, loss), boundaries.copy_out(device, tokens)
        with self.boundaries.counter_lock:
            self._eval_parts.append((loss, tokens))

    def _reset_eval(self) -> None:
        """Start an evaluation's loss sum."""
        self._eval_parts = []

    def train_losses(self) -> list[float]:
        """Each member's train loss of the step, taken off the passes' record.

        One microbatch's loss, or the microbatches' losses weighted by their shares of the
        step's counted targets (``math.fsum``): plain's loss of the whole minibatch.
        """
        self.boundaries.settle_copies_out()
        losses = self.passes.take_losses()
        members: list[float] = []
        for k, values in enumerate(zip(*(host.tolist() for host, _ in losses), strict=True)):
            weights = [shares[k] if len(shares) > 1 else shares[0] for _, shares in losses]
            members.append(values[0] if len(values) == 1
                           else math.fsum(v * w for v, w in zip(values, weights, strict=True)))
        return members

    def eval_losses(self) -> list[float]:
        """Each member's evaluation loss: its token-weighted mean over the evaluation blocks.

        Waits for the chunks' host copies (the evaluation's one host sync) and drops them.
        """
        self.boundaries.settle_copies_out()
        with self.boundaries.counter_lock:
            parts, self._eval_parts = self._eval_parts, []
        total = torch.zeros((), dtype=torch.float64)
        counted = torch.zeros((), dtype=torch.float64)
        for loss, tokens in parts:  # plain's order and float64 sums
            total = total + loss * tokens
            counted = counted + tokens
        sums = host_resident(total.reshape(-1)).tolist()
        tokens_each = host_resident(counted.expand_as(total).reshape(-1)).tolist()
        return [value / count for value, count in zip(sums, tokens_each, strict=True)]

    # ------------------------------------------------------------------ shard algorithms
    # One member or K: what differs is the members part's (rows on the boundaries' ``row_dim``,
    # the tensors a shard computes with by :data:`TensorKey`, a loss of one member or K).

    def _trains_nothing(self, shard: int) -> bool:
        """A frozen first shard (a LoRA base's embeddings): its backward has no gradient."""
        return shard == 0 and len(self.plan.shards) > 1 and not self.members.owned_keys(0)

    def forward_shard(self, shard: int, device: Device) -> None:
        """A training forward task's compute: each microbatch's output to the host boundary.

        Under the memory plan (the passes' ``forward``, its passes kept for the backward
        task) or without grad (Hydra's recompute in the backward task).
        """
        if self.memory_plan is not None:
            self.passes.forward(shard, device)
            return
        boundaries = self.boundaries
        tensors = self.members.task_tensors()
        for mb, rows in enumerate(boundaries.microbatches(shard)):
            x = boundaries.input(shard, rows, device)
            y = self._forward_rows(shard, mb, rows, x, device, tensors)
            del x
            boundaries.store(boundaries.acts, shard + 1, rows, boundaries.batch_size, y, device)
            del y

    def _forward_rows(self, shard: int, mb: int, rows: slice, x: torch.Tensor, device: Device,
                      tensors: Mapping[TensorKey, torch.Tensor], rng: JobRng | None = None,
                      overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                      ) -> torch.Tensor:
        """A microbatch's forward of ``shard`` on ``tensors`` (see :meth:`forward_pass`)."""
        with torch.no_grad(), self.members.pass_mode(shard, mb, rows, True, device, rng=rng), \
                mask_pass():
            return self.members.run_shard(shard, tensors, x, rows, device, overrides)

    def eval_shard(self, shard: int, device: Device) -> None:
        """An evaluation task's compute: plain's evaluation batches through the shard.

        Each chunk's output goes to the host boundary of every evaluation block; the last
        shard adds each chunk's loss to the evaluation's sum (:meth:`add_eval_loss`).
        """
        last = shard == len(self.plan.shards) - 1
        boundaries = self.boundaries
        ids, targets = self.members.eval_ids(), self.members.eval_targets()
        num_rows = int(ids.shape[self.boundaries.row_dim])
        tensors = self.members.task_tensors()
        with self._evaluating_shard(shard, device), torch.no_grad():
            for rows in boundaries.eval_chunks(shard, num_rows):
                index = boundaries.row_index(rows)
                host = ids if shard == 0 else boundaries.eval_acts[shard]
                x = boundaries.to_device(device, host[index])
                with metering(device), mask_pass():
                    y = self.members.run_shard(shard, tensors, x, None, device)
                    if last:
                        labels = x if shard == 0 and targets is None else boundaries.to_device(
                            device, (ids if targets is None else targets)[index])
                        self.add_eval_loss(y, labels, device)
                        del labels
                    else:
                        boundaries.store(boundaries.eval_acts, shard + 1, rows, num_rows, y,
                                         device)
                del x, y
        boundaries.eval_acts.pop(shard, None)

    def backward_shard(self, shard: int, device: Device) -> None:
        """A training backward task's compute: every microbatch's backward, then the update.

        Under the memory plan (the passes' ``backward``) or Hydra's recompute of the shard
        from its host boundary, each microbatch's gradient of its input stored for the shard
        before; then :meth:`_after_backward`.
        """
        last = shard == len(self.plan.shards) - 1
        boundaries = self.boundaries
        microbatches = [] if self._trains_nothing(shard) else boundaries.microbatches(shard)
        if self.memory_plan is not None and self.passes.backward_runs_plan(shard, device):
            if microbatches:
                self.passes.backward(shard, device)
            else:
                self.passes.drop(shard)
        else:
            weight = len(microbatches) > 1
            tensors = self.members.task_tensors()
            for mb, rows in enumerate(microbatches):
                x = boundaries.input(shard, rows, device)
                target: Callable[[], torch.Tensor]
                if not last:
                    target = functools.partial(boundaries.to_device, device,
                                               boundaries.grads[shard][boundaries.row_index(rows)])
                else:  # the only shard's input is the ids: the labels without a loss mask
                    target = functools.partial(boundaries.device_targets, shard, rows, x, device)
                grad = self._backward_rows(shard, mb, rows, x, target, device, weight, tensors)
                if grad is not None:
                    boundaries.store(boundaries.grads, shard - 1, rows, boundaries.batch_size,
                                     grad, device)
                del x, grad
        boundaries.acts.pop(shard, None)
        boundaries.grads.pop(shard, None)
        with metering(device):
            self._after_backward(shard, self.members.task_tensors(), device)

    def _backward_rows(self, shard: int, mb: int, rows: slice, x: torch.Tensor,
                       target: Callable[[], torch.Tensor], device: Device, weight: bool,
                       tensors: Mapping[TensorKey, torch.Tensor], rng: JobRng | None = None,
                       overrides: Mapping[TensorKey, torch.Tensor] | None = None,
                       ) -> torch.Tensor | None:
        """A microbatch's backward of ``shard`` on ``tensors`` (see :meth:`backward_pass`)."""
        last = shard == len(self.plan.shards) - 1
        if shard > 0:
            x.requires_grad_(True)
        with self.members.pass_mode(shard, mb, rows, last, device, rng=rng), mask_pass():
            y = self.members.run_shard(shard, tensors, x, rows, device, overrides)
        with metering(device):
            if last:
                loss_fn = self.passes.loss_fn(target(), rows, weight, device)
                loss = loss_fn(y, True)
                del y, loss_fn
                loss.backward()
                del loss
            else:
                grad = target()
                if y.requires_grad:  # else a frozen first shard (LoRA's embeddings)
                    torch.autograd.backward(y, grad)
                del y, grad
        if shard == 0:
            return None
        assert x.grad is not None
        return x.grad

    def _after_backward(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                        device: Device) -> None:
        """Send tied-gradient contributions, then update the owned parameters (jit update).

        A parameter belongs to the first shard using it: a later shard sends its gradient
        contribution to the host, the owner adds it. With ``grad_clip``, the owned gradients'
        norms go to the host; a shard ``> 0`` parks its gradients (its update is deferred),
        shard 0, the step's last backward, makes the clip coefficient and updates.
        """
        owned = self.members.owned_keys(shard)
        owns = set(owned)
        for key in self.members.shard_keys(shard):
            if key in owns or not self.members.trainable(key):
                continue
            param = tensors[key]
            assert param.grad is not None
            grad = param.grad
            earlier = self._contrib.get(key)
            if earlier is not None:
                grad = grad + self.boundaries.to_device(device, earlier)
            self._contrib[key] = self.boundaries.to_host_later(device, grad, earlier)
            param.grad = None
            del grad
        for key in owned:
            contribution = self._contrib.pop(key, None)
            if contribution is not None:
                owned_grad = tensors[key].grad
                assert owned_grad is not None
                owned_grad.add_(self.boundaries.to_device(device, contribution))
        if not self.members.clips:
            if self.members.updates(shard):
                self._jit_update(shard, tensors, self.members.schedule(), device)
            return
        for key, norm in self._grad_norms(shard, tensors).items():
            self._norms[key] = self.boundaries.to_host_later(device, norm, uncounted_back=True)
        if shard > 0:
            self._park_grads(shard, tensors, device)
            return
        # back on the device uncounted: the cost model's promote volume has no such copy
        norms = {key: self.boundaries.back_uncounted(device, norm)
                 for key, norm in self._norms.items()}
        self._norms.clear()
        self.defer_clip(self.members.clip_coefficient(norms, device), device)
        del norms
        if self.members.updates(shard):  # a LoRA base's first shard owns nothing
            self._jit_update(shard, tensors, self.members.schedule(), device,
                             self._device_clip_coef(device))

    def _grad_norms(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                    ) -> dict[TensorKey, torch.Tensor]:
        """Each owned gradient's 2-norm (0-dim; a fused array's per member ``(K,)``)."""
        owned = self.members.owned_keys(shard)
        if not owned:
            return {}
        grads: list[torch.Tensor] = []
        for key in owned:
            grad = tensors[key].grad
            assert grad is not None
            grads.append(grad)
        return dict(zip(owned, self.members.norms_of(grads), strict=True))

    def _park_grads(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                    device: Device) -> None:
        """Defer the shard's clipped update: its owned gradients to the host."""
        if not self.members.updates(shard):
            return
        for key in self.members.owned_keys(shard):
            param = tensors[key]
            assert param.grad is not None
            self._host_grads[key] = self.boundaries.to_host_later(device, param.grad,
                                                       self._host_grads.get(key))
            param.grad = None
        self._pending[shard] = self.members.schedule()

    def _device_clip_coef(self, device: Device) -> torch.Tensor:
        """The step's clip coefficient (0-dim; per member ``(K,)``) copied to ``device``."""
        assert self._clip_coef is not None
        return self.boundaries.to_device(device, self._clip_coef)

    def _apply_pending(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                       device: Device) -> None:
        """Apply the clipped update deferred from the shard's last backward (``grad_clip``).

        The optimizer state goes home after it: the task computes on.
        """
        schedule = self._pending.pop(shard)
        with metering(device):
            for key in self.members.owned_keys(shard):
                tensors[key].grad = self.boundaries.to_device(device, self._host_grads[key])
            self._jit_update(shard, tensors, schedule, device, self._device_clip_coef(device))
        self.store.demote_state(shard, device)

    @contextlib.contextmanager
    def _evaluating_shard(self, shard: int, device: Device) -> Iterator[None]:
        """An evaluation task's mode (dropout off); shard 0 resets the evaluation's sum."""
        if shard == 0:
            self._reset_eval()
        with self.members.dropout_off(shard), self.members.eval_guard(device):
            yield

    def _jit_update(self, shard: int, tensors: Mapping[TensorKey, torch.Tensor],
                    schedule: Any, device: Device, clip_coef: torch.Tensor | None = None) -> None:
        """Harmony's just-in-time update of the shard's owned parameters in ``tensors``.

        Promotes the optimizer state unless it is there (the store's ``promote_state``), notes
        the owned parameters as changed (written back when uninstalled), and steps (the
        members' ``update``). The state goes home with the shard's demote, or stays with the
        shard when it is kept resident for a next task that updates it (a job of one shard:
        the next step; a pipeline's pack: the whole run). A plan that updates on the host
        (ZeRO-Offload) hands the update to the shard store's host updates instead.
        """
        if self.plan.update_on == "host":
            assert clip_coef is None, "a clipped update runs on the device"
            self.store.host_updates.submit(shard, self.members.owned_keys(shard), schedule,
                                           device, self.members.update)
            return
        self.store.promote_state(shard, device)
        self.store.mark_changed(self.members.owned_keys(shard))
        self.members.update(shard, tensors, schedule, device, clip_coef)
