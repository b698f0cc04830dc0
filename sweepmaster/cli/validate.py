"""``sweepmaster validate``: check a sweep file without touching any database."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

from sweepmaster.cli.console import ProcessMode, console, guarded
from sweepmaster.cli.options import SetOption, sweep_file_argument


def validate(
    sweep_file: Annotated[Path, sweep_file_argument("check")],
    overrides: SetOption = None,
) -> None:
    """Check a sweep.yaml and print its search space, without touching any database.

    Checks everything that can fail before training, for every grid cell and the bounds of
    every range: the schema, the model config, the data (read and tokenized as far as needed),
    the paths, and the SWEEPMASTER_* environment settings. ``--set`` overrides settings of the
    file as for launch, so a launch command line is checked as it would run.
    """
    if ProcessMode.whole_process:
        _import_transformers_without_torch()
    from sweepmaster.config.preflight import check_environment, check_sweep
    from sweepmaster.config.schema import load_sweep_config

    def check() -> None:
        check_environment()
        config = load_sweep_config(sweep_file, overrides or ())
        check_sweep(config)
        console.print(f"{sweep_file}: sweep {config.name!r} is valid", markup=False)
        for name, dist in config.search_space().items():
            console.print(f"  {name}: {dist}", highlight=False, markup=False)
        for name, value in config.constants().items():
            console.print(f"  {name} = {value!r}", highlight=False, markup=False)
        if config.study.sampler.type == "grid":
            console.print(f"  grid of {config.grid_size()} configurations")

    guarded(check)


def _import_transformers_without_torch() -> None:
    """Import transformers as if torch were not installed, for a process that only validates.

    ``validate`` uses transformers' tokenizers and config classes, never a model class, but
    importing either imports torch whenever torch is installed (``configuration_utils`` imports
    ``modeling_rope_utils``): a second of a two-second command. Hidden while transformers loads,
    torch is left out as on a machine without it (transformers' supported tokenizers-and-configs
    mode); it stays importable (a ``cuda:N`` device spec imports it). Only for a process that
    runs nothing else after (:func:`main`): a model built later in it would find no torch.
    """
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # not its note that PyTorch was not found
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails, no spec
    try:
        import transformers.configuration_utils  # noqa: F401
        import transformers.models.auto.tokenization_auto  # noqa: F401
    finally:
        del sys.modules["torch"]
        if verbosity is None:
            del os.environ["TRANSFORMERS_VERBOSITY"]
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = verbosity
    from transformers.utils import logging as transformers_logging

    level = logging.getLevelName((verbosity or "warning").upper())  # a number if a level name
    transformers_logging.set_verbosity(level if isinstance(level, int) else logging.WARNING)
