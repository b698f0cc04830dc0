"""Causal language models: build them, run them, score them, save them.

A model comes from a :data:`~sweepmaster.workload.spec.ModelSource`: a factory, a HuggingFace
config (random init), or pretrained weights: a local directory or a hub id (its snapshot in the
HuggingFace cache, :mod:`sweepmaster.workload.hub`). Random init draws only
from the global torch RNG, so the caller seeds it (``torch.manual_seed``) before
:func:`build_model`.

Shape legend: B batch (blocks), T tokens per block, V vocabulary size.

Example:
    >>> import torch
    >>> config = model_config_from_mapping({"n_layer": 2, "n_embd": 32, "n_head": 2}, 50257)
    >>> _ = torch.manual_seed(0)
    >>> model = build_model(config)
    >>> input_ids_BT = torch.randint(0, 50257, (2, 16))
    >>> loss = causal_lm_loss(lm_logits(model, input_ids_BT), input_ids_BT)
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from sweepmaster.errors import DataError
from sweepmaster.workload.adapters import apply_adapter, is_adapted, save_adapter
from sweepmaster.workload.configs import model_config_from_mapping
from sweepmaster.workload.hub import resolve
from sweepmaster.workload.spec import LoraSpec, ModelSource

__all__ = [
    "build_base",
    "build_model",
    "causal_lm_loss",
    "finish_model",
    "lm_logits",
    "model_config_from_mapping",
    "placeholder_init",
    "save_weights",
    "torch_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map ``"float32"``, ``"bfloat16"`` or ``"float16"`` to the torch dtype.

    Raises:
        ValueError: Any other name.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def build_model(source: ModelSource, dtype: str = "float32", peft: LoraSpec | None = None,
                ) -> nn.Module:
    """Build a fresh causal LM from a model source, in training mode on the CPU.

    Random init happens in float32 and draws only from the global torch RNG (the base, then a
    LoRA adapter's ``A`` matrices); the model is then cast to ``dtype``. So a seeded
    ``build_model`` gives the same weights whatever the dtype path. It is
    :func:`finish_model` of :func:`build_base`: a caller that needs one base for several
    adapters builds it once and finishes copies of it.

    Args:
        source: A factory (called with no arguments), a ``PretrainedConfig``
            (``AutoModelForCausalLM.from_config``), or a directory saved with
            ``save_pretrained`` or a hub id (``AutoModelForCausalLM.from_pretrained`` of the
            directory, or of the id's snapshot: :func:`~sweepmaster.workload.hub.resolve`).
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        peft: A LoRA adapter to inject with PEFT
            (:func:`~sweepmaster.workload.adapters.apply_adapter`): the base is frozen, only
            the adapter trains; ``None``: every weight trains.

    Returns:
        The model (parameters cast to ``dtype``).

    Raises:
        ValueError: Unknown ``dtype``, or ``peft.target_modules`` match no module.
        TypeError: A factory returned something that is not an ``nn.Module``.
        DataError: Pretrained weights cannot be loaded from ``source``.
    """
    return finish_model(build_base(source, dtype), dtype, peft)


def build_base(source: ModelSource, dtype: str = "float32") -> nn.Module:
    """The first half of :func:`build_model`: the model of ``source``, no adapter, not cast.

    A config is initialized in float32, drawing from the global torch RNG; a pretrained
    directory is loaded in ``dtype``; a factory is called.

    Args:
        source: As :func:`build_model`'s.
        dtype: As :func:`build_model`'s (only a pretrained directory is loaded in it here).

    Returns:
        The model, in whatever mode its constructor left it.

    Raises:
        ValueError: Unknown ``dtype``.
        TypeError: A factory returned something that is not an ``nn.Module``.
        DataError: Pretrained weights cannot be loaded from ``source``.
    """
    target_dtype = torch_dtype(dtype)
    model: nn.Module
    if isinstance(source, PretrainedConfig):
        # from_config writes the chosen attention implementation into the config it is given;
        # a copy keeps the caller's config (and its architecture key) as it was.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(source))
    elif isinstance(source, (str, os.PathLike)):
        folder = resolve(source).path  # a hub id: its snapshot, downloaded once
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, dtype=target_dtype
            )
        except (OSError, ValueError) as err:
            raise DataError(f"{source}: cannot load a pretrained causal LM: {err}") from err
    elif callable(source):
        model = source()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model factory returned {type(model).__name__}, not an nn.Module")
    else:
        raise TypeError(f"unsupported model source {type(source).__name__}")
    return model


def finish_model(model: nn.Module, dtype: str = "float32", peft: LoraSpec | None = None,
                 ) -> nn.Module:
    """The second half of :func:`build_model`: inject ``peft``, cast to ``dtype``, train mode.

    A LoRA adapter's ``A`` matrices draw their init from the global torch RNG, continuing
    the stream the base's init (:func:`build_base`) left.

    Args:
        model: A base from :func:`build_base`, changed in place.
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        peft: The adapter to inject, or ``None`` (every weight trains).

    Returns:
        ``model``.

    Raises:
        ValueError: Unknown ``dtype``, or ``peft.target_modules`` match no module.
    """
    target_dtype = torch_dtype(dtype)
    model = apply_adapter(model, peft)
    model.to(target_dtype)
    model.train()
    return model


#: Period of :func:`placeholder_init`'s values (a prime, so rows of a weight matrix differ).
_PLACEHOLDER_PERIOD = 4093


@contextlib.contextmanager
def placeholder_init() -> Iterator[None]:
    """Within this thread, random init fills tensors with cheap deterministic values instead.

    For models whose weights are never used, only their speed and bytes (a fusion
    measurement): every ``normal_(mean, std)`` and ``uniform_(a, b)`` that initializes a tensor
    (``torch.nn.init``, HuggingFace's ``_init_weights``, PEFT's adapters) writes a fixed
    sequence with the same mean and standard deviation (``mean + std * sqrt(3) * u``, or
    ``(a + b) / 2 + (b - a) / 2 * u``, with ``u`` a permutation of
    :data:`_PLACEHOLDER_PERIOD` evenly spaced values in ``[-1, 1]``, repeated), at the cost of a
    memory copy: no random numbers are drawn, so the host generators are left as they were.
    Constant inits (ones, zeros), buffers (causal masks, rotary frequencies) and every other
    op run as usual, and the model has the same parameters, dtypes and bytes as a seeded build.
    The fill allocates only ``_PLACEHOLDER_PERIOD`` values per init call, beside the tensor.

    A ``TorchDispatchMode``: thread-local, so models built meanwhile in other threads (a
    sweep's real trials) are initialized as always.

    Example:
        >>> from transformers import GPT2Config
        >>> with placeholder_init():
        ...     model = build_model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
        >>> float(model.transformer.ln_f.weight.min())  # constant inits as usual
        1.0
    """
    with _PlaceholderInit():
        yield


class _PlaceholderInit(TorchDispatchMode):
    """The dispatch mode of :func:`placeholder_init`."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.normal_.default:
            mean = float(args[1] if len(args) > 1 else kwargs.get("mean", 0.0))
            std = float(args[2] if len(args) > 2 else kwargs.get("std", 1.0))
            return _fill_placeholder(args[0], mean, std * math.sqrt(3))
        if func is torch.ops.aten.uniform_.default:
            low = float(args[1] if len(args) > 1 else kwargs.get("from", 0.0))
            high = float(args[2] if len(args) > 2 else kwargs.get("to", 1.0))
            return _fill_placeholder(args[0], (low + high) / 2, (high - low) / 2)
        return func(*args, **kwargs)


def _fill_placeholder(tensor: torch.Tensor, center: float, half_width: float) -> torch.Tensor:
    """Fill ``tensor`` with ``center + half_width * u``, ``u`` repeating in ``[-1, 1]``."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return tensor
    period = _PLACEHOLDER_PERIOD
    index = torch.arange(period, dtype=torch.float64)
    u = (index * 1597).remainder(period).mul_(2 / (period - 1)).sub_(1)
    values = (u * half_width + center).to(device=tensor.device, dtype=tensor.dtype)
    n = tensor.numel()
    if not tensor.is_contiguous():
        return tensor.copy_(values.repeat(-(-n // period))[:n].view(tensor.shape))
    flat = tensor.view(-1)
    rows = n // period
    if rows:
        flat[: rows * period].view(rows, period).copy_(values.expand(rows, period))
    flat[rows * period:].copy_(values[: n - rows * period])
    return tensor


def lm_logits(model: nn.Module, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Run a causal LM forward and return its logits.

    A HuggingFace model runs without a KV cache (``use_cache=False``): training never reads
    one, and filling it changes how some families (OPT) order the backward sums of attention
    dropout, so the layers of :func:`~sweepmaster.runtime.training.layers.decompose` (which run
    uncached) would match the whole model only to rounding.

    Args:
        model: An HF causal LM (output with ``.logits``) or a module returning logits.
        input_ids_BT: int64 token ids ``(B, T)``.

    Returns:
        ``logits_BTV`` in the model's dtype.

    Raises:
        TypeError: The model output is neither a tensor nor has ``.logits``.
    """
    if isinstance(model, PreTrainedModel):
        output = model(input_ids_BT, use_cache=False)
    else:
        output = model(input_ids_BT)
    if isinstance(output, torch.Tensor):
        return output
    logits_BTV = getattr(output, "logits", None)
    if not isinstance(logits_BTV, torch.Tensor):
        raise TypeError(f"model output {type(output).__name__} has no .logits tensor")
    return logits_BTV


#: The target of the last position, which predicts no token (``ignore_index``).
_IGNORED_TARGET = -100


def causal_lm_loss(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats), computed in float32.

    Position t predicts token t + 1, so the mean is over ``B * (T - 1)`` tokens. The targets are
    shifted instead of the logits (the last position's target is ignored), as transformers does, so
    the ``(B, T, V)`` logits are never copied into a shifted ``(B, T - 1, V)`` tensor: on a GPT-2
    vocabulary that copy costs about a sixth of a small model's step.

    Args:
        logits_BTV: Logits ``(B, T, V)``.
        input_ids_BT: The input ids ``(B, T)`` (also the targets, shifted by one).

    Returns:
        A float32 scalar tensor.

    Raises:
        TypeError: ``logits_BTV`` is not a tensor (a model's forward returned something else).
        ValueError: ``logits_BTV`` is not ``(B, T, V)`` for ids ``(B, T)``: the model's forward
            does not map token ids to per-position logits.
    """
    if not isinstance(logits_BTV, torch.Tensor):
        raise TypeError(f"the model returned {type(logits_BTV).__name__} for input ids of shape "
                        f"{tuple(input_ids_BT.shape)}; its forward must map token ids (B, T) "
                        "to logits (B, T, V)")
    if logits_BTV.dim() != 3 or logits_BTV.shape[:2] != input_ids_BT.shape:
        raise ValueError(f"the model returned logits of shape {tuple(logits_BTV.shape)} for "
                         f"input ids of shape {tuple(input_ids_BT.shape)}; its forward must map "
                         "token ids (B, T) to logits (B, T, V)")
    vocab_size = logits_BTV.shape[-1]
    targets_BT = F.pad(input_ids_BT[:, 1:], (0, 1), value=_IGNORED_TARGET)
    return F.cross_entropy(logits_BTV.float().reshape(-1, vocab_size), targets_BT.reshape(-1),
                           ignore_index=_IGNORED_TARGET)


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it: not thread-safe)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc (not Linux): set and put back at once
    os.umask(mask)
    return mask


def _with_umask_modes(root: Path) -> None:
    """Give ``root`` and everything in it the modes the umask gives new folders and files.

    ``tempfile.mkdtemp`` makes a folder owner-only (0700), and libraries write through
    temporary files (0600), whatever the umask; the saved weights would keep those modes once
    renamed into place, and a teammate sharing the server could not read them.
    """
    mask = _umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def save_weights(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Save a model's weights into ``directory``, atomically.

    A model with a LoRA adapter is saved as its adapter alone, in PEFT's format
    (:func:`~sweepmaster.workload.adapters.save_adapter`); a ``PreTrainedModel`` with
    ``save_pretrained`` (config plus safetensors, loadable with ``from_pretrained``); any other
    module as ``torch.save(state_dict)`` to ``model.pt``. The files
    are written to a temporary sibling directory that then replaces ``directory``, so a reader sees
    the old checkpoint or the complete new one, never a partial one. Folders and files get the
    modes the process's umask gives (with the usual 022: readable by others).

    Args:
        model: The model to save.
        directory: The checkpoint directory (created, or replaced if it exists).

    Returns:
        ``directory`` as a ``Path``.
    """
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        if is_adapted(model):
            save_adapter(model, tmp_dir)
        elif isinstance(model, PreTrainedModel):
            model.save_pretrained(tmp_dir)
        else:
            torch.save(model.state_dict(), tmp_dir / "model.pt")
        _with_umask_modes(tmp_dir)
        if target.exists():
            old_dir = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            os.replace(target, old_dir / target.name)
            os.replace(tmp_dir, target)
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.replace(tmp_dir, target)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return target
