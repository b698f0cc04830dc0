"""sweepmaster: hyperparameter sweeps of many oversized models on few devices.

A sweep is an Optuna study; its trials are trained by one executor that shares few devices among
many models. Start with ``sweepmaster launch examples/quickstart.yaml`` or, from Python, with
:class:`Executor` inside an Optuna objective.

The names below are imported on first use, so ``import sweepmaster.store`` (or the CLI) does not
pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "sweepmaster.errors",
    "DataError": "sweepmaster.errors",
    "DeviceError": "sweepmaster.errors",
    "StorageError": "sweepmaster.errors",
    "SweepmasterError": "sweepmaster.errors",
    "SweepConfig": "sweepmaster.config",
    "load_sweep_config": "sweepmaster.config",
    "parse_sweep_config": "sweepmaster.config",
    "Executor": "sweepmaster.objective",
    "PlannedJob": "sweepmaster.planning",
    "SweepPlan": "sweepmaster.planning",
    "plan_sweep": "sweepmaster.planning",
    "SweepResults": "sweepmaster.results",
    "TrialRow": "sweepmaster.results",
    "load_results": "sweepmaster.results",
    "EvalEvent": "sweepmaster.runtime.events",
    "ReplanEvent": "sweepmaster.runtime.events",
    "StartEvent": "sweepmaster.runtime.events",
    "StepEvent": "sweepmaster.runtime.events",
    "TrainCallbacks": "sweepmaster.runtime.events",
    "SweepObserver": "sweepmaster.sweep",
    "SweepOutcome": "sweepmaster.sweep",
    "prepare_data": "sweepmaster.sweep",
    "run_sweep": "sweepmaster.sweep",
    "LoraSpec": "sweepmaster.workload.spec",
    "MetricPoint": "sweepmaster.workload.spec",
    "OptimizerSpec": "sweepmaster.workload.spec",
    "TrainResult": "sweepmaster.workload.spec",
    "TrainSpec": "sweepmaster.workload.spec",
    "find_splits": "sweepmaster.workload.text",
    "make_blocks": "sweepmaster.workload.text",
    "tokenize_files": "sweepmaster.workload.text",
}

__all__ = [
    "ConfigError",
    "DataError",
    "DeviceError",
    "EvalEvent",
    "Executor",
    "LoraSpec",
    "MetricPoint",
    "OptimizerSpec",
    "PlannedJob",
    "ReplanEvent",
    "StartEvent",
    "StepEvent",
    "StorageError",
    "SweepConfig",
    "SweepObserver",
    "SweepOutcome",
    "SweepPlan",
    "SweepResults",
    "SweepmasterError",
    "TrainCallbacks",
    "TrainResult",
    "TrainSpec",
    "TrialRow",
    "find_splits",
    "load_results",
    "load_sweep_config",
    "make_blocks",
    "parse_sweep_config",
    "plan_sweep",
    "prepare_data",
    "run_sweep",
    "tokenize_files",
]

if TYPE_CHECKING:
    from sweepmaster.config import SweepConfig, load_sweep_config, parse_sweep_config
    from sweepmaster.errors import (
        ConfigError,
        DataError,
        DeviceError,
        StorageError,
        SweepmasterError,
    )
    from sweepmaster.objective import Executor
    from sweepmaster.planning import PlannedJob, SweepPlan, plan_sweep
    from sweepmaster.results import SweepResults, TrialRow, load_results
    from sweepmaster.runtime.events import (
        EvalEvent,
        ReplanEvent,
        StartEvent,
        StepEvent,
        TrainCallbacks,
    )
    from sweepmaster.sweep import SweepObserver, SweepOutcome, prepare_data, run_sweep
    from sweepmaster.workload.spec import (
        LoraSpec,
        MetricPoint,
        OptimizerSpec,
        TrainResult,
        TrainSpec,
    )
    from sweepmaster.workload.text import find_splits, make_blocks, tokenize_files


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sweepmaster' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
