"""Per-layer forward and backward of a shard under a swap/recompute plan (mu-TWO execution).

Without a memory plan, a backward shard task recomputes the shard's whole forward (Hydra). With
one (:mod:`~sweepmaster.runtime.planning.memplan`), each layer of a microbatch is a
:class:`LayerPass` of its own, on the schedule :mod:`~sweepmaster.runtime.planning.memsim`
simulates:

* :func:`forward_layers` runs the layers in order. A recomputed layer runs without grad and
  keeps only its input (on the host, or on the device in the last shard). Any other layer runs
  with grad from a :class:`~sweepmaster.runtime.training.swap.LayerEntry` under a
  :class:`~sweepmaster.runtime.training.swap.LayerPacker`, so its graph holds no device memory but
  the activations it keeps, and survives until the backward task. At the end of layer ``j``, the
  offloads of layer ``j-1`` are waited for.
* :func:`backward_layers` walks the passes from the last layer to the first, one stage each:
  wait for the stage's item (swapped activations, or a recomputed layer's input), start fetching
  the next stage's item, then backpropagate the layer (a recomputed layer first runs its forward
  again with the dropout RNG replayed from its first random op).

The gradient of each layer's input comes from its entry node; parameter gradients accumulate in
``.grad`` as in any backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sweepmaster.runtime.planning.memsim import LayerDecision
from sweepmaster.runtime.training.swap import (
    CopyEngine,
    DeviceCopy,
    HostCopy,
    LayerEntry,
    LayerPacker,
    Slot,
)

__all__ = [
    "Layer", "LayerPass", "LossFn", "backward_layers", "forward_layers", "release_passes",
]

#: ``loss(output, first)``: the last layer's loss (``first``: the forward, not a recompute).
LossFn = Callable[[torch.Tensor, bool], torch.Tensor]
#: One layer's forward: a module, or a fused array's stacked layer over its resident tensors.
Layer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class LayerPass:
    """One layer's forward of one microbatch, waiting for its backward.

    Attributes:
        index: Position of the layer in its shard.
        site: Random ops of the shard before the layer's (where its RNG replay starts).
        edge: Gradient edge of its output (not recomputed); ``None`` if nothing needs grad.
        entry: Its entry node (its input's gradient lands on it), or ``None``.
        slots: Its swapped activations.
        checkpoint: A recomputed layer's input on the host (not in the last shard).
        kept_input: A recomputed layer's input on the device (last shard).
        fetching: The checkpoint's fetch in flight.
    """

    index: int
    site: int
    edge: Any = None
    entry: Any = None
    slots: list[Slot] = field(default_factory=list)
    checkpoint: HostCopy | None = None
    kept_input: torch.Tensor | None = None
    fetching: DeviceCopy | None = None

    def issue(self, engine: CopyEngine) -> None:
        """Start fetching what the stage needs (no-op when nothing or already under way)."""
        for slot in self.slots:
            slot.fetch(engine)
        if self.checkpoint is not None and self.fetching is None and self.kept_input is None:
            self.fetching = engine.fetch(self.checkpoint.wait())

    def ready(self) -> None:
        """Wait until the stage's fetches are on the device."""
        for slot in self.slots:
            slot.ready()
        if self.fetching is not None:
            self.kept_input = self.fetching.wait()
            self.fetching = None

    def unfetch(self) -> None:
        """Drop what :meth:`issue` fetched (e.g. to another device); keep the host copies."""
        for slot in self.slots:
            slot.release()
        if self.fetching is not None:
            self.fetching.wait()
            self.fetching = None
        if self.checkpoint is not None:
            self.kept_input = None

    def offloads(self) -> list[HostCopy]:
        """Offloads this pass started (or host copies it reads)."""
        copies = [slot.host for slot in self.slots if slot.host is not None]
        if self.checkpoint is not None:
            copies.append(self.checkpoint)
        return copies

    def release(self) -> None:
        """Drop everything the pass holds (device copies, host copies, its graph)."""
        for slot in self.slots:
            slot.release()
        if self.fetching is not None:
            self.fetching.wait()
        self.slots, self.checkpoint, self.kept_input, self.fetching = [], None, None, None
        self.edge = self.entry = None


def forward_layers(
    layers: Sequence[Layer],
    decisions: Sequence[LayerDecision],
    make_input: Callable[[], torch.Tensor],
    *,
    residents: Sequence[Sequence[torch.Tensor]],
    host_input: torch.Tensor,
    engine: CopyEngine,
    last: bool,
    site: Callable[[], int],
    loss: LossFn | None = None,
    on_mismatch: Callable[[int, int, int], None] | None = None,
) -> tuple[torch.Tensor, list[LayerPass]]:
    """Run a shard's layers on one microbatch, keeping each layer's pass (see the module doc).

    Args:
        layers: The shard's layers (modules, or callables of one input).
        decisions: One per layer.
        make_input: Promotes the shard's input, ``(b, ...)`` (called once, here, so that the
            input can go when the first layer no longer needs it).
        residents: Per layer, its parameters and buffers.
        host_input: The host tensor the input is promoted from.
        engine: The device's copy engine.
        last: Whether this is the last shard (recomputed layers keep their input on the device).
        site: Random ops of the shard's dropout mode so far.
        loss: The last layer's loss, when the shard ends with it.
        on_mismatch: Called with ``(layer position, activations saved, activations planned)``
            when a layer saves another number of activations than profiled (e.g. the profile
            ran another attention kernel); the extra ones follow the layer's last decision.

    Returns:
        The output (detached; the loss when ``loss`` is given) and the passes, in layer order.
    """
    passes: list[LayerPass] = []
    previous: list[HostCopy] = []
    x = make_input()
    anchor = torch.empty(0, device=x.device, requires_grad=True)
    num_layers = len(layers)
    for position, (layer, decision) in enumerate(zip(layers, decisions, strict=True)):
        step = LayerPass(position, site())
        ends = loss if position == num_layers - 1 else None
        if decision.recompute:
            if last:
                step.kept_input = x
            elif position == 0:
                step.checkpoint = HostCopy(host_input, None)
            else:
                step.checkpoint = engine.offload(x)
            with torch.no_grad():
                y = layer(x)
                if ends is not None:
                    y = ends(y, True)
        else:
            packer = LayerPacker(
                residents[position],
                x,
                swap=decision.swap,
                engine=engine,
                host_input=host_input if position == 0 else None,
            )
            with torch.enable_grad():
                x_in = LayerEntry.apply(x, anchor) if x.is_floating_point() else x
                with packer.hooks():
                    y = layer(x_in)
                    if ends is not None:
                        y = ends(y, True)
            if len(packer.slots) != len(decision.swap) and on_mismatch is not None:
                on_mismatch(position, len(packer.slots), len(decision.swap))
            if y.requires_grad:
                step.edge = torch.autograd.graph.get_gradient_edge(y)
            step.entry = x_in.grad_fn if x_in is not x else None
            step.slots = [slot for slot in packer.slots if slot.swap]
            packer.close()
            y = y.detach()
            del x_in
        for copy in previous:
            copy.release_source()
        previous = step.offloads()
        passes.append(step)
        x = y
    return x, passes


def backward_layers(
    passes: Sequence[LayerPass],
    layers: Sequence[Layer],
    output_grad: Callable[[], torch.Tensor],
    *,
    engine: CopyEngine,
    replay: Callable[[int], contextlib.AbstractContextManager[Any]],
    metering: Callable[[], contextlib.AbstractContextManager[Any]],
    after: LayerPass | None = None,
    loss: LossFn | None = None,
) -> torch.Tensor | None:
    """Backpropagate one microbatch through a shard's passes, last layer first.

    Args:
        passes: The microbatch's passes (from :func:`forward_layers`).
        layers: The shard's layers.
        output_grad: Makes the gradient of the shard's output on the device (a scalar 1 for
            the loss); called once, after the first fetch is issued, so that nothing else holds
            the gradient once it is used.
        engine: The device's copy engine.
        replay: ``replay(site)``: the dropout mode that replays the shard from a random op.
        metering: The device's metering context.
        after: The pass whose items to fetch during the first layer's stage (the next
            microbatch's last layer), or ``None``.
        loss: The last layer's loss, when the shard ends with it.

    Returns:
        The gradient of the shard's input, or ``None`` when it has none (token ids).
    """
    num_layers = len(passes)
    passes[-1].issue(engine)
    grad_in: torch.Tensor | None = output_grad()
    for position in range(num_layers - 1, -1, -1):
        step = passes[position]
        step.ready()
        upcoming = passes[position - 1] if position > 0 else after
        if upcoming is not None:
            upcoming.issue(engine)
        assert grad_in is not None
        if step.kept_input is not None:  # recomputed
            x = step.kept_input
            step.kept_input = None
            if x.is_floating_point():
                x = x.detach().requires_grad_(True)
            with replay(step.site):
                y = layers[position](x)
                if loss is not None and position == num_layers - 1:
                    y = loss(y, False)
            edge = torch.autograd.graph.get_gradient_edge(y) if y.requires_grad else None
            del y
            with metering():
                if edge is not None:
                    torch.autograd.backward(edge, grad_in)  # type: ignore[arg-type]
            del edge
            grad_in = x.grad if x.is_floating_point() else None
            del x
        else:
            with metering():
                if step.edge is not None:
                    torch.autograd.backward(step.edge, grad_in)
            grad_in = step.entry.grad if step.entry is not None else None
            if step.entry is not None:
                step.entry.grad = None
        step.release()
    return grad_in


def release_passes(passes: Sequence[LayerPass]) -> None:
    """Drop passes that will not be backpropagated (after a failure), waiting for their copies."""
    for step in passes:
        for copy in step.offloads():
            copy.wait()
        step.release()
