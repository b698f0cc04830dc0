"""The sections of a sweep file as pydantic models: study, model, data, train, resources, output.

:class:`~sweepmaster.config.schema.SweepConfig` holds them.

Step counts fit the database's 32-bit step columns; numbers are finite.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sweepmaster.runtime.devices.settings import check_fusion_mode
from sweepmaster.study import PRUNER_CLASSES, SAMPLER_CLASSES
from sweepmaster.workload.choices import OptimizerName

if TYPE_CHECKING:
    from sweepmaster.workload.spec import LoraSpec
from sweepmaster.config.value_checks import check_devices, check_size

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OutputConfig",
    "PeftConfig",
    "PrunerConfig",
    "ResourcesConfig",
    "SamplerConfig",
    "Section",
    "StudyConfig",
    "TrainConfig",
    "TrialHeartbeatConfig",
]


_UnitFloat = Annotated[float, Field(ge=0, lt=1)]
#: Most optimizer steps (and blocks per step) a trial may have: the database's step columns
#: are 32-bit integers (so are Optuna's trial numbers: the bound of counts and seconds too).
_MAX_STEPS = 2**31 - 1
_Number = TypeVar("_Number", int, float, int | None)


def _at_most(value: _Number, what: str) -> _Number:
    """``value`` unless it is above :data:`_MAX_STEPS`: ``"expected at most <N> <what>"``."""
    if value is not None and value > _MAX_STEPS:
        raise ValueError(f"expected at most {_MAX_STEPS} {what}")
    return value


class Section(BaseModel):
    """A section of a sweep file: unknown keys are errors, values are frozen, null is empty."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_empty(cls, data: Any) -> Any:
        return {} if data is None else data


class _OptunaChoice(Section):
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


if TYPE_CHECKING:
    _SamplerName = str
    _PrunerName = str
else:  # the names of the study's one table of samplers (pruners)
    _SamplerName = Literal[tuple(SAMPLER_CLASSES)]
    _PrunerName = Literal[tuple(PRUNER_CLASSES)]


class SamplerConfig(_OptunaChoice):
    """``study.sampler``: ``tpe`` or ``{type: tpe, n_startup_trials: 5}``.

    ``type`` is a name of :data:`~sweepmaster.study.SAMPLER_CLASSES`.
    """

    type: _SamplerName = "grid"


class PrunerConfig(_OptunaChoice):
    """``study.pruner``: ``median`` or ``{type: median, n_warmup_steps: 2}``.

    ``type`` is a name of :data:`~sweepmaster.study.PRUNER_CLASSES`.
    """

    type: _PrunerName = "none"


class StudyConfig(Section):
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


class PeftConfig(Section):
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


class ModelConfig(Section):
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


class DataConfig(Section):
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


class TrainConfig(Section):
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
    #: Training-state checkpoints (crash-safe resume, :mod:`sweepmaster.sweep.resume`): every N
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


class TrialHeartbeatConfig(Section):
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

    @field_validator("grace_period_s")
    @classmethod
    def _check_grace_has_heartbeat(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and "interval_s" in info.data and info.data["interval_s"] is None:
            raise ValueError("null while interval_s is null (no heartbeat: a grace period "
                             "does nothing), or an interval_s to turn the heartbeat on")
        return value

    def grace_s(self) -> int | None:
        """The grace period in seconds (default: three heartbeat intervals), or ``None`` off."""
        if self.interval_s is None:
            return None
        return self.grace_period_s if self.grace_period_s is not None else 3 * self.interval_s


class ResourcesConfig(Section):
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
    ``update_on``: where a spilled job's optimizer steps run: ``auto`` (default: chosen per
    job by the bytes and seconds each site costs,
    :func:`~sweepmaster.runtime.planning.update_site.update_cost`), ``device`` (Harmony's
    just-in-time update) or ``host`` (ZeRO-Offload: the step on the host copies, overlapped
    with the device; a job that fits its device or clips its gradients across shards updates
    on the device).
    ``trial_heartbeat`` detects trials of a dead process (:class:`TrialHeartbeatConfig`).
    """

    devices: str = Field(default="auto", min_length=1)
    device_memory: str | int | None = None
    fusion: Literal["auto", "off"] | int = "off"
    pipeline: Literal["auto", "off"] = "auto"
    update_on: Literal["auto", "device", "host"] = "auto"
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


class OutputConfig(Section):
    """``output``: checkpoints (directory relative to the working directory, what to keep).

    ``report_to`` lists experiment trackers that get one run per trial
    (:mod:`sweepmaster.sweep.trackers`): ``tensorboard``, ``mlflow``, ``wandb``; a single name is a
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
