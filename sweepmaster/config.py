"""The sweep.yaml schema: a file in, a validated :class:`SweepConfig` out.

Every user error raises :class:`~sweepmaster.errors.ConfigError` with a one-line message
``"<file>: <dotted.key>: <expected>"``; no training starts on an invalid file. Relative data and
tokenizer paths are taken relative to the YAML file (like docker-compose), ``storage`` and
``output.dir`` relative to the working directory. The ``parameters:`` search space (W&B sweep
syntax) is described in :mod:`sweepmaster.search_space`.

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
import re
import stat
import types
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
)

from optuna.distributions import BaseDistribution
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from sweepmaster.errors import ConfigError, DataError
from sweepmaster.runtime.devices.settings import (
    MAX_SIZE_BYTES,
    check_fusion_mode,
    parse_device_spec,
    parse_size,
)
from sweepmaster.runtime.training.optimizers import OPTIMIZERS
from sweepmaster.search_space import (
    MAX_GRID_CELLS,
    PRUNER_CLASSES,
    SAMPLER_CLASSES,
    ParameterSpec,
    check_optuna_kwargs,
    check_parameter_path,
    check_parameter_values,
    did_you_mean,
    grid_values,
    normalize_parameter,
    representative_values,
    set_path,
    to_distribution,
)
from sweepmaster.workload.configs import model_config_from_mapping
from sweepmaster.workload.families import FAMILIES, supported_model_types
from sweepmaster.workload.hub import HubRevisionError, Snapshot, is_hub_id, resolve
from sweepmaster.workload.spec import OptimizerName
from sweepmaster.workload.text import cached_tokenizer, directory_stamp, find_splits
from sweepmaster.yaml_text import MAX_CHARS, load_yaml

if TYPE_CHECKING:
    from sweepmaster.workload.spec import LoraSpec

__all__ = [
    "DEVICE_SPEC_WORDS", "PRUNER_CLASSES", "SAMPLER_CLASSES", "SIZE_WORDS", "DataConfig",
    "ModelConfig", "OutputConfig", "ParameterSpec", "PeftConfig", "PrunerConfig",
    "ResourcesConfig",
    "SamplerConfig", "StudyConfig", "SweepConfig", "TrainConfig", "check_devices", "check_size",
    "expected_model_type", "load_sweep_config", "parse_sweep_config",
    "check_storage_option", "storage_url_problem",
]

#: Config sections a ``parameters:`` path may point into.
_PARAMETER_SECTIONS = ("model", "data", "train")
_UnitFloat = Annotated[float, Field(ge=0, lt=1)]
#: Most optimizer steps (and blocks per step) a trial may have: the database's step columns
#: are 32-bit integers (so are Optuna's trial numbers: the bound of counts and seconds too).
_MAX_STEPS = 2**31 - 1
_Number = TypeVar("_Number", int, float, int | None)
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


def _at_most(value: _Number, what: str) -> _Number:
    """``value`` unless it is above :data:`_MAX_STEPS`: ``"expected at most <N> <what>"``."""
    if value is not None and value > _MAX_STEPS:
        raise ValueError(f"expected at most {_MAX_STEPS} {what}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_empty(cls, data: Any) -> Any:
        return {} if data is None else data


class _OptunaChoice(_Section):
    """An Optuna class by name, plus constructor keywords (checked against its signature)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    type: str

    @model_validator(mode="before")
    @classmethod
    def _from_shorthand(cls, data: Any) -> Any:
        if data is None or isinstance(data, str):
            return {} if data is None else {"type": data}
        if not isinstance(data, Mapping):
            raise ValueError("expected a name or a mapping {type: <name>, <keyword>: <value>}")
        return data

    def kwargs(self) -> dict[str, Any]:
        """Return the constructor keywords given besides ``type``."""
        return dict(self.model_extra or {})


class SamplerConfig(_OptunaChoice):
    """``study.sampler``: ``tpe`` or ``{type: tpe, n_startup_trials: 5}``."""

    type: Literal["grid", "tpe", "random", "cmaes", "gp", "qmc"] = "grid"


class PrunerConfig(_OptunaChoice):
    """``study.pruner``: ``median`` or ``{type: median, n_warmup_steps: 2}``."""

    type: Literal["none", "median", "hyperband", "successive_halving"] = "none"


class StudyConfig(_Section):
    """``study``: the Optuna study; ``n_trials`` None means the grid size (grid sampler only)."""

    direction: Literal["minimize", "maximize"] = "minimize"
    metric: Literal["eval_loss", "eval_perplexity", "train_loss"] = "eval_loss"
    sampler: SamplerConfig = SamplerConfig()
    seed: int | None = None
    pruner: PrunerConfig = PrunerConfig()
    n_trials: int | None = Field(default=None, ge=1)

    @field_validator("n_trials")
    @classmethod
    def _check_n_trials(cls, value: int | None) -> int | None:
        return _at_most(value, "trials (Optuna numbers trials with 32-bit integers)")


class PeftConfig(_Section):
    """``model.peft``: train a LoRA adapter over the frozen model (see ``LoraSpec``).

    ``{type: lora, r: 8, alpha: 16, dropout: 0.05, target_modules: [c_attn, c_proj]}``; every
    field is sweepable (``parameters: {model.peft.r: {values: [4, 8]}}``). ``target_modules``
    null: PEFT's default for the model type (GPT-2: ``c_attn``); names that match no module are
    refused before a launch. A string is the names separated by commas (``"c_attn,c_proj"``),
    so a search space can choose among sets of modules (Optuna's categorical choices are
    scalars): ``{model.peft.target_modules: {values: [c_attn, "c_attn,c_proj"]}}``.
    """

    type: Literal["lora"] = "lora"
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0, allow_inf_nan=False)
    dropout: _UnitFloat = 0.0
    target_modules: list[str] | None = Field(default=None, min_length=1)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        names = [name.strip() for name in value.split(",")]
        if not all(names):
            raise ValueError("expected module names: a list, or one string of names separated "
                             "by commas (e.g. 'c_attn,c_proj')")
        return names

    def lora_spec(self) -> LoraSpec:
        """The runtime's :class:`~sweepmaster.workload.spec.LoraSpec` of this section."""
        from sweepmaster.workload.spec import LoraSpec  # torch: only when training or checking

        targets = None if self.target_modules is None else tuple(self.target_modules)
        return LoraSpec(r=self.r, alpha=self.alpha, dropout=self.dropout, target_modules=targets)


class ModelConfig(_Section):
    """``model``: exactly one of ``config`` (HF config fields) and ``pretrained`` (weights).

    ``pretrained`` is a directory saved with ``save_pretrained`` (relative to the YAML file) or
    a HuggingFace hub id (``gpt2``, ``org/name``), resolved once per sweep to a snapshot of the
    HuggingFace cache, downloaded unless ``HF_HUB_OFFLINE`` is set
    (:mod:`sweepmaster.workload.hub`); ``revision`` pins a branch, tag or commit of it (default
    ``main``); ``trust_remote_code`` lets transformers run the repository's own Python code.
    ``peft`` (:class:`PeftConfig`) trains a LoRA adapter instead of every weight.
    """

    config: dict[str, Any] | None = None
    pretrained: str | None = None
    revision: str | None = Field(default=None, min_length=1)
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    peft: PeftConfig | None = None


class DataConfig(_Section):
    """``data``: one of ``dir``, ``train_files`` and ``dataset``; paths are absolute once loaded.

    ``dataset`` loads through HuggingFace ``datasets`` (:mod:`sweepmaster.workload.hfdata`): a
    builder (json, csv, parquet, text, arrow) over ``data_files`` (``{split: file or files}``,
    relative to the YAML file), a ``save_to_disk`` folder or a hub dataset id; rows are plain
    text (``text_field``), prompt/completion pairs (``prompt_field`` and ``completion_field``:
    the loss counts completion tokens only) or chats (``messages_field``: the tokenizer's chat
    template; the loss counts assistant turns only); ``packing`` concatenates examples into
    blocks, else each is one padded row.
    """

    dir: Path | None = None
    train_files: list[Path] | None = None
    valid_files: list[Path] | None = None
    dataset: str | None = Field(default=None, min_length=1)
    config_name: str | None = None
    data_files: dict[str, str | list[str]] | None = None
    train_split: str = "train"
    eval_split: str | None = None
    eval_fraction: float | None = Field(default=None, gt=0, lt=1)
    text_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None
    packing: bool = True
    tokenizer: Path
    block_size: int = Field(default=128, ge=2)
    max_train_tokens: int | None = Field(default=None, ge=1)
    max_eval_tokens: int | None = Field(default=None, ge=1)
    cache_dir: Path | None = None


class TrainConfig(_Section):
    """``train``: optimizer, schedule and loop settings of every trial (see OptimizerSpec).

    Step counts fit the database's 32-bit step columns; numbers are finite; ``seed`` is in
    the range ``torch.manual_seed`` takes.
    """

    epochs: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    max_steps: int | None = Field(default=None, ge=1, le=_MAX_STEPS)
    batch_size: int = Field(default=8, ge=1)
    optimizer: OptimizerName = "adamw"
    lr: float = Field(default=3e-4, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    betas: tuple[_UnitFloat, _UnitFloat] = (0.9, 0.999)
    momentum: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    warmup_steps: int = Field(default=0, ge=0, le=_MAX_STEPS)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    eval_every: int | None = Field(default=None, ge=1, le=_MAX_STEPS)
    seed: int = Field(default=0, ge=-(2**63), le=2**64 - 1)
    #: Training-state checkpoints (crash-safe resume, :mod:`sweepmaster.resume`): every N
    #: optimizer steps, ``"eval"`` (default) at the evaluation cadence ``eval_every`` (none
    #: when that is null), or ``"off"``.
    checkpoint_every: Annotated[int, Field(ge=1, le=_MAX_STEPS)] | Literal["eval", "off"] = "eval"

    @field_validator("epochs")
    @classmethod
    def _check_epochs(cls, value: float) -> float:
        return _at_most(value, "epochs (each takes a step at least; the database's step "
                        "columns are 32-bit integers)")

    @field_validator("betas", mode="before")
    @classmethod
    def _split_betas(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:  # one string, so a search space can choose among pairs (Optuna's choices are scalars)
            return tuple(float(beta) for beta in value.split(","))
        except ValueError:
            raise ValueError("expected two numbers in [0, 1): a list, or one string of two "
                             "numbers separated by a comma (e.g. '0.9,0.95')") from None

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _check_checkpoint_every(cls, value: Any) -> Any:
        if value is False:
            return "off"  # YAML 1.1 reads a bare `off` as false
        is_steps = isinstance(value, int) and not isinstance(value, bool)
        if value in ("eval", "off") or (is_steps and 1 <= value <= _MAX_STEPS):
            return value
        raise ValueError("expected a positive integer (steps), 'eval' or 'off'")

    def checkpoint_steps(self) -> int | None:
        """Steps between training-state checkpoints, or ``None`` for none."""
        if self.checkpoint_every == "off":
            return None
        if self.checkpoint_every == "eval":
            return self.eval_every
        return self.checkpoint_every


#: What ``resources.devices`` accepts, in words (also used by the CLI's ``--devices``).
DEVICE_SPEC_WORDS = ("a device spec: auto, cpu, cuda, cuda:N or cpu:KxSIZE, comma-separated "
                     "(e.g. cuda:0,cuda:1 or cpu:2x512MiB)")
#: A size without a unit (``512``, ``1.5``): refused where a user writes a size (a file, the
#: command line), which reads it as bytes while ``8`` means 8 GiB to whoever writes it.
_UNITLESS_SIZE = r"\d+(?:\.\d+)?"
#: A virtual device whose size has no unit (``cpu:2x512``).
_UNITLESS_VIRTUAL = re.compile(rf"cpu:(?:\d+\s*x\s*)?({_UNITLESS_SIZE})\s*")
#: What ``resources.device_memory`` accepts, in words (also used by ``--device-memory``).
SIZE_WORDS = "a positive size with a unit B, KiB, MiB, GiB or TiB, e.g. 8GiB"


def check_devices(spec: str) -> None:
    """Check a device spec's syntax (not whether its GPUs exist: that is checked at launch).

    A virtual device's size needs a unit (``cpu:2x512MiB``; ``cpu:2x512`` is refused rather
    than read as 512 bytes).

    The grammar is :func:`~sweepmaster.runtime.devices.settings.parse_device_spec`, the one the
    executor's devices are built from; it imports no torch.

    Raises:
        ValueError: ``"expected <DEVICE_SPEC_WORDS> (<what is wrong>)"``.
    """
    try:
        parse_device_spec(spec)
    except ValueError as err:
        detail = re.sub(r"^device spec '.*?'(: | is | )", "", str(err)).split("; expected")[0]
        detail = re.sub(r": size ('.*?') is not a number.*", r": \1 is not a size", detail)
        detail = detail.replace("empty or has an empty entry", "an entry is empty")
        raise ValueError(f"expected {DEVICE_SPEC_WORDS} ({detail})") from None
    for entry in spec.lower().split(","):
        unitless = _UNITLESS_VIRTUAL.fullmatch(entry.strip())
        if unitless is not None:
            raise ValueError(f"expected {DEVICE_SPEC_WORDS} ({entry.strip()}: "
                             f"{_no_unit(unitless.group(1))})")


def check_size(size: object) -> int:
    """Parse a byte size a user wrote, such as ``"8GiB"`` or ``"4096B"``: a unit is required.

    A number without a unit (``8``, ``"8"``) is refused rather than read as 8 bytes, as a
    virtual device's size is (:func:`check_devices`); ``B`` gives an exact count of bytes. The
    Python API (``Executor(device_memory=...)``,
    :func:`~sweepmaster.runtime.devices.settings.parse_size`) takes an int of bytes.

    Returns:
        The size in bytes.

    Raises:
        ValueError: ``"expected <SIZE_WORDS>"``, and what to write for a missing unit (a
            float such as ``8.5`` too); a bool or any other type is no size.
    """
    if isinstance(size, float):
        size = str(size)  # a number without its unit, as "8.5" is
    try:
        num_bytes = parse_size(size)  # type: ignore[arg-type]  # refuses any other type
    except ValueError as err:
        too_large = " (at most 8 EiB, what a 64-bit integer holds)" \
            if f"larger than {MAX_SIZE_BYTES}" in str(err) else ""
        raise ValueError(f"expected {SIZE_WORDS}{too_large}") from None
    text = str(size).strip()
    if re.fullmatch(_UNITLESS_SIZE, text):
        raise ValueError(f"expected {SIZE_WORDS} ({_no_unit(text)})")
    return num_bytes


def storage_url_problem(url: str) -> str | None:
    """What makes a storage URL unusable before connecting, or ``None``.

    An in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``, ``mode=memory``) lives
    only as long as one connection: the study, sweepmaster's tables and the workers' heartbeats
    each use their own, so none would see the others' tables. A URL SQLAlchemy cannot parse is
    left to the connection's own message.

    Returns:
        ``"expected a database file (e.g. sqlite:///sweepmaster.db) or a server: ..."``, or
        ``None``.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    memory = database in ("", ":memory:") or "mode=memory" in database \
        or parsed.query.get("mode") == "memory"
    if not memory:
        return None
    return ("expected a database file (e.g. sqlite:///sweepmaster.db) or a server: an "
            "in-memory SQLite database lives only as long as one connection, and a sweep "
            "opens several")


def check_storage_option(url: str | None) -> None:
    """Check ``--storage`` (or ``$SWEEPMASTER_STORAGE``) as the file's ``storage`` is checked.

    Raises:
        ConfigError: ``"--storage: <storage_url_problem>, got '<url>'"``.
    """
    problem = None if url is None else storage_url_problem(url)
    if problem is not None:
        raise ConfigError("--storage", "", f"{problem}, got {url!r}")


def _physical_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (``sysconf``), or ``None`` where it is unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system, or not reported
        return None


def _check_host_memory(devices: str, device_memory: str | int | None) -> None:
    """Check that the CPU devices of a spec fit the machine's physical memory together.

    Virtual devices (``cpu:2x512MiB``) and the host capped by ``device_memory`` are budgets
    taken from the host's memory at once; more than it has would be planned as fitting and
    then swap or be killed. ``auto`` and GPUs are checked when the devices are opened.

    Raises:
        ValueError: ``"expected CPU devices of at most the machine's <N> GiB ..."``.
    """
    try:
        entries = parse_device_spec(devices, device_memory)
    except ValueError:
        return  # the syntax is the devices' own check
    if devices.strip().lower() == "auto":
        return
    total = sum(e.budget_bytes for e in entries if e.cuda_index is None and e.budget_bytes)
    physical = _physical_memory_bytes()
    if physical is not None and total > physical:
        raise ValueError(f"expected CPU devices of at most the machine's {physical / 2**30:.1f} "
                         f"GiB of memory in all, got {total / 2**30:.1f} GiB ({devices}"
                         + (f" with device_memory {device_memory}" if device_memory else "")
                         + ")")


def _no_unit(size: str) -> str:
    """What is wrong with a size written without a unit, and what to write instead."""
    return f"the size {size} has no unit; write {size}MiB, {size}GiB or {size}B"


class TrialHeartbeatConfig(_Section):
    """``resources.trial_heartbeat``: detect trials of a dead process and retry them.

    Every running trial records a heartbeat in Optuna's storage every ``interval_s`` seconds
    (Optuna's ``RDBStorage(heartbeat_interval=...)``); a RUNNING trial without one for
    ``grace_period_s`` seconds is failed at the next launch's check and re-queued
    (``RetryHeartbeatStaleTrialCallback``) at most ``max_retry`` times (null: without limit),
    to resume from its last training-state checkpoint. ``interval_s: null`` turns it off.
    """

    interval_s: int | None = Field(default=10, ge=1)
    grace_period_s: int | None = Field(default=None, ge=1)
    max_retry: int | None = Field(default=3, ge=0)

    @field_validator("interval_s", "grace_period_s", "max_retry")
    @classmethod
    def _check_at_most(cls, value: int | None) -> int | None:
        return _at_most(value, "(what a 32-bit integer holds)")

    def grace_s(self) -> int | None:
        """The grace period in seconds (default: three heartbeat intervals), or ``None`` off."""
        if self.interval_s is None:
            return None
        return self.grace_period_s if self.grace_period_s is not None else 3 * self.interval_s


class ResourcesConfig(_Section):
    """``resources``: the devices trials train on; not part of the sweep's identity.

    ``devices`` is a device spec (``auto``, ``cpu``, ``cuda:0,cuda:1``, ``cpu:2x512MiB``; see
    :func:`~sweepmaster.runtime.devices.device.parse_devices`), checked for syntax when the file
    loads; a GPU the machine lacks is an error when the devices are opened (``launch``, ``plan``).
    ``device_memory`` caps every device's budget (``8GiB``; a size needs its unit, ``B`` for
    bytes: ``8`` is refused, see :func:`check_size`; the host ``cpu`` becomes a virtual device
    of that size). ``fusion`` is how many same-architecture trials train as one fused
    array: ``off`` (default), a fixed K (fewer where K do not fit a device), or ``auto`` (the
    best K measured per architecture; see :mod:`~sweepmaster.runtime.planning.fusion_degree`).
    ``pipeline``: ``auto`` (default) lets Sharded-LRTF run whole steps of a spilled job
    pipelined over several devices when fewer jobs are ready than devices are free (Harmony PP,
    the tail of a sweep; only jobs of two or more shards; one device never pipelines),
    ``off`` never; YAML's ``on`` / ``true`` read
    as ``auto``, ``false`` as ``off``.
    ``trial_heartbeat`` detects trials of a dead process (:class:`TrialHeartbeatConfig`).
    """

    devices: str = Field(default="auto", min_length=1)
    device_memory: str | int | None = None
    fusion: Literal["auto", "off"] | int = "off"
    pipeline: Literal["auto", "off"] = "auto"
    trial_heartbeat: TrialHeartbeatConfig = TrialHeartbeatConfig()

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        check_devices(value)
        return value

    @field_validator("device_memory", mode="before")
    @classmethod
    def _check_device_memory(cls, value: Any) -> Any:
        if value is not None:  # before the type's own check: ``true`` is no size of 1 byte
            check_size(value)
        return value

    @field_validator("fusion", mode="before")
    @classmethod
    def _check_fusion(cls, value: Any) -> Any:
        if value is False:
            value = "off"  # YAML 1.1 reads a bare `off` as false
        return check_fusion_mode(value)

    @field_validator("pipeline", mode="before")
    @classmethod
    def _check_pipeline(cls, value: Any) -> Any:
        if value is True or value == "on":  # YAML 1.1 reads a bare `on` as true
            return "auto"
        if value is False:
            return "off"
        if value in ("auto", "off"):
            return value
        raise ValueError("expected auto or off (on / true: auto)")


class OutputConfig(_Section):
    """``output``: checkpoints (directory relative to the working directory, what to keep).

    ``report_to`` lists experiment trackers that get one run per trial
    (:mod:`sweepmaster.trackers`): ``tensorboard``, ``mlflow``, ``wandb``; a single name is a
    list of one, ``none`` an empty one.
    """

    dir: Path = Path("checkpoints")
    save: Literal["best", "all", "none"] = "best"
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name(cls, value: Any) -> Any:
        if value is None or value == "none":
            return []
        return [value] if isinstance(value, str) else value


class SweepConfig(_Section):
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
                or the grid has more than :data:`~sweepmaster.search_space.MAX_GRID_CELLS`
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
            _check_parameter_path(self, path, path)
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
            _check_host_memory(update.get("devices", self.resources.devices),
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
            line:column; see :func:`~sweepmaster.yaml_text.load_yaml` for duplicate keys and
            size limits), is not a mapping, breaks the schema, or names missing data files.
    """
    file = Path(path)
    source = str(file)
    try:
        if not file.is_file() and file.exists():  # a FIFO would block, a device never end
            raise ConfigError(source, "", f"a YAML text file, got {_not_a_file(file)}")
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
        raise format_validation_error(exc, source, raw) from None
    config = _resolve_paths(config, base_dir)
    config._source, config._base_dir, config._check_files = source, base_dir, check_files
    for key, choice, classes in (("study.sampler", config.study.sampler, SAMPLER_CLASSES),
                                 ("study.pruner", config.study.pruner, PRUNER_CLASSES)):
        check_optuna_kwargs(classes[choice.type], choice.kwargs(), key, source)
    _check_model(config, check_files)
    _check_data(config, check_files)
    _check_resources(config)
    _check_metric_has_data(config)
    _check_report_to(config)
    if check_parameters:
        config = _normalized_parameters(config)
    if config.study.sampler.type == "grid":
        config.grid_space()
    elif config.study.n_trials is None:
        raise ConfigError(source, "study.n_trials", "required with the "
                          f"{config.study.sampler.type} sampler (only grid defaults to its size)")
    if check_parameters:
        _check_optuna_values(config)
        validate = functools.partial(_build, source=source, base_dir=base_dir,
                                     check_files=check_files, check_parameters=False)
        check_parameter_values(config.parameters, config.model_dump(), source, validate)
        for path in config.parameters:
            _check_parameter_takes_effect(config, path)
    return config


def _check_optuna_values(config: SweepConfig) -> None:
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
    if data.dataset is not None and _under(base_dir, Path(data.dataset)).is_dir():
        update["dataset"] = str(_under(base_dir, Path(data.dataset)))  # a save_to_disk folder
    model = config.model
    if model.pretrained is not None and _under(base_dir, Path(model.pretrained)).exists():
        model = model.model_copy(
            update={"pretrained": str(_under(base_dir, Path(model.pretrained)))})
    return config.model_copy(update={"data": data.model_copy(update=update), "model": model})


# --- semantic checks -------------------------------------------------------------------------

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


def _check_model(config: SweepConfig, check_files: bool) -> None:
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


def _check_data(config: SweepConfig, check_files: bool) -> None:
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
            raise ConfigError(source, "data.dir", f"a WikiText-2 directory: {exc}") from None
        for split, path in splits.items():
            _check_text_file(config, "data.dir", path,
                             f"a WikiText-2 directory with a readable, non-empty {split} split")
    for name in ("train_files", "valid_files"):
        for path in getattr(data, name) or []:
            if not path.is_file():
                raise ConfigError(source, f"data.{name}", f"existing files; {_not_a_file(path)}")
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


def _check_report_to(config: SweepConfig) -> None:
    """Every tracker of ``output.report_to`` has its library installed."""
    from sweepmaster.trackers import PIP_EXTRA, missing_library

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
        missing = "prompt_field" if data.prompt_field is None else "completion_field"
        raise ConfigError(source, f"data.{missing}", "given with data.prompt_field / "
                          "data.completion_field (prompt-completion rows need both)")


def _check_resources(config: SweepConfig) -> None:
    resources = config.resources
    try:
        _check_host_memory(resources.devices, resources.device_memory)
    except ValueError as err:
        key = "resources.device_memory" if resources.device_memory is not None \
            else "resources.devices"
        raise ConfigError(config.source, key, str(err)) from None


def _not_a_file(path: Path) -> str:
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


def _check_metric_has_data(config: SweepConfig) -> None:
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
        raise ConfigError(config.source, key, f"{expected}, got {_not_a_file(path)}")
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
def _parameter_paths() -> tuple[str, ...]:
    paths = []
    for section in _PARAMETER_SECTIONS:
        cls = SweepConfig.model_fields[section].annotation
        assert isinstance(cls, type) and issubclass(cls, BaseModel)
        paths += [f"{section}.{name}" for name in cls.model_fields
                  if (section, name) != ("model", "config")]
    paths += [f"model.peft.{name}" for name in PeftConfig.model_fields]
    return tuple(paths)


def _check_parameter_path(config: SweepConfig, path: str, key: str) -> None:
    fields, class_name = None, ""
    if config.model.config is not None:
        fields, class_name = _model_config_fields(config.model.config.get("model_type", "gpt2"))
    check_parameter_path(path, key, config.source, _parameter_paths(), fields, class_name)


def _normalized_parameters(config: SweepConfig) -> SweepConfig:
    normalized = {}
    for path, spec in config.parameters.items():
        _check_parameter_path(config, path, f"parameters.{path}")
        normalized[path] = normalize_parameter(spec, f"parameters.{path}", config.source)
    return config.model_copy(update={"parameters": normalized})


#: Settings of some optimizers only (the table's entries that read them): a parameter sweeping
#: one under another optimizer does nothing.
_OPTIMIZER_SETTINGS = {
    f"train.{setting}": names
    for setting in TrainConfig.model_fields
    if 0 < len(names := [name for name, entry in OPTIMIZERS.items()
                         if setting in entry.settings]) < len(OPTIMIZERS)
}


def _check_parameter_takes_effect(config: SweepConfig, path: str) -> None:
    """Check that a parameter sets something the trials use.

    Trials that differ only in a setting nothing reads would train the same thing under a
    value that means nothing.

    Raises:
        ConfigError: ``model.peft.*`` without ``model.peft`` (every weight trains, no adapter),
            or an optimizer's own setting (``train.momentum``: SGD's, ``train.betas``:
            AdamW's and Lion's) while every trial uses another optimizer.
    """
    key = f"parameters.{path}"
    if path.startswith("model.peft.") and config.model.peft is None:
        raise ConfigError(config.source, key, "model.peft to be set: without a LoRA adapter "
                          "every weight trains and model.peft settings do nothing (add "
                          "model.peft: {type: lora})")
    optimizers = _OPTIMIZER_SETTINGS.get(path)
    if optimizers is not None and "train.optimizer" not in config.parameters \
            and config.train.optimizer not in optimizers:
        names = " or ".join(optimizers)
        raise ConfigError(config.source, key, f"train.optimizer: {names} ({path} is "
                          f"{names}'s setting and does nothing with "
                          f"{config.train.optimizer}), got {config.train.optimizer!r}")


# --- pydantic errors in plain words ----------------------------------------------------------

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               Path: "a path"}
_BOUND_WORDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _describe(annotation: Any, metadata: list[Any]) -> str:
    """Say in words what a type annotation (plus pydantic constraints) accepts."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        return _describe(inner, [*metadata, *extra])
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        words = [_describe(arg, metadata) for arg in args if arg is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in get_args(annotation))
    if annotation in _TYPE_WORDS:
        word = _TYPE_WORDS[annotation]
    elif origin is tuple:
        word = f"a list of {len(get_args(annotation))} items"
    elif origin is list:
        word = "a list"
    elif origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        word = "a mapping"
    else:
        word = "a value"
    flat = [m for item in metadata
            for m in (item.metadata if isinstance(item, FieldInfo) else [item])]
    bounds = [f"{op} {getattr(m, attr)}" for m in flat for attr, op in _BOUND_WORDS
              if getattr(m, attr, None) is not None]
    bounds += [f"matching {m.pattern}" for m in flat if getattr(m, "pattern", None)]
    if any(getattr(m, "min_length", None) for m in flat):
        word = word.replace("a ", "a non-empty ", 1)
    return " ".join([word, " and ".join(bounds)]) if bounds else word


def _locate(loc: tuple[Any, ...]) -> tuple[Any, list[Any]] | None:
    """The annotation and constraints of the SweepConfig entry at ``loc``, if it has one."""
    annotation: Any = SweepConfig
    metadata: list[Any] = []
    for part in loc:
        while get_origin(annotation) in (Annotated, Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            if get_origin(annotation) is not Annotated and len(args) != 1:
                return None
            annotation = args[0]
        origin = get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return None
            annotation, metadata = field.annotation, list(field.metadata)
        elif origin is dict:
            annotation, metadata = get_args(annotation)[1], []
        elif origin in (list, tuple) and isinstance(part, int):
            annotation, metadata = get_args(annotation)[part if origin is tuple else 0], []
        else:
            return None
    return annotation, metadata


def _user_loc(loc: tuple[Any, ...], raw: Any) -> tuple[Any, ...]:
    """The key path of a pydantic error as the user wrote it, less pydantic's own tags.

    Pydantic adds tags such as ``function-after[...]`` for validators and union members; a
    part containing ``[`` is such a tag unless the input has that key (``"[/]"`` is a key).
    """
    kept: list[Any] = []
    node = raw
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and "[" in part:
            continue
        else:
            node = None
        kept.append(part)
    return tuple(kept)


def format_validation_error(exc: ValidationError, source: str,
                            raw: Any = None) -> ConfigError:
    """Turn a pydantic error about a SweepConfig into one plain-words ConfigError line.

    Args:
        exc: The error from validating a :class:`SweepConfig`.
        source: The file, for the message.
        raw: The validated input, to tell the user's keys from pydantic's location tags.

    Returns:
        A ConfigError for the first error: its dotted key path and what was expected there
        (with a did-you-mean for unknown keys and names), ``(and N more)`` if there are more.
    """
    errors = exc.errors()
    error = errors[0]
    loc = _user_loc(tuple(error["loc"]), raw)
    kind, value = error["type"], error.get("input")
    found = _locate(loc) if exc.title == SweepConfig.__name__ else None
    if kind == "extra_forbidden":
        parent = _locate(loc[:-1]) if exc.title == SweepConfig.__name__ else None
        allowed = list(parent[0].model_fields) if parent and isinstance(parent[0], type) \
            and issubclass(parent[0], BaseModel) else []
        expected = f"unknown key{did_you_mean(loc[-1], allowed)}"
        if allowed:
            expected += f" (allowed: {', '.join(allowed)})"
    elif kind == "missing":
        expected = "missing" + (f", expected {_describe(*found)}" if found else "")
    else:
        if kind in ("value_error", "assertion_error"):
            expected = str(error.get("ctx", {}).get("error", error["msg"]))
        elif found:
            expected = f"expected {_describe(*found)}"
            if kind == "finite_number":
                expected = expected.replace("a number", "a finite number")
        else:
            expected = error["msg"]
        shown = repr(value)
        expected += f", got {shown if len(shown) <= 60 else shown[:57] + '...'}"
        if found and get_origin(found[0]) is Literal:
            expected += did_you_mean(value, [str(a) for a in get_args(found[0])])
    if len(errors) > 1:
        expected += f" (and {len(errors) - 1} more)"
    return ConfigError(source, ".".join(str(p) for p in loc), expected)
