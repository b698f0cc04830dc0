"""The sweep.yaml schema: a file in, a validated :class:`SweepConfig` out.

Every user error raises :class:`~sweepmaster.errors.ConfigError` with a one-line message
``"<file>: <dotted.key>: <expected>"``; no training starts on an invalid file. Relative data and
tokenizer paths are taken relative to the YAML file (like docker-compose), ``storage`` and
``output.dir`` relative to the working directory. The ``parameters:`` search space (W&B sweep
syntax) is described in :mod:`sweepmaster.config.search_space`.

Example:
    >>> config = load_sweep_config("examples/quickstart.yaml")
    >>> config.study.sampler.type, sorted(config.search_space())
    ('grid', ['train.batch_size', 'train.lr'])
    >>> config.with_params({"train.lr": 1e-3}).train.lr
    0.001
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from optuna.distributions import BaseDistribution
from pydantic import Field, PrivateAttr, ValidationError, field_validator

from sweepmaster.config.file_checks import (
    check_config_parameter_path,
    check_data_section,
    check_metric_has_data,
    check_model_section,
    check_optuna_values,
    check_parameter_takes_effect,
    check_report_to,
    check_resources,
    normalized_parameters,
    not_a_file,
)
from sweepmaster.config.search_space import (
    MAX_GRID_CELLS,
    ParameterSpec,
    check_optuna_kwargs,
    check_parameter_values,
    grid_values,
    representative_values,
    set_path,
    to_distribution,
)
from sweepmaster.config.sections import (
    DataConfig,
    ModelConfig,
    OutputConfig,
    ResourcesConfig,
    Section,
    StudyConfig,
    TrainConfig,
)
from sweepmaster.config.validation_errors import format_validation_error
from sweepmaster.config.value_checks import (
    check_devices,
    check_host_memory,
    check_size,
    storage_url_problem,
)
from sweepmaster.config.yaml_loader import MAX_CHARS, load_yaml
from sweepmaster.errors import ConfigError, DataError
from sweepmaster.study import PRUNER_CLASSES, SAMPLER_CLASSES
from sweepmaster.workload.hub import HubRevisionError, Snapshot, is_hub_id, resolve

__all__ = [
    "SweepConfig",
    "load_sweep_config",
    "parse_sweep_config",
]


#: Longest sweep name: it names a directory, and file systems allow 255 bytes per name.
_MAX_NAME_CHARS = 200
#: Keys the schema gained after sweeps were recorded: left out of the canonical text while at
#: their defaults, so that the recorded text of an earlier sweep still matches.
_LATER_KEYS = (
    ("model", "revision"), ("model", "trust_remote_code"), ("output", "report_to"),
    *(("data", key) for key in ("dataset", "config_name", "data_files", "train_split",
                                "eval_split", "eval_fraction", "text_field", "prompt_field",
                                "completion_field", "messages_field", "packing")),
)




class SweepConfig(Section):
    """A validated sweep.yaml, built by :func:`load_sweep_config` or :func:`parse_sweep_config`.

    Attributes:
        name: The sweep and Optuna study name.
        storage: SQLAlchemy URL of the database (relative SQLite paths: working directory).
        study: Sampler, pruner, objective and trial count.
        model: What to train.
        data: Text and tokenizer.
        train: Training settings every trial starts from.
        resources: The devices trials train on (not part of :meth:`canonical_text`).
        output: Checkpoints.
        parameters: Dotted config path -> spec, with ``distribution`` made explicit.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    storage: str = "sqlite:///sweepmaster.db"
    study: StudyConfig = StudyConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig
    train: TrainConfig = TrainConfig()
    resources: ResourcesConfig = ResourcesConfig()
    output: OutputConfig = OutputConfig()
    parameters: dict[str, ParameterSpec] = Field(default_factory=dict)

    @field_validator("storage")
    @classmethod
    def _check_storage(cls, value: str) -> str:
        problem = storage_url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("name")
    @classmethod
    def _check_name_length(cls, value: str) -> str:
        if len(value) > _MAX_NAME_CHARS:
            raise ValueError(f"expected a name of at most {_MAX_NAME_CHARS} characters (it names "
                             f"the sweep's directory under output.dir)")
        return value

    _source: str = PrivateAttr("<mapping>")
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _check_files: bool = PrivateAttr(True)

    @property
    def source(self) -> str:
        """The file the config came from (not part of dumps, the text or the fingerprint)."""
        return self._source

    def search_space(self) -> dict[str, BaseDistribution]:
        """Return the sampled parameters as Optuna distributions (constants excluded)."""
        return {path: to_distribution(spec) for path, spec in self.parameters.items()
                if spec.distribution != "constant"}

    def constants(self) -> dict[str, Any]:
        """Return the ``value:`` parameters, dotted path -> value."""
        return {path: spec.value for path, spec in self.parameters.items()
                if spec.distribution == "constant"}

    def largest_value(self, path: str) -> float | None:
        """The largest number parameter ``path`` can take, or ``None`` if it sets none.

        A constant's ``value``, the largest of ``values:``, or a range's ``max``; ``None``
        when ``parameters`` has no entry ``path`` or its values hold no number.

        Example:
            >>> config.largest_value("model.peft.r")  # {values: [4, 64]}  # doctest: +SKIP
            64
        """
        spec = self.parameters.get(path)
        if spec is None:
            return None
        numbers = [v for v in representative_values(spec)
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return max(numbers, default=None)

    def grid_space(self) -> dict[str, list[Any]]:
        """Return the grid of ``GridSampler``: dotted path -> its values (constants excluded).

        Raises:
            ConfigError: A parameter has a continuous distribution, which no grid enumerates,
                or the grid has more than :data:`~sweepmaster.config.search_space.MAX_GRID_CELLS`
                cells.
        """
        space = {path: grid_values(spec, f"parameters.{path}", self._source)
                 for path, spec in self.parameters.items() if spec.distribution != "constant"}
        num_cells = math.prod(len(values) for values in space.values())
        if num_cells > MAX_GRID_CELLS:
            raise ConfigError(self._source, "parameters", f"a grid of at most {MAX_GRID_CELLS} "
                              f"configurations, got {num_cells} (a TPE or random sampler with "
                              "study.n_trials samples a large space)")
        return space

    def grid_size(self) -> int:
        """Return the number of grid points (1 for an empty search space).

        Raises:
            ConfigError: As :meth:`grid_space`.
        """
        return math.prod(len(values) for values in self.grid_space().values())

    def with_params(self, params: Mapping[str, Any]) -> SweepConfig:
        """Return the config of one trial: constants and ``params`` applied, then re-validated.

        Args:
            params: Dotted config path -> value, e.g. an Optuna trial's ``params``.

        Returns:
            A new validated config (``parameters`` kept as they are).

        Raises:
            ConfigError: A path is not a parameter path, or the result is invalid (e.g. a
                sampled ``data.block_size`` above ``model.config.n_positions``).
        """
        raw = self.model_dump()
        for path, value in {**self.constants(), **params}.items():
            check_config_parameter_path(self, path, path)
            set_path(raw, path, value)
        return _build(raw, self._source, self._base_dir, self._check_files, False)

    def with_resources(self, devices: str | None = None,
                       device_memory: str | int | None = None) -> SweepConfig:
        """Return the config with ``resources`` overridden, e.g. by ``launch --devices``.

        Args:
            devices: A device spec replacing ``resources.devices``, or ``None`` to keep it.
            device_memory: A size replacing ``resources.device_memory``, or ``None``.

        Returns:
            A new config (the same one when nothing is overridden).

        Raises:
            ConfigError: A bad spec or size; the message names the option (``--devices``,
                ``--device-memory``) and what was expected.
        """
        if devices is None and device_memory is None:
            return self
        update: dict[str, Any] = {}
        try:
            if devices is not None:
                option = "--devices"
                check_devices(devices)
                update["devices"] = devices
            if device_memory is not None:
                option = "--device-memory"
                check_size(device_memory)
                update["device_memory"] = device_memory
            option = "--devices" if devices is not None else "--device-memory"
            check_host_memory(update.get("devices", self.resources.devices),
                              update.get("device_memory", self.resources.device_memory))
        except ValueError as err:
            value = devices if option == "--devices" else device_memory
            raise ConfigError(option, "", f"{err}, got {value!r}") from None
        return self.model_copy(update={"resources": self.resources.model_copy(update=update)})

    def canonical_text(self) -> str:
        """Return a deterministic JSON (hence YAML) text of the resolved config, keys sorted.

        ``resources`` is left out: which devices train the trials never changes their results
        (spilling and fusion are exact), so a sweep may resume, or be joined, on other devices
        (``launch --devices``) and remain the same sweep. So are keys of :data:`_LATER_KEYS` at
        their defaults: a sweep recorded before the schema had them relaunches as the same
        sweep. A password in ``storage`` is masked
        (:func:`~sweepmaster.store.engine.masked_text`): this text is stored in the database
        and served by the dashboard.
        """
        from sweepmaster.store.engine import masked_text

        dump = self.model_dump(mode="json", exclude={"resources"})
        for section, key in _LATER_KEYS:
            field = type(getattr(self, section)).model_fields[key]
            if getattr(getattr(self, section), key) == field.get_default(
                    call_default_factory=True):
                del dump[section][key]
        return masked_text(json.dumps(dump, sort_keys=True, indent=2))

    def fingerprint(self) -> str:
        """Return the SHA-256 hex digest of :meth:`canonical_text`."""
        return hashlib.sha256(self.canonical_text().encode()).hexdigest()

    def pretrained_snapshot(self) -> Snapshot | None:
        """The local folder (and hub commit) of ``model.pretrained``; ``None`` with a config.

        A hub id is resolved once per process (:func:`~sweepmaster.workload.hub.resolve`).

        Raises:
            ConfigError: ``model.pretrained`` is neither a directory nor a hub id that can be
                had (unknown, gated, offline and not cached; key ``model.pretrained``), or
                the repository has no ``model.revision`` (key ``model.revision``).
        """
        model = self.model
        if model.pretrained is None:
            return None
        return _snapshot(self, "model.pretrained", model.pretrained, model.revision, "model")

    def tokenizer_snapshot(self) -> Snapshot:
        """The local folder of ``data.tokenizer``: a directory, or a hub id's snapshot.

        A hub id naming the repository of ``model.pretrained`` follows ``model.revision``.

        Raises:
            ConfigError: As :meth:`pretrained_snapshot`, for key ``data.tokenizer``.
        """
        name = str(self.data.tokenizer)
        revision = self.model.revision if name == self.model.pretrained else None
        return _snapshot(self, "data.tokenizer", name, revision, "tokenizer")


def _snapshot(config: SweepConfig, key: str, name: str, revision: str | None,
              kind: Literal["model", "tokenizer"]) -> Snapshot:
    """:func:`~sweepmaster.workload.hub.resolve`, its errors as one line naming ``key``."""
    try:
        return resolve(name, revision, kind=kind,
                       trust_remote_code=config.model.trust_remote_code)
    except HubRevisionError as exc:
        raise ConfigError(config.source, "model.revision", "a branch, tag or commit of "
                          f"{name} that can be had, got {exc}") from None
    except DataError as exc:
        what = ("a model directory saved with save_pretrained or a HuggingFace hub id"
                if kind == "model" else "a tokenizer directory or a HuggingFace hub id")
        raise ConfigError(config.source, key, f"{what}, got {exc}") from None


def load_sweep_config(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> SweepConfig:
    """Read and validate a sweep.yaml.

    Args:
        path: The YAML file. Relative data paths in it are taken relative to its directory.
        overrides: ``"dotted.key=value"`` entries applied on top of the file as if written in
            it (``value`` is read as YAML: ``1e-4``, ``[4, 8]``, ``null``), e.g.
            ``"data.dir=/datasets/wikitext-2"`` from ``launch --set``.

    Returns:
        The validated config, with absolute data paths.

    Raises:
        ConfigError: The file is missing or unreadable, is not valid YAML (the message gives
            line:column; see :func:`~sweepmaster.config.yaml_loader.load_yaml` for duplicate keys
            and size limits), is not a mapping, breaks the schema, or names missing data files.
    """
    file = Path(path)
    source = str(file)
    try:
        if not file.is_file() and file.exists():  # a FIFO would block, a device never end
            raise ConfigError(source, "", f"a YAML text file, got {not_a_file(file)}")
        with file.open("rb") as stream:  # no more than a document may hold
            data = stream.read(MAX_CHARS + 1)
        if len(data) > MAX_CHARS:
            raise ConfigError(source, "", f"a YAML file of at most {MAX_CHARS} bytes (a sweep "
                              f"file takes a few thousand), got {file.stat().st_size}")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, "", f"cannot read a YAML text file: {exc}") from None
    raw = load_yaml(text, source)
    if overrides and isinstance(raw, dict):
        for entry in overrides:
            key, sep, value = entry.partition("=")
            if not sep or not key.strip():
                raise ConfigError(source, "--set", f"expected KEY=VALUE, got {entry!r}")
            try:
                parsed = load_yaml(value, source, key.strip()) if value.strip() else ""
            except ConfigError as exc:
                if not exc.expected.startswith("invalid YAML"):
                    raise
                parsed = value  # not YAML: the text itself
            set_path(raw, key.strip(), parsed)
    return parse_sweep_config(raw, source, file.parent.absolute())


def parse_sweep_config(raw: Mapping[str, Any], source: str = "<mapping>",
                       base_dir: Path | None = None, check_files: bool = True) -> SweepConfig:
    """Validate an already-parsed sweep.yaml mapping.

    Args:
        raw: The mapping, as ``yaml.safe_load`` would return it.
        source: Where it came from, for error messages.
        base_dir: Directory relative data paths are taken from; ``None``: the working directory.
        check_files: Check that the data and tokenizer files exist.

    Returns:
        The validated config.

    Raises:
        ConfigError: ``raw`` is not a mapping, breaks the schema, or (with ``check_files``) names
            missing files.
    """
    if not isinstance(raw, Mapping):
        got = "an empty file" if raw is None else type(raw).__name__
        raise ConfigError(source, "", f"expected a mapping of sweep settings, got {got}")
    return _build(dict(raw), source, base_dir or Path.cwd(), check_files, True)


def _build(raw: dict[str, Any], source: str, base_dir: Path, check_files: bool,
           check_parameters: bool) -> SweepConfig:
    try:
        config = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise format_validation_error(exc, source, raw, SweepConfig) from None
    config = _resolve_paths(config, base_dir)
    config._source, config._base_dir, config._check_files = source, base_dir, check_files
    for key, choice, classes in (("study.sampler", config.study.sampler, SAMPLER_CLASSES),
                                 ("study.pruner", config.study.pruner, PRUNER_CLASSES)):
        check_optuna_kwargs(classes[choice.type], choice.kwargs(), key, source)
    check_model_section(config, check_files)
    check_data_section(config, check_files)
    check_resources(config)
    check_metric_has_data(config)
    check_report_to(config)
    if check_parameters:
        config = normalized_parameters(config)
    if config.study.sampler.type == "grid":
        config.grid_space()
    elif config.study.n_trials is None:
        raise ConfigError(source, "study.n_trials", "required with the "
                          f"{config.study.sampler.type} sampler (only grid defaults to its size)")
    if check_parameters:
        check_optuna_values(config)
        validate = functools.partial(_build, source=source, base_dir=base_dir,
                                     check_files=check_files, check_parameters=False)
        check_parameter_values(config.parameters, config.model_dump(), source, validate)
        for path in config.parameters:
            check_parameter_takes_effect(config, path)
    return config



def _under(base_dir: Path, path: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else Path(os.path.normpath(base_dir / path))


def _resolve_paths(config: SweepConfig, base_dir: Path) -> SweepConfig:
    data = config.data
    update: dict[str, Any] = {}
    tokenizer = _under(base_dir, data.tokenizer)
    if tokenizer.exists() or not is_hub_id(str(data.tokenizer)):  # else a hub id, kept as is
        update["tokenizer"] = tokenizer
    for name in ("dir", "cache_dir"):
        if getattr(data, name) is not None:
            update[name] = _under(base_dir, getattr(data, name))
    for name in ("train_files", "valid_files"):
        if getattr(data, name) is not None:
            update[name] = [_under(base_dir, p) for p in getattr(data, name)]
    if data.data_files is not None:
        update["data_files"] = {
            split: str(_under(base_dir, Path(files))) if isinstance(files, str)
            else [str(_under(base_dir, Path(f))) for f in files]
            for split, files in data.data_files.items()}
    if data.dataset is not None and _under(base_dir, Path(data.dataset)).exists():
        update["dataset"] = str(_under(base_dir, Path(data.dataset)))  # a save_to_disk folder
    model = config.model
    if model.pretrained is not None and _under(base_dir, Path(model.pretrained)).exists():
        model = model.model_copy(
            update={"pretrained": str(_under(base_dir, Path(model.pretrained)))})
    return config.model_copy(update={"data": data.model_copy(update=update), "model": model})


