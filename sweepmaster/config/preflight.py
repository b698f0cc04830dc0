"""Everything about a sweep that can be known without training, checked before anything is written.

``sweepmaster validate`` runs :func:`check_sweep` after loading the file, and ``launch`` (and
``worker``) run :func:`check_environment` first and :func:`check_sweep` before they open the
database, as does :func:`~sweepmaster.sweep.run.run_sweep` unless told not to, so a sweep that
cannot train fails with one line and exit code 2 instead of recording a failed trial per grid cell.
Before those, :func:`check_environment` rejects a ``SWEEPMASTER_*`` variable it does not know.
The checks of :func:`check_sweep`, for every configuration a trial can get:

* the model config: its ``model_type`` is a family sweepmaster can split into layers
  (:data:`~sweepmaster.workload.families.FAMILIES`); sizes (layers, width, heads, positions,
  vocabulary) are at least 1, dropout probabilities are in [0, 1), a normalization's epsilon
  is > 0 and every number is finite, the width divides into the
  attention heads (and those into the key/value heads), the vocabulary holds every token of
  the tokenizer; a ``model.pretrained``
  directory, or the HuggingFace cache's snapshot of a hub id (resolved once, downloaded unless
  ``HF_HUB_OFFLINE`` is set: :mod:`sweepmaster.workload.hub`), has a readable ``config.json``;
* what the model class would reject when built, known without building it: the activation
  is one transformers knows (:data:`~sweepmaster.workload.families.ACTIVATIONS`), so is a
  rotary family's ``rope_parameters.rope_type`` (transformers' ``ROPE_INIT_FUNCTIONS``), and
  ``model.peft.target_modules`` match a linear layer of the model as PEFT matches names (a
  module's dotted name, or its end), the layers named by the families table;
* the data: every text file is UTF-8, the training text fills at least one batch of blocks
  (``train.batch_size`` x ``data.block_size`` tokens, after ``data.max_train_tokens``) and the
  validation text at least one block; a ``data.dataset`` loads, its splits have rows, its rows
  have the fields named (a chat needs a tokenizer with a chat template), and its blocks fill a
  batch (:func:`~sweepmaster.workload.hfdata.prepare_dataset`, tokenized into the ``datasets``
  cache that training then reads);
* the paths: ``output.dir`` and the sweep's directory under it are directories (or can be
  made), not files; before a launch, ones this process can write.

Which configurations: for a grid, every cell; for other samplers, every combination of the
values (categorical choices, range bounds) of the parameters that change the model or the data
(``model.*``, ``data.*``, ``train.batch_size``), or each of them alone past
:data:`MAX_CONFIGURATIONS` combinations. Counting tokens tokenizes only as much text as a check
needs, with the same chunking as training, so it costs milliseconds; only the tokenizer and
transformers' config classes are used, never a model class. ``validate`` and ``launch`` run
these same checks; before a launch, each distinct model is also built on the meta device (no
memory), a last net for what only the model class's constructor rejects.

Example:
    >>> from sweepmaster.config.schema import load_sweep_config
    >>> check_environment()
    >>> check_sweep(load_sweep_config("examples/quickstart.yaml"))
"""

from __future__ import annotations

import difflib
import functools
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sweepmaster.config.file_checks import expected_model_type
from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.search_space import did_you_mean, parameter_sets, representative_values
from sweepmaster.errors import ConfigError, DataError, SettingError
from sweepmaster.workload.families import ACTIVATIONS, FAMILIES, Family
from sweepmaster.workload.text import cached_tokenizer

__all__ = ["ENVIRONMENT_SETTINGS", "MAX_CONFIGURATIONS", "check_environment", "check_sweep",
           "linear_module_names"]

_PREFIX = "SWEEPMASTER_"

#: Every environment variable sweepmaster reads; another ``SWEEPMASTER_*`` name is an error.
ENVIRONMENT_SETTINGS = (
    "SWEEPMASTER_DASHBOARD_TOKEN",  # sweepmaster.dashboard.server.TOKEN_ENV
    "SWEEPMASTER_DEVICE_HEADROOM",  # sweepmaster.runtime.devices.budget.HEADROOM_ENV
    "SWEEPMASTER_STORAGE",  # --storage
    "SWEEPMASTER_STORAGE_RETRY_S",  # sweepmaster.store.retry.RETRY_TIMEOUT_ENV
    "SWEEPMASTER_STATEMENT_TIMEOUT_S",  # sweepmaster.store.engine.STATEMENT_TIMEOUT_ENV
)

#: Most parameter combinations checked one by one; past it, each parameter's values alone.
MAX_CONFIGURATIONS = 512

#: Model config attributes that are counts or sizes: each must be at least 1 when set.
_SIZE_FIELD = re.compile(
    r"^(n_(layer|embd|head|positions|inner|ctx|kv_heads?)|num_(hidden_layers|attention_heads|"
    r"key_value_heads|layers|heads)|(hidden|intermediate|vocab|head|ffn|kv)_(size|dim|channels)|"
    r"d_(model|ff|kv)|max_position_embeddings|head_dim)$")

#: Model config attributes that count layers: each must be at most :data:`_MAX_LAYERS`.
_LAYERS_FIELD = re.compile(r"^(n_layer|num_hidden_layers|num_layers)$")
#: Most layers a model may have: one module each is built (on the meta device) before a launch.
_MAX_LAYERS = 10_000
#: Largest size of any other size field.
_MAX_SIZE = 2**31 - 1

#: Model config attributes that are dropout probabilities: each must be in [0, 1) when set (a
#: dropout of 1 zeroes every activation it applies to).
_PROBABILITY_FIELD = re.compile(r"((^|_)(dropout|pdrop)|^layerdrop)$")

#: Model config attributes that are a normalization's epsilon: each must be > 0 (0 divides by
#: zero on a constant input; a negative one takes the square root of a negative number).
_EPSILON_FIELD = re.compile(r"(^|_)(eps|epsilon)$")

#: Model config attributes that are a standard deviation: each must be >= 0.
_DEVIATION_FIELD = re.compile(r"^initializer_range$")


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Check the ``SWEEPMASTER_*`` settings before anything else happens.

    Every variable named ``SWEEPMASTER_*`` must be one of :data:`ENVIRONMENT_SETTINGS` (a
    misspelled name would otherwise be ignored without a word), and the settings are parsed.

    Args:
        environ: The environment; default ``os.environ``.

    Raises:
        SettingError: A ``SWEEPMASTER_*`` variable is not one sweepmaster reads, or
            ``SWEEPMASTER_DEVICE_HEADROOM`` is not a fraction in [0, 1).
        StorageError: ``SWEEPMASTER_STORAGE_RETRY_S`` is not a number of seconds >= 0, or
            ``SWEEPMASTER_STATEMENT_TIMEOUT_S`` not one > 0.
    """
    from sweepmaster.runtime.devices.settings import headroom_from_env
    from sweepmaster.store.retry import RetryPolicy, statement_timeout_s

    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        if name.startswith(_PREFIX) and name not in ENVIRONMENT_SETTINGS:
            suffixes = [known.removeprefix(_PREFIX) for known in ENVIRONMENT_SETTINGS]
            close = difflib.get_close_matches(name.removeprefix(_PREFIX), suffixes, n=1)
            hint = f"did you mean {_PREFIX}{close[0]}? " if close else ""
            raise SettingError(f"environment variable {name}: not a sweepmaster setting "
                               f"({hint}known: {', '.join(ENVIRONMENT_SETTINGS)})")
    try:
        headroom_from_env(environ=environ)
    except ValueError as err:
        raise SettingError(f"environment variable {err}") from None
    RetryPolicy.from_env()
    statement_timeout_s(environ)


def check_sweep(config: SweepConfig, *, launching: bool = False) -> None:
    """Check everything about a loaded sweep that can fail before training (see module doc).

    Args:
        config: The sweep, as :func:`~sweepmaster.config.schema.load_sweep_config` returns it.
        launching: Also check that this process can write under ``output.dir`` (``validate``
            works in a directory it cannot write) and build each distinct model on the meta
            device (imports torch and the model classes: seconds, which ``validate`` does not
            spend).

    Raises:
        ConfigError: ``"<file>: <key>: <expected>"``; for a problem of some parameter values
            only, the key is ``parameters.<path>`` and the message names the values.
    """
    _check_output(config, launching)
    _check_dtype(config, launching)
    checker = _Checker(config, launching)
    for params in _configurations(config):
        try:
            trial = config.with_params(params) if params else config
            checker.check(trial)
        except ConfigError as err:
            if not params:
                raise
            raise _in_configuration(config, checker, params, err) from None


def _in_configuration(config: SweepConfig, checker: _Checker, params: Mapping[str, Any],
                      err: ConfigError) -> ConfigError:
    """The error of one parameter set, keyed by the file's key when the base fails alike."""
    if err.key not in params:  # a setting no parameter sets: the file's key if the base fails
        try:
            checker.check(config)
        except ConfigError as base_err:
            if base_err.key == err.key and base_err.expected == err.expected:
                return base_err
    path = err.key if err.key in params else next(
        (p for p in params if p.split(".")[0] == err.key.split(".")[0]), next(iter(params)))
    section = err.key.split(".")[0]
    shown = {p: v for p, v in params.items() if p.split(".")[0] == section
             or (section in ("data", "train") and _relevant(p) and not p.startswith("model."))}
    words = ", ".join(f"{p}={v!r}" for p, v in (shown or params).items())
    return ConfigError(config.source, f"parameters.{path}",
                       f"with {words}: {err.key or 'the config'}: {err.expected}")


def _relevant(path: str) -> bool:
    return path.split(".")[0] in ("model", "data") or path == "train.batch_size"


def _configurations(config: SweepConfig) -> list[dict[str, Any]]:
    """The parameter sets to check (module doc); ``[{}]`` when none changes a check."""
    if config.study.sampler.type == "grid":
        space = {path: values for path, values in config.grid_space().items()
                 if _relevant(path)}
    else:
        space = {path: representative_values(spec) for path, spec in config.parameters.items()
                 if spec.distribution != "constant" and _relevant(path)}
    return parameter_sets(space, MAX_CONFIGURATIONS)[0]


# --- output ----------------------------------------------------------------------------------

#: File systems of the kernel's own objects (processes, devices, control groups): files cannot
#: be made there, or writing one changes a kernel setting.
_KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
    "bpf", "configfs", "fusectl", "efivarfs", "binfmt_misc", "devpts", "mqueue", "nsfs",
    "autofs", "rpc_pipefs", "selinuxfs",
})


def _filesystem(path: Path) -> tuple[str, str] | None:
    """The mount point and type of the file system ``path`` is on, from /proc/self/mountinfo.

    ``None`` where the table cannot be read (not Linux). Fields: mount point is the 5th, the
    type the first after the ``-`` separator (proc(5)).
    """
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        mount = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
        fstype = fields[fields.index("-") + 1]
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[0])):
            best = (mount, fstype)
    return best


def _can_make_entries(directory: Path) -> bool:
    """Whether this process can make an entry in ``directory``: one is made and removed.

    ``os.access`` says yes to root everywhere, even where the file system refuses.
    """
    try:
        probe = tempfile.mkdtemp(prefix=".sweepmaster-write-check-", dir=directory)
    except OSError:
        return False
    os.rmdir(probe)
    return True


def _check_output(config: SweepConfig, writable: bool) -> None:
    """``output.dir`` and ``<output.dir>/<name>`` are directories or can be made (written).

    Never on a file system of the kernel's objects (``/proc``, ``/sys``); before a launch,
    the nearest existing directory must take a new entry (made and removed at once).
    """
    sweep_dir = Path(config.output.dir) / config.name
    for path in (sweep_dir, *sweep_dir.parents):
        if not os.path.lexists(path):
            continue
        mounted = _filesystem(path)
        if mounted is not None and mounted[1] in _KERNEL_FILESYSTEMS:
            raise ConfigError(config.source, "output.dir", "a directory on a file system that "
                              f"keeps files, got {config.output.dir} (under {mounted[0]}, a "
                              f"{mounted[1]} file system of the kernel's own objects)")
        if path.is_dir():
            if writable and not (os.access(path, os.W_OK | os.X_OK) and _can_make_entries(path)):
                raise ConfigError(config.source, "output.dir", "a directory you can write, got "
                                  f"{config.output.dir} ({path} is read-only)")
            return
        if path == sweep_dir:
            got = f"{config.output.dir}, where the sweep's directory {path} is a file"
        elif path == Path(config.output.dir):
            got = f"a file {path}"
        else:
            got = f"{config.output.dir}, whose parent {path} is a file"
        raise ConfigError(config.source, "output.dir", f"a directory, got {got}")


# --- dtype on the devices --------------------------------------------------------------------

def _gpu_present(launching: bool) -> bool:
    """Whether this machine has a GPU ``resources.devices: auto`` would train on.

    A launch asks PyTorch (it imports it anyway); ``validate``, which does not import it, looks
    for the NVIDIA, AMD or WSL kernel driver's device files.
    """
    if launching or "torch" in sys.modules:
        import torch

        return bool(torch.cuda.is_available())
    return any(Path(name).exists() for name in ("/dev/nvidia0", "/proc/driver/nvidia/gpus",
                                                "/dev/kfd", "/dev/dxg"))


def _check_dtype(config: SweepConfig, launching: bool) -> None:
    """``float16`` weights only on GPUs: on a CPU they train NaN within steps.

    Training keeps the weights in ``model.dtype`` without a loss scaler, and the CPU's float16
    arithmetic underflows and overflows within a few steps; ``bfloat16`` (float32's range) and
    ``float32`` train there.

    Raises:
        ConfigError: ``model.dtype`` (or a ``parameters.model.dtype`` value) is ``float16``
            and every device of ``resources.devices`` is a CPU.
    """
    spec = config.resources.devices
    if spec.strip().lower() == "auto":
        if _gpu_present(launching):
            return
        where = "auto: no GPU on this machine"
    else:
        from sweepmaster.runtime.devices.settings import parse_device_spec

        if any(entry.cuda_index is not None for entry in parse_device_spec(spec)):
            return
        where = spec
    parameter = config.parameters.get("model.dtype")
    dtypes = representative_values(parameter) if parameter is not None else []
    key = "parameters.model.dtype" if "float16" in dtypes else "model.dtype"
    if "float16" in dtypes or (parameter is None and config.model.dtype == "float16"):
        raise ConfigError(config.source, key, "float32 or bfloat16 on CPU devices "
                          f"(resources.devices: {where}): float16 weights train without loss "
                          "scaling and turn NaN within steps there; got 'float16'")


# --- model and data --------------------------------------------------------------------------

class _Checker:
    """Model and data checks of trial configs, each distinct setting checked once."""

    def __init__(self, config: SweepConfig, build: bool = False) -> None:
        self.source = config.source
        self.build = build
        self._done: dict[str, ConfigError | None] = {}

    def check(self, trial: SweepConfig) -> None:
        tokenizer = cached_tokenizer(trial.tokenizer_snapshot().path)
        model_key = "model:" + trial.model.model_dump_json() + str(trial.data.tokenizer)
        self._once(model_key, functools.partial(_check_model_values, trial, len(tokenizer)))
        if self.build:
            self._once("build:" + model_key,
                       functools.partial(_check_model_builds, trial, len(tokenizer)))
        data = trial.data
        if data.dataset is not None:
            self._once(f"dataset:{data.model_dump_json()}:{trial.train.batch_size}",
                       functools.partial(_check_dataset, trial, tokenizer))
            return
        for split in ("train", "valid"):
            files, key, limit, limit_key = _split_files(trial, split)
            if not files:
                continue
            blocks = trial.train.batch_size if split == "train" else 1
            data_key = f"{split}:{files}:{data.tokenizer}:{limit}:{data.block_size}:{blocks}"
            self._once(data_key, functools.partial(
                _check_data_text, trial, tokenizer, files, key, limit, limit_key, blocks))

    def _once(self, key: str, check: Callable[[], None]) -> None:
        if key not in self._done:
            try:
                check()
                self._done[key] = None
            except ConfigError as err:
                self._done[key] = err
        error = self._done[key]
        if error is not None:
            raise error


def _check_model_values(trial: SweepConfig, vocab_size: int) -> None:
    model = trial.model
    if model.config is not None:
        from sweepmaster.workload.configs import model_config_from_mapping

        hf_config = model_config_from_mapping(model.config, vocab_size)
        where = "model.config."
    else:
        assert model.pretrained is not None
        from transformers import AutoConfig

        snapshot = trial.pretrained_snapshot()
        assert snapshot is not None
        try:
            hf_config = AutoConfig.from_pretrained(snapshot.path, local_files_only=True,
                                                   trust_remote_code=model.trust_remote_code)
        except (OSError, ValueError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigError(trial.source, "model.pretrained", "a model directory with a "
                              f"loadable config.json, got {model.pretrained}: {detail}") from None
        where = f"model.pretrained ({model.pretrained}'s config.json) "
    _check_family(trial, hf_config.model_type, where)
    fields = hf_config.to_dict()
    for name, value in fields.items():
        if _SIZE_FIELD.match(name) and isinstance(value, int) and not isinstance(value, bool) \
                and value < 1:
            raise _model_error(trial, where, name, f"expected an integer >= 1, got {value}")
        limit = _MAX_LAYERS if _LAYERS_FIELD.match(name) else _MAX_SIZE
        if _SIZE_FIELD.match(name) and isinstance(value, int) and value > limit:
            why = "the deepest models have a few hundred layers" if limit == _MAX_LAYERS \
                else "a size past 2**31 fits no device"
            raise _model_error(trial, where, name, f"expected an integer <= {limit} ({why}), "
                               f"got {value}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if not math.isfinite(value):
            raise _model_error(trial, where, name, f"expected a finite number, got {value}")
        if _PROBABILITY_FIELD.search(name) and not 0 <= value <= 1:
            raise _model_error(trial, where, name, f"expected a probability in [0, 1], got "
                               f"{value}")
        if _PROBABILITY_FIELD.search(name) and value == 1:
            raise _model_error(trial, where, name, "expected a probability in [0, 1) (a "
                               f"dropout of 1 zeroes every activation), got {value}")
        if _EPSILON_FIELD.search(name) and not value > 0:
            raise _model_error(trial, where, name, "expected a number > 0 (a normalization's "
                               f"epsilon; it trains NaN otherwise), got {value}")
        if _DEVIATION_FIELD.search(name) and not value >= 0:
            raise _model_error(trial, where, name, "expected a number >= 0 (the standard "
                               f"deviation of the initial weights), got {value}")
    attribute_map = getattr(hf_config, "attribute_map", {})
    width_name = attribute_map.get("hidden_size", "hidden_size")
    heads_name = attribute_map.get("num_attention_heads", "num_attention_heads")
    width, heads = fields.get(width_name), fields.get(heads_name)
    explicit_head_dim = fields.get("head_dim") is not None and (
        model.config is None or "head_dim" in model.config)
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 \
            and not explicit_head_dim and width % heads:
        raise _model_error(trial, where, heads_name, f"expected a divisor of {width_name} "
                           f"({width}): each head gets an equal share of the width, got {heads}")
    kv_heads = fields.get("num_key_value_heads")
    if isinstance(kv_heads, int) and isinstance(heads, int) and kv_heads > 0 and heads % kv_heads:
        raise _model_error(trial, where, "num_key_value_heads",
                           f"expected a divisor of {heads_name} ({heads}), got {kv_heads}")
    vocab_name = attribute_map.get("vocab_size", "vocab_size")
    vocab = fields.get(vocab_name)
    if isinstance(vocab, int) and vocab < vocab_size:
        raise _model_error(trial, where, vocab_name, f"expected at least the {vocab_size} tokens "
                           f"of the tokenizer {trial.data.tokenizer}, got {vocab}")
    family = FAMILIES[hf_config.model_type]
    activation = getattr(hf_config, family.activation, None)
    if activation not in ACTIVATIONS:
        raise _model_error(trial, where, family.activation, "expected an activation "
                           f"transformers knows ({', '.join(ACTIVATIONS)}), got {activation!r}"
                           f"{did_you_mean(activation, ACTIVATIONS)}")
    rope = fields.get("rope_parameters")
    if isinstance(rope, Mapping) and family.rotary is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kinds = ("default", *sorted(ROPE_INIT_FUNCTIONS))
        if rope.get("rope_type", "default") not in kinds:
            raise _model_error(trial, where, "rope_parameters.rope_type", "expected a RoPE type "
                               f"transformers knows ({', '.join(kinds)}), got "
                               f"{rope.get('rope_type')!r}"
                               f"{did_you_mean(rope.get('rope_type'), kinds)}")
    if model.peft is not None and model.peft.target_modules is not None:
        _check_targets(trial, model.peft.target_modules, family, hf_config)


def _check_family(trial: SweepConfig, model_type: str, where: str) -> None:
    """The runtime splits every model into layers: only the families it knows how to split."""
    if model_type not in FAMILIES:
        raise _model_error(trial, where, "model_type", expected_model_type(model_type))


def linear_module_names(family: Family, config: Any) -> list[str]:
    """The dotted names of a model's linear layers (the modules LoRA can adapt), from the table.

    Args:
        family: The model's family.
        config: The model's ``PretrainedConfig``.

    Returns:
        The names ``model.named_modules()`` gives the model's ``nn.Linear`` and HF ``Conv1D``
        layers, e.g. ``transformer.h.0.attn.c_attn``; OPT's ``project_in`` and ``project_out``
        when ``word_embed_proj_dim`` differs from ``hidden_size``.
    """
    names = [f"{family.layers}.{index}.{path}" for index in range(config.num_hidden_layers)
             for path in family.layer_linears]
    projected = getattr(config, "word_embed_proj_dim", None) not in (None, config.hidden_size)
    names += [path for path in (family.project_in, family.project_out)
              if path is not None and projected]
    return [*names, family.head]


def _check_targets(trial: SweepConfig, targets: Sequence[str], family: Family,
                   config: Any) -> None:
    """``model.peft.target_modules`` match a linear layer as PEFT matches: whole name or end."""
    names = linear_module_names(family, config)
    if not any(name == target or name.endswith(f".{target}")
               for target in targets for name in names):
        leaves = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in names}))
        raise ConfigError(trial.source, "model.peft.target_modules", "names of modules of "
                          f"{family.model_class} to adapt (its linear layers: {leaves}), got "
                          f"{list(targets)}")


def _check_model_builds(trial: SweepConfig, vocab_size: int) -> None:
    """Build the model on the meta device (no memory): what only its constructor checks."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from sweepmaster.workload.configs import model_config_from_mapping

    model = trial.model
    key = "model.config" if model.config is not None else "model.pretrained"
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        if model.config is not None:
            hf_config = model_config_from_mapping(model.config, vocab_size)
        else:
            snapshot = trial.pretrained_snapshot()
            assert snapshot is not None
            hf_config = AutoConfig.from_pretrained(snapshot.path, local_files_only=True,
                                                   trust_remote_code=model.trust_remote_code)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # whatever the model class's constructor rejects
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise ConfigError(trial.source, key, f"a config transformers can build a causal LM "
                          f"from, got {detail}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)


def _model_error(trial: SweepConfig, where: str, name: str, expected: str) -> ConfigError:
    if where == "model.config.":
        return ConfigError(trial.source, f"model.config.{name}", expected)
    return ConfigError(trial.source, "model.pretrained", f"{where}{name}: {expected}")


def _split_files(trial: SweepConfig, split: str) -> tuple[list[Path], str, int | None, str]:
    """A split's files, the key naming them, and its token cap with that key."""
    data = trial.data
    limit = data.max_train_tokens if split == "train" else data.max_eval_tokens
    limit_key = "data.max_train_tokens" if split == "train" else "data.max_eval_tokens"
    if data.dir is not None:
        from sweepmaster.workload.text import find_splits

        try:
            return [find_splits(data.dir)[split]], "data.dir", limit, limit_key
        except DataError as exc:
            raise ConfigError(trial.source, "data.dir", f"a WikiText-2 directory: {exc}") \
                from None
    files = data.train_files if split == "train" else data.valid_files
    return list(files or []), f"data.{split}_files", limit, limit_key


def _check_dataset(trial: SweepConfig, tokenizer: Any) -> None:
    """A ``data.dataset`` loads, has its fields and splits, and fills a batch of blocks.

    Tokenizing goes to the ``datasets`` cache, so the launch that follows reads it.
    """
    from sweepmaster.workload.hfdata import prepare_dataset

    blocks = prepare_dataset(trial.data, tokenizer, trial.source)
    have, wanted = int(blocks.train.shape[0]), trial.train.batch_size
    if have < wanted:
        raise ConfigError(trial.source, "train.batch_size", f"at most the {have} blocks of "
                          f"{trial.data.block_size} tokens the training split holds, got {wanted}")


def _check_data_text(trial: SweepConfig, tokenizer: Any, files: Sequence[Path], key: str,
                limit: int | None, limit_key: str, num_blocks: int) -> None:
    """The files are UTF-8 and hold ``num_blocks`` blocks of ``data.block_size`` tokens."""
    from sweepmaster.workload.text import check_utf8, count_tokens

    source, block_size = trial.source, trial.data.block_size
    for path in files:
        try:
            check_utf8(path)
        except DataError as exc:
            raise ConfigError(source, key, f"UTF-8 text files, got {exc}") from None
    needed = num_blocks * block_size
    try:
        num_tokens = count_tokens(files, tokenizer, needed)
    except DataError as exc:
        raise ConfigError(source, key, f"readable text files, got {exc}") from None
    if limit is not None:
        num_tokens = min(num_tokens, limit)
    if num_tokens >= needed:
        return
    have = num_tokens // block_size
    shown = ", ".join(str(p) for p in files)
    capped = limit is not None and limit < needed
    if have < 1:
        what = (f"at least one block of {block_size} tokens (data.block_size)")
        if capped:
            raise ConfigError(source, limit_key, f"{what}, got {limit}")
        raise ConfigError(source, key, f"text of {what}, got {num_tokens} tokens in {shown}")
    cap = f" ({limit_key}: {limit})" if capped else f" in {shown}"
    raise ConfigError(source, "train.batch_size", f"at most the {have} blocks of {block_size} "
                      f"tokens the training data hold{cap}, got {num_blocks}")

