"""The attention kernel a profile traces: the one the run takes on the target device type.

A profile of fake CPU tensors (:mod:`~sweepmaster.runtime.planning.profile`) dispatches
``F.scaled_dot_product_attention`` as the CPU does: under dropout, the math path, which saves the
``(B, H, T, T)`` attention weights and dropout mask. A GPU runs a fused kernel that saves the
output and a log-sum-exp instead (PyTorch's SDPA dispatch: FlashAttention, Dao 2022,
https://arxiv.org/abs/2205.14135, for fp16 / bf16 without a mask; else the memory-efficient
kernel, Rabe & Staats 2021, https://arxiv.org/abs/2112.05682). Traced on the CPU's path, GPT-2
124M at T = 1024, B = 8 was planned at 11.3 GiB with dropout against 8.0 GiB without.
:func:`attention_kernel` routes the call to that fused kernel's op for a CUDA target, whose meta
kernels run on fake tensors anywhere, so the bytes are the run's.

Shape legend: B batch, H heads, T tokens, D head width.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["AttentionMode", "FusedAttention", "attention_kernel", "sdpa_arguments"]

_SDPA_PARAMETERS = (
    "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``F.scaled_dot_product_attention`` call's arguments, each by its parameter's name.

    Example:
        >>> sorted(sdpa_arguments(("q", "k", "v"), {"dropout_p": 0.1}))
        ['dropout_p', 'key', 'query', 'value']

    Args:
        args: The call's positional arguments (``query``, ``key``, ``value``, ``attn_mask``,
            ``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``, in that order).
        kwargs: Its keyword arguments.

    Returns:
        Every argument given, by name; ``F.scaled_dot_product_attention(**bound)`` makes the
        same call.
    """
    return {**dict(zip(_SDPA_PARAMETERS, args, strict=False)), **kwargs}


class AttentionMode(TorchFunctionMode):
    """A torch function mode that changes how ``F.scaled_dot_product_attention`` runs.

    Every other function runs unchanged; an attention call goes to :meth:`attention` with its
    arguments by name (:func:`sdpa_arguments`).
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self.attention(sdpa_arguments(args, kwargs))

    def attention(self, bound: dict[str, Any]) -> Any:
        """Run one attention call; ``F.scaled_dot_product_attention(**bound)`` runs it as is.

        Args:
            bound: The call's arguments by name.

        Returns:
            The attention output, shaped like the call's.
        """
        raise NotImplementedError


class FusedAttention(AttentionMode):
    """``F.scaled_dot_product_attention`` as CUDA's fused kernels run it (see the module doc).

    Calls the fused ops cannot take (grouped-query ``enable_gqa``, inputs not
    ``(B, H, T, D)``) pass through unchanged.
    """

    def attention(self, bound: dict[str, Any]) -> Any:
        """Run the call as the fused kernel CUDA would pick (flash or memory-efficient)."""
        query_BHTD, key_BHTD, value_BHTD = bound["query"], bound["key"], bound["value"]
        if bound.get("enable_gqa", False) or query_BHTD.dim() != 4:
            return F.scaled_dot_product_attention(**bound)
        mask = bound.get("attn_mask")
        dropout_p = float(bound.get("dropout_p", 0.0))
        causal = bool(bound.get("is_causal", False))
        scale = bound.get("scale")
        if mask is None and query_BHTD.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query_BHTD, key_BHTD, value_BHTD, dropout_p, causal, False, scale=scale)[0]
        if mask is not None and mask.dtype == torch.bool:  # the kernel takes an additive bias
            bias = torch.zeros(mask.shape, dtype=query_BHTD.dtype, device=mask.device)
            mask = bias.masked_fill(~mask, float("-inf"))
        if mask is not None:
            mask = mask.expand(query_BHTD.shape[0], query_BHTD.shape[1],
                               query_BHTD.shape[2], key_BHTD.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query_BHTD, key_BHTD, value_BHTD, mask, torch.is_grad_enabled(), dropout_p, causal,
            scale=scale)[0]


def attention_kernel(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The attention a profile for ``device_type`` traces: CUDA's fused kernels, else as is.

    Args:
        device_type: The target device's type (``"cuda"``, ``"cpu"``, ...).

    Returns:
        A :class:`FusedAttention` mode for ``"cuda"``, else a null context (the CPU, and a
        virtual device, run the kernel the trace dispatches).
    """
    return FusedAttention() if device_type == "cuda" else contextlib.nullcontext()
