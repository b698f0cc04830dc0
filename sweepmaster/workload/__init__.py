"""What is trained: HF causal LMs, text datasets, TrainSpec."""

from sweepmaster.workload.models import (
    build_model,
    causal_lm_loss,
    lm_logits,
    model_config_from_mapping,
    save_weights,
    torch_dtype,
)
from sweepmaster.workload.spec import (
    MetricPoint,
    ModelSource,
    OptimizerSpec,
    TrainResult,
    TrainSpec,
)
from sweepmaster.workload.text import find_splits, load_tokenizer, make_blocks, tokenize_files

__all__ = [
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
