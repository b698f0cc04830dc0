"""sweepmaster: hyperparameter sweeps of many oversized models on few devices.

A sweep is an Optuna study; its trials are trained by one executor that shares few devices among
many models. Start with ``sweepmaster launch examples/quickstart.yaml`` or, from Python, with
:class:`Executor` inside an Optuna objective.

The names below are imported on first use, so ``import sweepmaster.store`` (or the CLI) does not
pay for importing torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sweepmaster.config.schema import SweepConfig, load_sweep_config, parse_sweep_config
    from sweepmaster.config.train_specs import prepare_data
    from sweepmaster.errors import (
        ConfigError,
        DataError,
        DeviceError,
        StorageError,
        SweepmasterError,
    )
    from sweepmaster.runtime.events import (
        EvalEvent,
        ReplanEvent,
        StartEvent,
        StepEvent,
        TrainCallbacks,
    )
    from sweepmaster.sweep.objective import Executor
    from sweepmaster.sweep.observer import SweepObserver
    from sweepmaster.sweep.plan import PlannedJob, SweepPlan, plan_sweep
    from sweepmaster.sweep.results import SweepResults, TrialRow, load_results
    from sweepmaster.sweep.run import SweepOutcome, run_sweep
    from sweepmaster.workload.spec import (
        LoraSpec,
        MetricPoint,
        OptimizerSpec,
        TrainResult,
        TrainSpec,
    )
    from sweepmaster.workload.text import find_splits, make_blocks, tokenize_files


__getattr__, __dir__, __all__ = lazy_exports(globals())
