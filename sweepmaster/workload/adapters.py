"""LoRA adapters over a frozen base, built, matched, initialized and saved by HuggingFace PEFT.

LoRA (Hu et al., 2021, https://arxiv.org/abs/2106.09685) freezes a model's weights and trains a
low-rank update ``(alpha / r) * B A`` next to each targeted linear layer. PEFT's
``inject_adapter_in_model`` replaces those layers in place, so the model keeps its class (a
``GPT2LMHeadModel`` stays one, and the runtime splits it into layers as before) and every path
(plain, spilled) trains it unchanged: the frozen base has ``requires_grad=False``, so it gets no
gradient and no optimizer state. A trained adapter is saved in PEFT's own format
(``adapter_config.json``, ``adapter_model.safetensors``), which
``peft.PeftModel.from_pretrained(base, directory)`` loads.

Shape legend: r rank, in / out the features of the adapted layer.

Example:
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> model = apply_adapter(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)),
    ...                       LoraSpec(r=4, alpha=8.0, target_modules=("c_attn",)))
    >>> [name for name, p in model.named_parameters() if p.requires_grad]
    ['transformer.h.0.attn.c_attn.lora_A.default.weight', \
'transformer.h.0.attn.c_attn.lora_B.default.weight']
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from sweepmaster.workload.spec import LoraSpec

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["adaptable_module_names", "apply_adapter", "is_adapted", "lora_config", "save_adapter"]

#: Where a ``PeftModel`` keeps the model it wraps: the prefix of its saved weights' names.
_PEFT_MODEL_PREFIX = "base_model.model."
#: PEFT's warning when it switches ``fan_in_fan_out`` on for a ``Conv1D`` (GPT-2) on its own.
_FAN_IN_FAN_OUT_WARNING = r"fan_in_fan_out is set to False"


def lora_config(spec: LoraSpec, base_model_name_or_path: str | None = None) -> LoraConfig:
    """The ``peft.LoraConfig`` of a :class:`LoraSpec` (``lora_alpha=alpha``, no bias).

    Args:
        spec: The adapter.
        base_model_name_or_path: Recorded in ``adapter_config.json`` (a pretrained directory).
    """
    from peft import LoraConfig

    targets = list(spec.target_modules) if spec.target_modules is not None else None
    alpha: Any = spec.alpha  # PEFT annotates an int; any number > 0 scales alike
    return LoraConfig(r=spec.r, lora_alpha=alpha, lora_dropout=spec.dropout,
                      target_modules=targets, bias="none",
                      base_model_name_or_path=base_model_name_or_path)


def adaptable_module_names(model: nn.Module) -> list[str]:
    """The last name parts of the linear layers LoRA can adapt (``nn.Linear``, HF ``Conv1D``)."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, (nn.Linear, Conv1D))})


def apply_adapter(model: nn.Module, spec: LoraSpec | None) -> nn.Module:
    """Freeze ``model`` and inject a LoRA adapter into it, in place (PEFT).

    The adapter's ``A`` matrices ``(r, in)`` draw their Kaiming-uniform init from the global
    torch RNG, in module order, as ``peft.get_peft_model`` does; ``B`` ``(out, r)`` is zero.

    Args:
        model: The base model (e.g. from :func:`~sweepmaster.workload.causal_lm.build_model`).
        spec: The adapter, or ``None`` to return ``model`` unchanged (full fine-tuning).

    Returns:
        ``model`` itself, its base weights frozen and the adapter's weights trainable.

    Raises:
        ValueError: ``spec.target_modules`` match no module of the model (the message names
            the ones that can be adapted).
    """
    if spec is None:
        return model
    from peft import inject_adapter_in_model

    base_name = getattr(model, "name_or_path", None) or None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FAN_IN_FAN_OUT_WARNING)
            adapted: nn.Module = inject_adapter_in_model(lora_config(spec, base_name), model)
    except ValueError as err:
        if spec.target_modules is None and "target_modules" not in str(err):
            raise
        targets = list(spec.target_modules or [])
        raise ValueError(
            f"LoRA target_modules {targets} match no module of {type(model).__name__}; "
            f"expected names among its linear layers: {', '.join(adaptable_module_names(model))}"
        ) from None
    return adapted


def is_adapted(model: nn.Module) -> bool:
    """Whether PEFT injected an adapter into ``model`` (:func:`apply_adapter`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(module, BaseTunerLayer) for module in model.modules())


def save_adapter(model: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write a model's adapter in PEFT's format into an existing ``directory``.

    ``adapter_config.json`` (``peft.LoraConfig.save_pretrained``) and
    ``adapter_model.safetensors`` (``peft.get_peft_model_state_dict``: the adapter weights only,
    under the names a ``PeftModel`` gives them), as ``PeftModel.save_pretrained`` writes them;
    load with ``PeftModel.from_pretrained(base, directory)`` over the same base.

    Args:
        model: A model :func:`apply_adapter` adapted.
        directory: Where to write the two files.

    Returns:
        ``directory`` as a ``Path``.
    """
    from peft import get_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    target = Path(directory)
    config: Any = copy.copy(model.peft_config["default"])  # type: ignore[index]
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    config.save_pretrained(str(target), auto_mapping_dict={
        "base_model_class": type(model).__name__, "parent_library": type(model).__module__})
    # Named as in a PeftModel (``base_model.model.<name>``), which wraps the model it loads.
    state = {f"{_PEFT_MODEL_PREFIX}{name}": tensor.detach().cpu().contiguous()
             for name, tensor in get_peft_model_state_dict(model).items()}
    save_file(state, str(target / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    return target
