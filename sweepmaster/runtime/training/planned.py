"""A spilled job's forward and backward passes of a shard under a memory plan (mu-TWO).

With a memory plan (:mod:`~sweepmaster.runtime.planning.memplan`, mu-TWO: Purandare et al.
MLSys 2023), a forward task keeps each layer's pass of each microbatch
(:mod:`~sweepmaster.runtime.training.layerpass`) for the backward task: the layer's saved
activations are kept on the device, swapped to the host, or recomputed from its checkpointed
input, as the plan decides. The backward task fetches them back layer by layer ahead of use
(its first fetch may run during the job's previous task, :meth:`PlannedPasses.fetch_early`),
recomputing only what the plan recomputes, with the dropout replayed from the layer's first
random op. The last shard runs its forward, loss and backward in its one task.

:class:`PlannedPasses` is the part of every spilled job that runs these passes, for one member
or a fused array of K, over the job's host boundaries
(:class:`~sweepmaster.runtime.training.boundaries.HostBoundaries`); it also makes the last
shard's loss and records it (:meth:`PlannedPasses.loss_fn`, Hydra's recompute too). The job
gives it its layers as callables (modules, or a fused array's stacked layers), its dropout mode
and its members' loss.

Shape legend: B batch, b microbatch, K members (a fused array's boundaries are ``(K, B, ...)``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.planning.memplan import MemoryPlan
from sweepmaster.runtime.planning.plans import JobPlan
from sweepmaster.runtime.training.boundaries import HostBoundaries, metering
from sweepmaster.runtime.training.layerpass import (
    Layer,
    LayerPass,
    LossFn,
    backward_layers,
    forward_layers,
    release_passes,
)
from sweepmaster.runtime.training.layers import mask_pass
from sweepmaster.runtime.training.swap import CopyEngine

__all__ = ["LayerCalls", "PassMode", "PlannedPasses"]

#: The shard's layers on microbatch ``rows`` on a device and, per layer, its resident tensors:
#: ``(shard, rows, device) -> (layers, residents)``. Each layer is a callable of its input; the
#: resident tensors (parameters and buffers on the device) are what its saved tensors may name
#: instead of copying them.
LayerCalls = Callable[[int, slice, Device], tuple[list[Layer], list[list[torch.Tensor]]]]
#: The dispatch mode of a shard pass: ``(shard, mb, rows, record, device, site=0, rng=None)``
#: (dropout record / replay from ``site``; ``rng``: the dropout stream, else the job's).
#: Entered, it gives an object whose ``site`` counts the shard's random ops so far.
PassMode = Callable[..., contextlib.AbstractContextManager[Any]]


class PlannedPasses:
    """A spilled job's planned passes: kept, swapped or recomputed activations, layer by layer.

    The forward task runs :meth:`forward`, the backward task :meth:`backward` (or, when its
    passes were kept on another GPU, Hydra's recompute: :meth:`backward_runs_plan` says which).
    A job's parameters must be the same tensors in both tasks (promotes swap their data): a kept
    pass names them.

    Args:
        plan: The job plan.
        boundaries: The job's host boundaries (inputs, gradients, counted copies).
        memory_plan: The keep / swap / recompute plan of the activations, or ``None`` for
            Hydra's recompute of every activation (only :meth:`loss_fn` is used then).
        layer_calls: The job's layers of a shard (:data:`LayerCalls`).
        pass_mode: The job's dispatch mode of a shard pass (:data:`PassMode`).
        lm_loss: Each member's causal-LM loss of ``(logits, ids)``: 0-dim for one member,
            ``(K,)`` for a fused array (``logits``: ``(b, T, V)``, ``ids``: ``(b, T)``; a fused
            array: ``(K, ...)`` both).

    Raises:
        ValueError: A memory plan for another job plan (other shards or layers).

    Attributes:
        job_id: The job's name, for messages.
        num_recompute_fallbacks: Backward tasks that recomputed their shard instead of running
            the memory plan (on CUDA, the forward task ran on another GPU).
        plan_mismatches: Layer passes that saved other activations than profiled.
        activation_swap_bytes: Bytes of saved activations a memory plan moved between host
            and device so far (offloads and fetches; also in the boundaries' ``swap_bytes``).
    """

    def __init__(self, plan: JobPlan, boundaries: HostBoundaries,
                 memory_plan: MemoryPlan | None, *, layer_calls: LayerCalls,
                 pass_mode: PassMode,
                 lm_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        if memory_plan is not None:
            names = [s.layer_names for s in memory_plan.shards]
            expected = [s.layer_names for s in plan.shards]
            if names != expected:
                raise ValueError(
                    f"the memory plan is for shards of {[len(n) for n in names]} layers, the job "
                    f"plan has {[len(n) for n in expected]}: plan the memory for this job plan "
                    "(plan_memory(spec, plan))"
                )
        self.plan = plan
        self.boundaries = boundaries
        self.memory_plan = memory_plan
        self._layer_calls = layer_calls
        self._pass_mode = pass_mode
        self._lm_loss = lm_loss
        self.job_id = ""
        #: The step's recorded losses: per microbatch, each member's loss ``(1,)`` or ``(K,)``
        #: (a host copy maybe still in flight, ``copy_out``) and each member's share of the
        #: step's counted targets (one share for every member without a loss mask).
        self._losses: list[tuple[torch.Tensor, list[float]]] = []
        # shard -> per microbatch, its layers' passes (forward task -> backward task)
        self._passes: dict[int, tuple[str, list[list[LayerPass]]]] = {}
        self._engines: dict[str, CopyEngine] = {}
        self._early: dict[int, tuple[str, int]] = {}  # shard -> (device, bytes) fetched early
        self.num_recompute_fallbacks = 0
        self.plan_mismatches = 0
        self.activation_swap_bytes = 0

    def clear_losses(self) -> None:
        """Forget the recorded losses (a step starts)."""
        self._losses = []

    def take_losses(self) -> list[tuple[torch.Tensor, list[float]]]:
        """The step's recorded losses (see :meth:`loss_fn`), taken off the record.

        Read the host copies after the boundaries' ``settle_copies_out``.
        """
        with self.boundaries.counter_lock:
            losses, self._losses = self._losses, []
        return losses

    def loss_fn(self, ids: torch.Tensor, rows: slice, weight: bool, device: Device) -> LossFn:
        """The last layer's loss on a microbatch (labels ``ids`` on ``device``); records it once.

        The loss backpropagated is the members' sum (one member: its loss), weighted with
        ``weight`` by the microbatch's share of the step's counted targets (of its rows, without
        a loss mask: the boundaries' ``target_shares``); each member's unweighted loss is
        recorded with its share (:meth:`take_losses`), leaving the device without a wait.
        """
        boundaries = self.boundaries
        shares = boundaries.target_shares(rows)

        def loss_fn(logits: torch.Tensor, first: bool) -> torch.Tensor:
            loss = self._lm_loss(logits, ids)
            if first:
                host = boundaries.copy_out(device, loss.detach().reshape(-1))
                with boundaries.counter_lock:
                    self._losses.append((host, shares))
            if not weight:
                return loss.sum()
            if len(set(shares)) == 1:
                return (loss * shares[0]).sum()
            weights = torch.tensor(shares, dtype=loss.dtype)  # a fused array's members' own
            if loss.is_cuda:  # no wait for the GPU: from pinned memory, asynchronously
                weights = weights.pin_memory()
            return (loss * weights.to(loss.device, non_blocking=True)).sum()

        return loss_fn

    def _moved_activations(self, num_bytes: int) -> None:
        self.boundaries.swap_bytes += num_bytes
        self.activation_swap_bytes += num_bytes

    def _engine(self, device: Device) -> CopyEngine:
        engine = self._engines.get(device.name)
        if engine is None:
            engine = self._engines[device.name] = CopyEngine(device)
        return engine

    def forward(self, shard: int, device: Device) -> None:
        """Forward task under the memory plan: keep each layer's pass for the backward task."""
        assert self.memory_plan is not None
        boundaries = self.boundaries
        decisions = self.memory_plan.shards[shard].decisions
        engine = self._engine(device)
        moved = engine.moved_bytes
        passes: list[list[LayerPass]] = []
        self._passes[shard] = (str(device.torch_device), passes)
        try:
            for mb, rows in enumerate(boundaries.microbatches(shard)):
                host = boundaries.host_input(shard, rows, device)
                layers, residents = self._layer_calls(shard, rows, device)
                with self._pass_mode(shard, mb, rows, True, device) as mode, mask_pass():
                    y, mb_passes = forward_layers(
                        layers, decisions,
                        functools.partial(boundaries.to_device, device, host),
                        residents=residents, host_input=host, engine=engine, last=False,
                        site=lambda: mode.site, on_mismatch=self._plan_mismatch,
                    )
                passes.append(mb_passes)
                boundaries.store(boundaries.acts, shard + 1, rows, boundaries.batch_size, y,
                                 device)
                del y
                for copy in mb_passes[-1].offloads():
                    copy.release_source()
            for mb_passes in passes:  # host copies complete before the task ends
                for step in mb_passes:
                    for copy in step.offloads():
                        copy.wait()
        finally:
            self._moved_activations(engine.moved_bytes - moved)

    def backward_runs_plan(self, shard: int, device: Device) -> bool:
        """Whether the backward task runs the plan (else Hydra's recompute, after a move)."""
        if shard == len(self.plan.shards) - 1:
            return True
        where = self._passes[shard][0]
        if device.torch_device.type == "cuda" and where != str(device.torch_device):
            self.drop(shard)
            self.num_recompute_fallbacks += 1
            return False
        return True

    def drop(self, shard: int) -> None:
        """Forget the shard's kept passes (its backward recomputes, or has nothing to do)."""
        _, passes = self._passes.pop(shard, ("", []))
        self._early.pop(shard, None)
        for mb_passes in passes:
            release_passes(mb_passes)

    def backward(self, shard: int, device: Device) -> None:
        """Backward task under the memory plan: layer by layer, fetching ahead (last first).

        The gradients of the shard's parameters are in their ``.grad`` afterwards (the job
        then updates); the gradient of its input is stored for the shard before.
        """
        assert self.memory_plan is not None
        boundaries = self.boundaries
        last = shard == len(self.plan.shards) - 1
        decisions = self.memory_plan.shards[shard].decisions
        engine = self._engine(device)
        moved = engine.moved_bytes
        microbatches = boundaries.microbatches(shard)
        weight = len(microbatches) > 1
        batch = boundaries.batch_size
        passes = [] if last else self._passes.pop(shard)[1]
        early = self._early.pop(shard, None)
        if early is not None:
            self._moved_activations(early[1])
            if early[0] != device.name:  # fetched for another device: fetch it again here
                passes[0][-1].unfetch()
        try:
            for mb, rows in enumerate(microbatches):
                layers, residents = self._layer_calls(shard, rows, device)
                loss_fn = None
                if last:
                    host = boundaries.host_input(shard, rows, device)
                    x = boundaries.to_device(device, host)
                    ids = boundaries.device_targets(shard, rows, x, device)
                    loss_fn = self.loss_fn(ids, rows, weight, device)
                    inputs = [x]
                    del ids, x
                    with self._pass_mode(shard, mb, rows, True, device) as mode, \
                            mask_pass():
                        loss, mb_passes = forward_layers(
                            layers, decisions, inputs.pop, residents=residents,
                            host_input=host, engine=engine, last=True,
                            site=lambda: mode.site, loss=loss_fn,
                            on_mismatch=self._plan_mismatch,
                        )
                    passes.append(mb_passes)
                    for copy in mb_passes[-1].offloads():
                        copy.release_source()
                    grad: Callable[[], torch.Tensor] = functools.partial(
                        torch.ones, (), dtype=loss.dtype, device=device.torch_device
                    )
                    del loss
                    after = None
                else:
                    mb_passes = passes[mb]
                    grad = functools.partial(boundaries.to_device, device,
                                             boundaries.grads[shard][boundaries.row_index(rows)])
                    after = passes[mb + 1][-1] if mb + 1 < len(passes) else None

                def replay_from(site: int, mb: int = mb, rows: slice = rows) -> Any:
                    return self._pass_mode(shard, mb, rows, False, device, site)

                grad_in = backward_layers(
                    mb_passes, layers, grad, engine=engine, replay=replay_from,
                    metering=lambda: metering(device), after=after, loss=loss_fn,
                )
                del loss_fn, layers, residents
                if shard > 0:
                    assert grad_in is not None
                    boundaries.store(boundaries.grads, shard - 1, rows, batch, grad_in,
                                     device)
                del grad_in
        except BaseException:
            for mb_passes in passes:
                release_passes(mb_passes)
            raise
        finally:
            self._moved_activations(engine.moved_bytes - moved)
        boundaries.acts.pop(shard, None)
        boundaries.grads.pop(shard, None)

    def _plan_mismatch(self, position: int, saved: int, planned: int) -> None:
        """A layer saved other activations than profiled: warn once, go on."""
        if not self.plan_mismatches:
            warnings.warn(
                f"job {self.job_id!r}: a layer saved {saved} activations where the memory "
                f"plan profiled {planned} (another kernel on this device?); the extra ones "
                "follow the layer's last decision and the planned peak may be off",
                RuntimeWarning,
                stacklevel=2,
            )
        self.plan_mismatches += 1

    def fetch_early(self, shard: int, device: Device) -> bool:
        """Fetch the first item of ``shard``'s backward now, during the job's task before it.

        Only what the memory plan budgets beside that task (``early_fetch_bytes``).

        Returns:
            ``False`` when the device had no memory for it (the plan's peaks are estimates):
            the backward task fetches it itself.
        """
        assert self.memory_plan is not None
        if shard in self._early or shard not in self._passes:
            return True
        if self.memory_plan.shards[shard].early_fetch_bytes == 0:
            return True
        where, passes = self._passes[shard]
        if device.torch_device.type == "cuda" and where != str(device.torch_device):
            return True
        engine = self._engine(device)
        moved = engine.moved_bytes
        stage = passes[0][-1]
        try:
            stage.issue(engine)
        except torch.OutOfMemoryError:
            stage.unfetch()  # what was issued before the refusal is freed
            self._moved_activations(engine.moved_bytes - moved)  # those bytes did move
            return False
        self._early[shard] = (device.name, engine.moved_bytes - moved)
        return True

    def unfetch_early(self, device: Device) -> None:
        """Drop the activations fetched early onto ``device`` (it runs something else now)."""
        for shard, (name, moved) in list(self._early.items()):
            if name == device.name and shard in self._passes:
                self._passes[shard][1][0][-1].unfetch()
                self._moved_activations(moved)  # the bytes did move
                del self._early[shard]

    def release(self) -> None:
        """Free every kept pass and early fetch (the job fails or leaves its executor)."""
        for _, passes in self._passes.values():
            for mb_passes in passes:
                release_passes(mb_passes)
        self._passes.clear()
        self._early.clear()
