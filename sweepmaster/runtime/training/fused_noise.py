"""A fused array's dropout noise: drawn per member at a step's start, packed 8 draws a byte.

Dropout in a fused array is not drawn by ``vmap``: at the start of each step every dropout draw
of the whole forward is drawn from each member's own generator in plain's order and shape
(:func:`draw_packed`, with :func:`~sweepmaster.runtime.training.member_dropout.member_noise`), kept
on the host as masks packed 8 draws a byte and each member's scale ``1 / (1 - p)``
(:func:`pack_mask`), and each layer pass unpacks and scales its rows back to the drawn noise
on the device (:func:`unpack_noise`): a 32nd of the float noise's bytes is promoted, and a
recompute makes the same noise again.

Shape legend: K members, B batch, b microbatch (rows), n elements of one row's draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from sweepmaster.runtime.training.member_dropout import NoiseSite, member_noise
from sweepmaster.workload.spec import TrainSpec

__all__ = ["draw_packed", "pack_mask", "unpack_noise"]

#: Bit positions of a packed dropout mask byte (see :func:`pack_mask`).
_BITS = torch.arange(8, dtype=torch.uint8)


def draw_packed(site: NoiseSite, specs: Sequence[TrainSpec],
                generators: Sequence[torch.Generator]) -> tuple[Tensor, Tensor]:
    """One dropout site's noise, member k's from its generator, as masks and scales.

    Member k's noise is plain's ``bernoulli(1 - p).div(1 - p)``; it is kept on the host as
    its mask, packed 8 draws a byte (``(K, B, ceil(n / 8))`` uint8, :func:`pack_mask`: a
    32nd of float32's bytes to promote) and its nonzero value ``(K,)``, so that
    ``mask * scale`` is the drawn noise exactly. At an adapter's site member k drops with its
    own ``peft.dropout``; with 0 it draws nothing (PEFT's ``nn.Identity``) and its noise is
    ones.

    Args:
        site: The dropout site (its shape ``(B, ...)``).
        specs: The members, in the array's order.
        generators: Each member's dropout generator (drawn on its device).

    Returns:
        The packed masks ``(K, B, ceil(n / 8))`` uint8 and scales ``(K,)``, on the host.
    """
    masks, scales = [], []
    for spec, generator in zip(specs, generators, strict=True):
        noise = member_noise(site, spec, generator, generator.device)
        masks.append(noise != 0)
        scales.append(noise.amax())
    mask_K, scale_K = torch.stack(masks).to("cpu"), torch.stack(scales).to("cpu")
    return pack_mask(mask_K), scale_K


def unpack_noise(packed_K: Tensor, scale_K: Tensor, row_shape: tuple[int, ...]) -> Tensor:
    """The drawn noise ``(K, b, *row_shape)`` from packed masks ``(K, b, ceil(n / 8))``.

    On the device of ``packed_K`` and ``scale_K`` ``(K,)``: each mask times its member's scale.
    """
    num_rows, size = packed_K.shape[1], math.prod(row_shape)
    bits = packed_K.unsqueeze(-1).bitwise_right_shift(_BITS.to(packed_K.device)) & 1
    del packed_K
    noise_K = bits.reshape(len(scale_K), num_rows, -1)[..., :size].to(scale_K.dtype)
    del bits
    noise_K = noise_K.view(len(scale_K), num_rows, *row_shape)
    return noise_K.mul_(scale_K.view((-1,) + (1,) * (noise_K.dim() - 1)))


def pack_mask(mask_K: Tensor) -> Tensor:
    """Bool masks ``(K, B, ...)`` packed 8 a byte per row: ``(K, B, ceil(n / 8))`` uint8.

    Bit ``j`` of byte ``i`` of a row is its element ``8 i + j`` (row-major); the row is padded
    with zeros to a multiple of 8. :func:`unpack_noise` unpacks it.
    """
    num_members, num_rows = mask_K.shape[:2]
    flat = mask_K.reshape(num_members, num_rows, -1).to(torch.uint8)
    pad = -flat.shape[-1] % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(num_members, num_rows, pad)], dim=-1)
    bits = flat.view(num_members, num_rows, -1, 8).bitwise_left_shift(_BITS)
    return bits.sum(-1, dtype=torch.uint8)
