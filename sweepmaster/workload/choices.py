"""The closed sets of names a job's settings take (optimizer, schedule, metric, dtype).

Without torch, so that the sweep file's schema (:mod:`sweepmaster.config.sections`) validates
against the same names as :class:`~sweepmaster.workload.spec.OptimizerSpec` and ``TrainSpec``
while ``status`` and ``--help`` stay free of torch.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = ["OPTIMIZER_SETTINGS", "Dtype", "Metric", "OptimizerName", "Schedule"]

#: The optimizers of the table (:data:`~sweepmaster.runtime.training.optimizers.OPTIMIZERS`).
OptimizerName: TypeAlias = Literal["adamw", "sgd", "lion"]
Schedule: TypeAlias = Literal["constant", "linear", "cosine"]
Metric: TypeAlias = Literal["eval_loss", "eval_perplexity", "train_loss"]
Dtype: TypeAlias = Literal["float32", "bfloat16", "float16"]

#: The ``OptimizerSpec`` / ``train.*`` settings each optimizer reads, beside the table's entries
#: (:data:`~sweepmaster.runtime.training.optimizers.OPTIMIZERS` takes them from here), so that
#: the sweep file's checks know them without importing torch.
OPTIMIZER_SETTINGS: dict[str, tuple[str, ...]] = {
    "adamw": ("lr", "weight_decay", "betas", "eps"),
    "sgd": ("lr", "weight_decay", "momentum", "nesterov"),
    "lion": ("lr", "weight_decay", "betas"),
}
