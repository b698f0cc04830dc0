"""A fused array's dropout noise: each member's generator state per draw, the noise made again.

Dropout in a fused array is not drawn by ``vmap``: at the start of each step every dropout draw
of the whole forward is drawn from each member's own generator in plain's order and shape
(:func:`draw_states`, with :func:`~sweepmaster.runtime.training.member_dropout.member_noise`),
keeping only the generator's state before each draw (a few bytes on the host, no device -> host
copy), and each layer pass (the forward, or a recompute) draws the noise of its rows again from
that state on the device (:func:`member_noises`): the same state, shape and strides draw the
same numbers, so a recompute makes the same noise and no mask is moved between host and device.

Rows of a microbatch: a draw of a site ``(B, ...)`` is drawn again on the full minibatch and the
rows are kept, except on the CPU, whose ``bernoulli_`` makes element ``i`` from the generator's
state and ``i`` alone (as :class:`~sweepmaster.runtime.training.replay.RandomReplay` replays it),
so only the leading rows up to the microbatch's last are drawn.

Shape legend: K members, B batch, b microbatch (rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sweepmaster.runtime.training.member_dropout import NoiseSite, member_noise
from sweepmaster.workload.spec import TrainSpec

__all__ = ["draw_states", "member_noises"]


def draw_states(site: NoiseSite, specs: Sequence[TrainSpec],
                generators: Sequence[torch.Generator]) -> list[Tensor]:
    """Each member's generator state before its draw at ``site``; the draw advances it.

    Member k draws plain's ``bernoulli(1 - p).div(1 - p)`` of ``site.shape`` from its own
    generator (on the generator's device; at an adapter's site with its own ``peft.dropout``,
    drawing nothing with 0), exactly as its plain training would, and the noise is dropped.

    Args:
        site: The dropout site (its shape ``(B, ...)``).
        specs: The members, in the array's order.
        generators: Each member's dropout generator.

    Returns:
        Per member, its generator's state before the draw (a host byte tensor).
    """
    states = []
    for spec, generator in zip(specs, generators, strict=True):
        states.append(generator.get_state())
        member_noise(site, spec, generator, generator.device)
    return states


def member_noises(site: NoiseSite, specs: Sequence[TrainSpec], states: Sequence[Tensor],
                  rows: slice, generator: torch.Generator) -> Tensor:
    """The members' noise at ``site`` for the minibatch's ``rows``, ``(K, b, ...)``.

    Drawn again on ``generator``'s device from each member's state (:func:`draw_states`):
    equal to the rows of what the member drew there.

    Args:
        site: The dropout site (its shape ``(B, ...)``).
        specs: The members, in the array's order.
        states: Each member's generator state before its draw at ``site``.
        rows: The rows of the minibatch.
        generator: A scratch generator of the members' device (its state is overwritten).

    Returns:
        The noise, contiguous ``(K, b, *site.shape[1:])``, of ``site.dtype``.
    """
    device = generator.device
    full_rows = site.shape[0]
    row_major = _rows_outermost(site)
    leading = device.type == "cpu" and row_major
    drawn = NoiseSite((rows.stop if leading else full_rows, *site.shape[1:]), site.stride,
                      site.dtype, site.p, site.adapter)
    out = torch.empty((len(specs), rows.stop - rows.start, *site.shape[1:]), dtype=site.dtype,
                      device=device)
    for k, (spec, state) in enumerate(zip(specs, states, strict=True)):
        generator.set_state(state)
        if row_major and rows.start == 0 and drawn.shape[0] == out.shape[1]:
            member_noise(drawn, spec, generator, device, out=out[k])
            continue
        noise = member_noise(drawn, spec, generator, device)
        out[k].copy_(noise[rows])
        del noise
    return out


def _rows_outermost(site: NoiseSite) -> bool:
    """Whether the site's noise is laid out row-major (its rows are its outermost dimension)."""
    return torch.empty_strided(site.shape, site.stride, device="meta").is_contiguous()
