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
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.search_space import parameter_sets, representative_values
from sweepmaster.config.trial_checks import TrialChecker
from sweepmaster.config.value_checks import check_host_memory
from sweepmaster.errors import ConfigError, SettingError

__all__ = ["ENVIRONMENT_SETTINGS", "MAX_CONFIGURATIONS", "check_environment", "check_sweep"]

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
    _check_dtype(config)
    _check_auto_host_memory(config, launching)
    checker = TrialChecker(config, launching)
    for params in _configurations(config):
        try:
            trial = config.with_params(params) if params else config
            checker.check(trial)
        except ConfigError as err:
            if not params:
                raise
            raise _in_configuration(config, checker, params, err) from None


def _in_configuration(config: SweepConfig, checker: TrialChecker, params: Mapping[str, Any],
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


def _check_auto_host_memory(config: SweepConfig, launching: bool) -> None:
    """``devices: auto`` on a machine without a GPU is the host, of ``device_memory``'s budget.

    Raises:
        ConfigError: ``resources.device_memory`` is more than the machine's physical memory,
            ``resources.devices`` is ``auto`` and the machine has no GPU.
    """
    resources = config.resources
    if resources.devices.strip().lower() != "auto" or resources.device_memory is None:
        return
    try:
        check_host_memory("auto", resources.device_memory, has_gpu=_gpu_present(launching))
    except ValueError as err:
        raise ConfigError(config.source, "resources.device_memory", str(err)) from None


def _check_dtype(config: SweepConfig) -> None:
    """``float16`` weights are refused on every device: they train NaN within steps.

    Training keeps the weights, their gradients and the optimizer state in ``model.dtype``
    without a loss scaler (no mixed precision: no float32 master weights, no
    ``torch.amp.GradScaler``), so float16's range underflows and overflows within a few steps
    (AdamW's ``eps`` is 0 in float16); ``bfloat16`` (float32's range) and ``float32`` train.

    Raises:
        ConfigError: ``model.dtype`` (or a ``parameters.model.dtype`` value) is ``float16``.
    """
    parameter = config.parameters.get("model.dtype")
    dtypes = representative_values(parameter) if parameter is not None else []
    key = "parameters.model.dtype" if "float16" in dtypes else "model.dtype"
    if "float16" in dtypes or (parameter is None and config.model.dtype == "float16"):
        raise ConfigError(config.source, key, "float32 or bfloat16 (float16 weights train "
                          "without loss scaling and turn NaN within steps), got 'float16'")
