"""Checks of a parsed sweep file that its schema alone cannot make.

The model (exactly one of ``model.config`` and ``model.pretrained``; its fields, positions and
files), the data (files, tokenizer, dataset keys), the resources against the machine, the
trackers' libraries, and each ``parameters:`` path against the schema and what it changes.
Each raises :class:`~sweepmaster.errors.ConfigError` naming the file and the key. The checks
that need the data read or a model built, per configuration of the search space, are
:mod:`~sweepmaster.config.preflight`'s.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import stat
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from sweepmaster.config.search_space import check_parameter_path, did_you_mean, normalize_parameter
from sweepmaster.config.sections import PeftConfig, TrainConfig
from sweepmaster.config.value_checks import check_host_memory
from sweepmaster.errors import ConfigError, DataError
from sweepmaster.study import PRUNER_CLASSES, SAMPLER_CLASSES
from sweepmaster.workload.choices import OPTIMIZER_SETTINGS
from sweepmaster.workload.configs import model_config_from_mapping
from sweepmaster.workload.families import FAMILIES, supported_model_types
from sweepmaster.workload.text import cached_tokenizer, directory_stamp, find_splits

__all__ = [
    "PIP_EXTRA",
    "TRACKER_LIBRARIES",
    "check_config_parameter_path",
    "check_data_section",
    "check_metric_has_data",
    "check_model_section",
    "check_optuna_values",
    "check_parameter_takes_effect",
    "check_report_to",
    "check_resources",
    "expected_model_type",
    "missing_library",
    "normalized_parameters",
    "not_a_file",
]


if TYPE_CHECKING:
    from sweepmaster.config.schema import SweepConfig


#: Config sections a ``parameters:`` path may point into.
_PARAMETER_SECTIONS = ("model", "data", "train")


def check_optuna_values(config: SweepConfig) -> None:
    """Build the sampler and the pruner once, so Optuna rejects bad values before any write.

    The keywords' names and types are checked by ``check_optuna_kwargs``; their values (a
    negative ``n_startup_trials``, ``min_resource: 0``) only by the classes themselves.
    """
    study = config.study
    for key, choice, classes in (("study.sampler", study.sampler, SAMPLER_CLASSES),
                                 ("study.pruner", study.pruner, PRUNER_CLASSES)):
        kwargs = choice.kwargs()
        if choice.type == "grid":
            kwargs["search_space"] = config.grid_space()
        if key == "study.sampler" and study.seed is not None:
            kwargs["seed"] = study.seed
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ExperimentalWarning of some keywords
                classes[choice.type](**kwargs)
        except (TypeError, ValueError, OverflowError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigError(config.source, key, f"arguments optuna's "
                              f"{classes[choice.type].__name__} accepts: {detail}") from None




def expected_model_type(model_type: object) -> str:
    """What a ``model_type`` must be, for the error about ``model_type`` (one of FAMILIES).

    A misspelled type (one transformers does not know either) gets a did-you-mean among the
    families sweepmaster can split, never a transformers type it would refuse next.
    """
    from transformers import CONFIG_MAPPING

    families = supported_model_types()
    typo = not isinstance(model_type, str) or model_type not in CONFIG_MAPPING
    return (f"a causal LM family sweepmaster can split into layers ({', '.join(families)}), "
            f"got {model_type!r}{did_you_mean(model_type, families) if typo else ''}")


@functools.cache
def _model_config_fields(model_type: str) -> tuple[tuple[str, ...], str]:
    """The keys ``model.config`` may hold for a model type, and the config class name."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return tuple(sorted(set(cls().to_dict()) | set(cls.attribute_map))), cls.__name__


def check_model_section(config: SweepConfig, check_files: bool) -> None:
    """Check ``model``: one of config and pretrained, its fields, positions and files."""
    source, model = config.source, config.model
    if (model.config is None) == (model.pretrained is None):
        got = "both" if model.config is not None else "neither"
        raise ConfigError(source, "model", "exactly one of model.config (a model config mapping) "
                          f"and model.pretrained (a model directory), got {got}")
    if model.config is not None:
        model_type = model.config.get("model_type", "gpt2")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ConfigError(source, "model.config.model_type", expected_model_type(model_type))
        fields, class_name = _model_config_fields(model_type)
        for name in model.config:
            if name not in fields:
                raise ConfigError(source, f"model.config.{name}", "unknown key (not a field of "
                                  f"{class_name}){did_you_mean(name, fields)}")
        try:
            hf_config = model_config_from_mapping(model.config)
        except Exception as exc:  # transformers' validation: type errors and config checks
            found = re.search(r"field '(\w+)'", str(exc))
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = re.sub(r"^\w+Error: (Field '\w+' )?", "", lines[-1] if lines else repr(exc))
            if not found:  # a check of the whole config (e.g. the width against the heads)
                detail = f"a config {class_name} accepts, got: {detail}"
            raise ConfigError(source, f"model.config.{found[1]}" if found else "model.config",
                              detail) from None
        positions, positions_key = next(
            ((value, name) for name in ("n_positions", "max_position_embeddings")
             if isinstance(value := getattr(hf_config, name, None), int)),
            (1024, "n_positions"))
        _check_positions(config, positions, f"model.config.{positions_key}")
    elif check_files and model.pretrained is not None:
        _check_pretrained(config, model.pretrained)


def _check_pretrained(config: SweepConfig, pretrained: str) -> None:
    """A model directory, or a hub id that can be had, with a readable config.json."""
    if config.model.revision is not None and Path(pretrained).is_dir():
        raise ConfigError(config.source, "model.revision", "only with a HuggingFace hub id in "
                          f"model.pretrained, got the directory {pretrained}")
    snapshot = config.pretrained_snapshot()
    assert snapshot is not None
    try:
        saved = json.loads((snapshot.path / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(config.source, "model.pretrained",
                          f"a model directory with a readable config.json, got {pretrained}") \
            from None
    positions = saved.get("n_positions", saved.get("max_position_embeddings", 1024))
    if isinstance(positions, int):
        _check_positions(config, positions, f"{pretrained}'s n_positions")


def _check_positions(config: SweepConfig, positions: int, what: str) -> None:
    if config.data.block_size > positions:
        raise ConfigError(config.source, "data.block_size",
                          f"at most {what} ({positions}), got {config.data.block_size}")


def check_data_section(config: SweepConfig, check_files: bool) -> None:
    """Check ``data``: one source, its files and tokenizer, the dataset's keys."""
    source, data = config.source, config.data
    given = [name for name in ("dir", "train_files", "dataset") if getattr(data, name) is not None]
    if len(given) != 1:
        got = f"both {' and '.join(f'data.{name}' for name in given)}" if len(given) == 2 \
            else "all three" if given else "neither"
        raise ConfigError(source, "data", "exactly one of data.dir (a WikiText-2 directory), "
                          f"data.train_files and data.dataset, got {got}")
    _check_dataset_keys(config)
    if data.dir is not None and data.valid_files is not None:
        raise ConfigError(source, "data.valid_files", "only with data.train_files "
                          "(data.dir has its own valid split)")
    if data.train_files is not None and not data.train_files:
        raise ConfigError(source, "data.train_files", "a non-empty list of text files")
    if not check_files:
        return
    if data.dir is not None:
        if not data.dir.is_dir():
            raise ConfigError(source, "data.dir", f"an existing directory, got {data.dir}")
        try:
            splits = find_splits(data.dir)
        except DataError as exc:
            odd = [p for p in sorted(data.dir.glob("wiki.*")) if not p.is_file()
                   and p.name in {f"wiki.{s}.{x}" for s in ("train", "valid") for x in
                                  ("tokens", "raw")}]
            got = f"{exc} ({not_a_file(odd[0])})" if odd else str(exc)
            raise ConfigError(source, "data.dir", f"a WikiText-2 directory: {got}") from None
        for split, path in splits.items():
            _check_text_file(config, "data.dir", path,
                             f"a WikiText-2 directory with a readable, non-empty {split} split")
    for files in (data.data_files or {}).values():
        for file in [files] if isinstance(files, str) else files:
            if not any(ch in file for ch in "*?[") and os.path.lexists(file) \
                    and not Path(file).is_file():
                raise ConfigError(source, "data.data_files", f"existing files; "
                                  f"{not_a_file(Path(file))}")
    if data.dataset is not None and os.path.lexists(data.dataset) \
            and not (Path(data.dataset).is_dir() or Path(data.dataset).is_file()):
        raise ConfigError(source, "data.dataset", "a datasets builder, a save_to_disk folder "
                          f"or a hub dataset id, got {not_a_file(Path(data.dataset))}")
    if data.cache_dir is not None and os.path.lexists(data.cache_dir) \
            and not data.cache_dir.is_dir():
        raise ConfigError(source, "data.cache_dir", "a directory for the token cache, got "
                          f"{data.cache_dir}, which is not a directory")
    for name in ("train_files", "valid_files"):
        for path in getattr(data, name) or []:
            if not path.is_file():
                raise ConfigError(source, f"data.{name}", f"existing files; {not_a_file(path)}")
            _check_text_file(config, f"data.{name}", path, "readable, non-empty text files")
    tokenizer = config.tokenizer_snapshot().path
    if not tokenizer.is_dir():
        raise ConfigError(source, "data.tokenizer", f"a tokenizer directory, got {tokenizer} "
                          "(no such directory)")
    if not ((tokenizer / "tokenizer.json").is_file()
            or ((tokenizer / "vocab.json").is_file() and (tokenizer / "merges.txt").is_file())):
        raise ConfigError(source, "data.tokenizer", "a tokenizer directory with tokenizer.json "
                          f"or vocab.json and merges.txt, got {tokenizer}")
    problem = _tokenizer_problem(str(tokenizer), directory_stamp(tokenizer.absolute()))
    if problem is not None:
        raise ConfigError(source, "data.tokenizer", f"a loadable tokenizer directory, got "
                          f"{tokenizer}: {problem}")


#: The optional dependencies that install every tracker: ``pip install 'sweepmaster[trackers]'``.
PIP_EXTRA = "trackers"

#: ``output.report_to`` names -> the Python package each tracker needs
#: (:data:`~sweepmaster.sweep.trackers.TRACKERS` opens their runs).
TRACKER_LIBRARIES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def missing_library(name: str) -> str | None:
    """The Python package tracker ``name`` needs that is not installed, or ``None``.

    Example:
        >>> missing_library("tensorboard") in (None, "tensorboard")
        True

    Raises:
        KeyError: ``name`` is not in :data:`TRACKER_LIBRARIES`.
    """
    library = TRACKER_LIBRARIES[name]
    return None if importlib.util.find_spec(library) is not None else library


def check_report_to(config: SweepConfig) -> None:
    """Every tracker of ``output.report_to`` has its library installed."""
    for name in config.output.report_to:
        library = missing_library(name)
        if library is not None:
            raise ConfigError(config.source, "output.report_to", f"trackers whose library is "
                              f"installed: {name} needs the {library} package (pip install "
                              f"'sweepmaster[{PIP_EXTRA}]', or pip install {library})")


def _check_dataset_keys(config: SweepConfig) -> None:
    """The ``datasets`` keys only with ``data.dataset``, and formats and splits that agree."""
    source, data = config.source, config.data
    keys = ("config_name", "data_files", "eval_split", "eval_fraction", "text_field",
            "prompt_field", "completion_field", "messages_field")
    if data.dataset is None:
        for key in keys:
            if getattr(data, key) is not None:
                raise ConfigError(source, f"data.{key}", "only with data.dataset (a datasets "
                                  "builder, save_to_disk folder or hub dataset id)")
        if not data.packing or data.train_split != "train":
            key = "data.packing" if not data.packing else "data.train_split"
            raise ConfigError(source, key, "only with data.dataset")
        return
    if data.eval_split is not None and data.eval_fraction is not None:
        raise ConfigError(source, "data.eval_fraction", "not with data.eval_split (one "
                          "evaluation split: a split of the dataset or a held-out fraction)")
    formats = [name for name, fields in (
        ("text_field", (data.text_field,)),
        ("prompt_field", (data.prompt_field, data.completion_field)),
        ("messages_field", (data.messages_field,))) if any(f is not None for f in fields)]
    if len(formats) > 1:
        raise ConfigError(source, f"data.{formats[1]}", "one format: data.text_field, "
                          "data.prompt_field with data.completion_field, or data.messages_field"
                          f", got data.{formats[0]} too")
    if (data.prompt_field is None) != (data.completion_field is None):
        missing, given = ("prompt_field", "completion_field") if data.prompt_field is None \
            else ("completion_field", "prompt_field")
        raise ConfigError(source, f"data.{missing}", f"a column name beside data.{given} "
                          "(prompt-completion rows need both), got none")


def check_resources(config: SweepConfig) -> None:
    """Check that ``resources``' CPU devices fit the machine's memory."""
    resources = config.resources
    try:
        check_host_memory(resources.devices, resources.device_memory)
    except ValueError as err:
        key = "resources.device_memory" if resources.device_memory is not None \
            else "resources.devices"
        raise ConfigError(config.source, key, str(err)) from None


def not_a_file(path: Path) -> str:
    """What ``path`` is instead of a regular file, e.g. ``"a directory: /data"``."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"no such file: {path}"
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    what = next((word for test, word in kinds if test(mode)), "something else")
    return f"{path} is {what}, not a regular file"


def check_metric_has_data(config: SweepConfig) -> None:
    """An evaluation metric needs validation text (else the objective is the training loss)."""
    data, metric = config.data, config.study.metric
    if data.dataset is not None and data.eval_split is None and data.eval_fraction is None \
            and metric != "train_loss":
        raise ConfigError(config.source, "study.metric", "train_loss, or data.eval_split or "
                          f"data.eval_fraction to compute {metric} on, got {metric!r}")
    if data.train_files is not None and not data.valid_files and metric != "train_loss":
        raise ConfigError(config.source, "study.metric", "train_loss, or data.valid_files to "
                          f"compute {metric} on (data.train_files has no validation split), "
                          f"got {metric!r}")


def _check_text_file(config: SweepConfig, key: str, path: Path, expected: str) -> None:
    """A data file must be readable and not empty (the rest is checked when tokenizing)."""
    if not path.is_file():  # a FIFO would block the read below
        raise ConfigError(config.source, key, f"{expected}, got {not_a_file(path)}")
    try:
        with path.open("rb") as file:
            empty = not file.read(1)
    except OSError as exc:
        raise ConfigError(config.source, key, f"{expected}, got {path}: "
                          f"{exc.strerror or exc}") from None
    if empty:
        raise ConfigError(config.source, key, f"{expected}, got an empty file {path}")


@functools.lru_cache(maxsize=32)
def _tokenizer_problem(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> str | None:
    """Load the tokenizer once per directory state; return the first line of what failed."""
    try:
        cached_tokenizer(directory)
    except DataError as exc:
        cause = exc.__cause__ or exc
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        return lines[0] if lines else type(cause).__name__
    except Exception as exc:  # the tokenizers library raises plain Exception on bad JSON
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return None


@functools.cache
def _parameter_paths(config_type: type[BaseModel]) -> tuple[str, ...]:
    """The dotted paths a ``parameters:`` entry may set, of a sweep config class."""
    paths = []
    for section in _PARAMETER_SECTIONS:
        cls = config_type.model_fields[section].annotation
        assert isinstance(cls, type) and issubclass(cls, BaseModel)
        paths += [f"{section}.{name}" for name in cls.model_fields
                  if (section, name) != ("model", "config")]
    paths += [f"model.peft.{name}" for name in PeftConfig.model_fields]
    return tuple(paths)


def check_config_parameter_path(config: SweepConfig, path: str, key: str) -> None:
    """Check that ``path`` names a setting of ``config`` a parameter may set (error at ``key``)."""
    fields, class_name = None, ""
    if config.model.config is not None:
        fields, class_name = _model_config_fields(config.model.config.get("model_type", "gpt2"))
    check_parameter_path(path, key, config.source, _parameter_paths(type(config)), fields,
                         class_name)


def normalized_parameters(config: SweepConfig) -> SweepConfig:
    """``config`` with each ``parameters:`` entry checked and its distribution made explicit."""
    normalized = {}
    for path, spec in config.parameters.items():
        check_config_parameter_path(config, path, f"parameters.{path}")
        normalized[path] = normalize_parameter(spec, f"parameters.{path}", config.source)
    return config.model_copy(update={"parameters": normalized})


#: Settings of some optimizers only: a parameter sweeping one under another optimizer does
#: nothing (``train.<setting>`` -> the optimizers that read it).
_OPTIMIZER_SETTINGS = {
    f"train.{setting}": names
    for setting in TrainConfig.model_fields
    if 0 < len(names := [name for name, read in OPTIMIZER_SETTINGS.items()
                         if setting in read]) < len(OPTIMIZER_SETTINGS)
}


def check_parameter_takes_effect(config: SweepConfig, path: str) -> None:
    """Check that a parameter sets something the trials use.

    Trials that differ only in a setting nothing reads would train the same thing under a
    value that means nothing.

    Raises:
        ConfigError: ``model.peft.*`` without ``model.peft`` (every weight trains, no adapter),
            an optimizer's own setting (``train.momentum``: SGD's, ``train.betas``:
            AdamW's and Lion's) while every trial uses another optimizer, or
            ``train.epochs`` while ``train.max_steps`` (which overrides it) is set.
    """
    key = f"parameters.{path}"
    if path.startswith("model.peft.") and config.model.peft is None:
        raise ConfigError(config.source, key, "model.peft to be set: without a LoRA adapter "
                          "every weight trains and model.peft settings do nothing (add "
                          "model.peft: {type: lora})")
    if path == "train.epochs" and config.train.max_steps is not None \
            and "train.max_steps" not in config.parameters:
        raise ConfigError(config.source, key, "train.max_steps: null (train.max_steps "
                          "overrides train.epochs: every trial runs "
                          f"{config.train.max_steps} steps), got {config.train.max_steps}")
    optimizers = _OPTIMIZER_SETTINGS.get(path)
    if optimizers is not None and "train.optimizer" not in config.parameters \
            and config.train.optimizer not in optimizers:
        names = " or ".join(optimizers)
        raise ConfigError(config.source, key, f"train.optimizer: {names} ({path} is "
                          f"{names}'s setting and does nothing with "
                          f"{config.train.optimizer}), got {config.train.optimizer!r}")
