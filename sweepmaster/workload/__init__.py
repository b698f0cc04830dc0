"""What is trained: HF causal LMs, LoRA adapters (PEFT), text datasets, TrainSpec.

Names are imported on first use (PEP 562), so that reading a config or a tokenizer
(:mod:`sweepmaster.workload.configs`, :mod:`sweepmaster.workload.text`) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

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
    from sweepmaster.workload.text import find_splits, load_tokenizer, make_blocks, tokenize_files

__getattr__, __dir__, __all__ = lazy_exports(globals())
