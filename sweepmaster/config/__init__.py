"""The sweep file: its schema, checks, search space, and the TrainSpecs it describes.

Reading a file (:func:`load_sweep_config`) and checking it before a launch
(:mod:`~sweepmaster.config.preflight`) import no torch; names are imported on first use
(:mod:`sweepmaster.lazy_exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sweepmaster.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from sweepmaster.config.file_checks import expected_model_type
    from sweepmaster.config.schema import SweepConfig, load_sweep_config, parse_sweep_config
    from sweepmaster.config.search_space import ParameterSpec
    from sweepmaster.config.sections import (
        DataConfig,
        ModelConfig,
        OutputConfig,
        PeftConfig,
        PrunerConfig,
        ResourcesConfig,
        SamplerConfig,
        StudyConfig,
        TrainConfig,
        TrialHeartbeatConfig,
    )
    from sweepmaster.config.value_checks import (
        DEVICE_SPEC_WORDS,
        SIZE_WORDS,
        check_devices,
        check_size,
        check_storage_option,
        storage_url_problem,
    )

__getattr__, __dir__, __all__ = lazy_exports(globals())
