"""Dropout per member of a fused array: where the forward draws, and each member's noise.

A fused array (HFTA, Wang et al. MLSys 2021) runs K members' forward as one ``vmap``, so a
dropout there cannot draw from each member's own generator. :class:`DropoutReplay` records
where the forward draws dropout (:class:`NoiseSite`) and replays noise drawn from each
member's generator (:func:`member_noise`) exactly as plain training would draw it,
``F.scaled_dot_product_attention``'s dropout included (as ATen's math attention); a LoRA
adapter's dropout sites are marked (:func:`marking_adapter_dropout`) and drawn with each
member's own rate. :class:`SeededOpDetector` finds any other random op, which refuses to fuse.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from sweepmaster.runtime.planning.attention import sdpa_arguments
from sweepmaster.workload.spec import TrainSpec

__all__ = [
    "DropoutReplay",
    "NoiseSite",
    "SeededOpDetector",
    "marking_adapter_dropout",
    "member_noise",
]


@dataclass(frozen=True)
class NoiseSite:
    """One dropout draw of a member's forward: what ``torch.dropout`` draws there."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    p: float
    #: A LoRA adapter's dropout: each member draws it with its own ``peft.dropout``.
    adapter: bool = False



def member_noise(site: NoiseSite, spec: TrainSpec, generator: torch.Generator,
                  device: torch.device, out: Tensor | None = None) -> Tensor:
    """One member's dropout noise at ``site`` (``site.shape``): keep-mask / (1 - p), or ones.

    ``p`` is the site's, or at a LoRA adapter's site the member's own ``peft.dropout``; with
    ``p = 0`` nothing is drawn (PEFT's ``nn.Identity``) and the noise is ones. Drawn into
    ``out`` when given (of ``site``'s shape and strides, on ``device``): a tensor of the same
    strides draws the same numbers.
    """
    p = site.p
    if site.adapter:
        assert spec.peft is not None
        p = spec.peft.dropout
    noise = out if out is not None else torch.empty_strided(site.shape, site.stride,
                                                            dtype=site.dtype, device=device)
    if p == 0:
        return noise.fill_(1)
    return noise.bernoulli_(1 - p, generator=generator).div_(1 - p)



@contextlib.contextmanager
def marking_adapter_dropout(layers: Sequence[Any],
                             recorder: DropoutReplay) -> Iterator[None]:
    """Mark the dropout sites ``recorder`` records inside the layers' adapter dropouts."""

    def enter(*_: Any) -> None:
        recorder.in_adapter = True

    def leave(*_: Any) -> None:
        recorder.in_adapter = False

    handles = []
    for layer in layers:
        for dropout in layer.lora_dropout.values():
            handles += [dropout.register_forward_pre_hook(enter),
                        dropout.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class DropoutReplay(TorchFunctionMode):
    """Dropout from pre-drawn noise: records draw sites (``noises=None``) or replays them.

    Intercepts ``F.dropout`` (what ``nn.Dropout`` calls) in training with ``0 < p < 1`` and
    ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (computed as ATen's math path,
    which is what the CPU runs with dropout). Recording draws nothing.
    """

    def __init__(self, noises: list[Tensor] | None) -> None:
        super().__init__()
        self.sites: list[NoiseSite] = []
        self._noises = noises
        self._next = 0
        self.in_adapter = False  # recording: inside a LoRA adapter's dropout

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args, strict=False), **kwargs)
            x, p = bound["input"], float(bound.get("p", 0.5))
            if bound.get("training", True) and 0 < p < 1:
                noise = self._noise(x, p)
                return x.mul_(noise) if bound.get("inplace", False) else x * noise
        elif func is F.scaled_dot_product_attention:
            bound = sdpa_arguments(args, kwargs)
            if bound.get("dropout_p", 0.0) > 0:
                return _math_attention(self._noise, **bound)
        return func(*args, **kwargs)

    def _noise(self, x: Tensor, p: float) -> Tensor:
        if self._noises is None:
            reference = torch.empty_like(x)  # the strides torch.dropout's noise gets
            self.sites.append(NoiseSite(tuple(x.shape), reference.stride(), x.dtype, p,
                                         adapter=self.in_adapter))
            return torch.ones((), dtype=x.dtype, device=x.device)
        if self._next >= len(self._noises) or self._noises[self._next].shape != x.shape:
            raise RuntimeError("the forward's dropout calls differ from the probe's")
        self._next += 1
        return self._noises[self._next - 1]


def _math_attention(
    noise: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` as ATen's math path, dropout noise from ``noise``."""
    length, source_length = query.shape[-2], key.shape[-2]
    scale_factor = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    root = math.sqrt(abs(scale_factor))
    if enable_gqa:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    attn = (query * math.copysign(root, scale_factor)) @ (key.transpose(-2, -1) * root)
    if is_causal:
        attn_mask = torch.ones(length, source_length, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=attn.dtype).masked_fill(
                ~attn_mask, -math.inf
            )
        attn = attn + attn_mask
    masked_rows = (attn == -math.inf).all(dim=-1, keepdim=True)
    attn = torch.softmax(attn, dim=-1).masked_fill(masked_rows, 0.0)  # ATen's _safe_softmax
    return (attn * noise(attn, dropout_p)) @ value


class SeededOpDetector(TorchDispatchMode):
    """Collects the random (``nondeterministic_seeded``) aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Attention kernels are tagged seeded for their dropout, which DropoutReplay takes
        # over whenever it is non-zero.
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded and "scaled_dot_product" not in str(func):
            self.ops.add(str(func))
        return func(*args, **(kwargs or {}))
