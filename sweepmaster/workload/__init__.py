"""What is trained: HF causal LMs, LoRA adapters (PEFT), text datasets, TrainSpec.

Names are imported on first use (PEP 562), so that reading a config or a tokenizer
(:mod:`sweepmaster.workload.configs`, :mod:`sweepmaster.workload.text`) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.workload.causal_lm import (
        build_model,
        causal_lm_loss,
        lm_logits,
        save_weights,
        torch_dtype,
    )
    from sweepmaster.workload.configs import model_config_from_mapping
    from sweepmaster.workload.spec import (
        LoraSpec,
        MetricPoint,
        ModelSource,
        OptimizerSpec,
        TrainResult,
        TrainSpec,
    )
    from sweepmaster.workload.text import (
        find_splits,
        load_tokenizer,
        make_blocks,
        tokenize_files,
    )

_MODULES = {
    "LoraSpec": "spec", "MetricPoint": "spec", "ModelSource": "spec", "OptimizerSpec": "spec",
    "TrainResult": "spec", "TrainSpec": "spec", "build_model": "causal_lm",
    "causal_lm_loss": "causal_lm", "lm_logits": "causal_lm", "save_weights": "causal_lm",
    "torch_dtype": "causal_lm",
    "model_config_from_mapping": "configs", "find_splits": "text", "load_tokenizer": "text",
    "make_blocks": "text", "tokenize_files": "text",
}

__all__ = [
    "LoraSpec",
    "MetricPoint",
    "ModelSource",
    "OptimizerSpec",
    "TrainResult",
    "TrainSpec",
    "build_model",
    "causal_lm_loss",
    "find_splits",
    "lm_logits",
    "load_tokenizer",
    "make_blocks",
    "model_config_from_mapping",
    "save_weights",
    "tokenize_files",
    "torch_dtype",
]

__getattr__, __dir__ = lazy_exports(
    __name__, {name: f"{__name__}.{module}" for name, module in _MODULES.items()}, globals())
