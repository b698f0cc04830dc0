"""Crash-safe training-state checkpoints: stop a job anywhere, resume it with the same numbers.

A checkpoint is everything a trial needs to continue exactly where it stopped: model weights,
optimizer state, RNG state, the step (which fixes the LR-schedule position, ``lr *
lr_factor(step)``, and the data position, minibatch ``step`` of
:func:`~sweepmaster.runtime.training.plain.minibatch_indices` order), the metric history and
elapsed training time. A job resumed from a checkpoint taken after step k ends with the weights of
an uninterrupted run (docs/design.md, "Checkpoints and resume"): every random stream and
optimizer number is restored bit for bit.

The state is one trial's and independent of the training path, so that a trial interrupted in
one path may resume in another (plain, spilled, or as a member of a fused array) on the same
kind of device: weights are a ``state_dict`` by parameter name, optimizer state is kept per
parameter name (:func:`optimizer_state_by_name`), and the RNG state is that of the stream the
trial draws its dropout from, whichever generator holds it (:func:`capture_rng`).

On disk (format version :data:`CHECKPOINT_VERSION`) a trial's ``state_dir`` holds files
``step-<step, 9 digits>-<16 hex digits>.ckpt``: one ``torch.save`` archive each (loadable with
``weights_only=True``), the hex digits the first 64 bits of the file's SHA-256. A file is
written to a temporary file in the same directory, flushed and ``fsync``-ed, then renamed into
place with ``os.replace`` (and the directory ``fsync``-ed), so a crash never leaves a
half-written checkpoint under a checkpoint's name, and a file damaged later (a truncated copy,
a flipped bit) fails its digest. :func:`load_latest` tries the newest file first and falls back
to older ones, logging each file it skips and why; the newest ``keep`` files are kept.

A checkpoint belongs to one job: :func:`job_key` hashes everything that decides the job's
numbers (model, dtype, optimizer, batch size, seed, steps, evaluation cadence, and the token
data), and a checkpoint written under another key is never resumed from.

Example:
    >>> names = [name for name, _ in model.named_parameters()]  # doctest: +SKIP
    >>> state = TrainingState(step=100, model=model.state_dict(),  # doctest: +SKIP
    ...                       optimizer=optimizer_state_by_name(optimizer, names),
    ...                       rng=capture_rng(torch.device("cpu")), metrics=metrics)
    >>> save_checkpoint(spec.state_dir, state, job_key(spec))  # doctest: +SKIP
    >>> resumed = load_latest(spec.state_dir, job_key(spec), "cpu")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
from transformers import PretrainedConfig

from sweepmaster.workload.spec import MetricPoint, TrainSpec

__all__ = [
    "CHECKPOINT_VERSION",
    "TrainingState",
    "capture_rng",
    "checkpoint_files",
    "job_key",
    "load_latest",
    "load_optimizer_state_by_name",
    "optimizer_state_by_name",
    "restore_rng",
    "save_checkpoint",
]

_log = logging.getLogger(__name__)

#: Version of the checkpoint format; a file of another version is skipped, never misread.
CHECKPOINT_VERSION = 1
_FORMAT = "sweepmaster.training_state"
_NAME = re.compile(r"^step-(\d{9})-([0-9a-f]{16})\.ckpt$")
_TMP_PREFIX = ".tmp-step-"


@dataclass
class TrainingState:
    """One trial's complete training state after ``step`` optimizer steps.

    Tensors may live on any device; they are written as they are and read back on the CPU.

    Attributes:
        step: Optimizer steps done; training resumes with step ``step + 1``, whose minibatch
            is number ``step`` of the job's minibatch order and whose LR is
            ``lr * lr_factor(step)``.
        model: The model's ``state_dict()`` (tied weights appear under each name).
        optimizer: Optimizer state per parameter name (:func:`optimizer_state_by_name`),
            e.g. ``{"transformer.h.0.attn.c_attn.weight": {"step": ..., "exp_avg": ...,
            "exp_avg_sq": ...}}`` for AdamW; a parameter without state yet is absent.
        rng: The state of the trial's dropout stream under ``"dropout:cpu"`` or
            ``"dropout:cuda"`` (:func:`capture_rng`), plus any other named states a path needs.
        metrics: The trial's recorded metrics so far, in order.
        elapsed_s: Seconds of training and evaluation before the checkpoint.
        extra: Anything else a training path needs to continue (plain values and tensors
            only: strings, numbers, booleans, None, lists, tuples, dicts, tensors).
    """

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]]
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: list[MetricPoint] = field(default_factory=list)
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def job_key(spec: TrainSpec) -> str:
    """Hash everything that decides a job's numbers, so a checkpoint resumes only its own job.

    Covers the model source (a HuggingFace config's JSON, or a directory / hub name; a factory
    is represented by its qualified name), ``dtype``, the optimizer and schedule, batch size,
    seed, total steps, evaluation cadence, the metric, the LoRA adapter, and the bytes of the
    train and eval blocks. Not covered: ``name`` and output directories.

    Args:
        spec: The job.

    Returns:
        A SHA-256 hex digest.
    """
    model = spec.model
    if isinstance(model, PretrainedConfig):
        source = model.to_json_string(use_diff=False)
    elif isinstance(model, (str, os.PathLike)):
        source = os.fspath(model)
    else:
        source = f"{getattr(model, '__module__', '')}.{getattr(model, '__qualname__', model)}"
    described = {
        "model": source, "dtype": spec.dtype, "optimizer": dataclasses.asdict(spec.optimizer),
        "batch_size": spec.batch_size, "seed": spec.seed, "total_steps": spec.total_steps,
        "eval_every": spec.eval_every, "eval_max_blocks": spec.eval_max_blocks,
        "metric": spec.metric,
    }
    if spec.peft is not None:
        described["peft"] = dataclasses.asdict(spec.peft)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for blocks in (spec.train_data, spec.eval_data):
        if blocks is None:
            digest.update(b"none")
            continue
        digest.update(f"{tuple(blocks.shape)}{blocks.dtype}".encode())
        digest.update(blocks.detach().to("cpu").contiguous().numpy().tobytes())
    for name, mask in (("train_mask", spec.train_mask), ("eval_mask", spec.eval_mask)):
        if mask is not None:  # none: the key of a job without loss masks is as it was
            digest.update(name.encode())
            digest.update(mask.detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()


def capture_rng(torch_device: torch.device,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Snapshot the state of the stream a trial draws its dropout from.

    Call it between steps, holding whatever lock guards the process's CPU generator.

    Args:
        torch_device: The trial's device; its type names the state (``"dropout:cpu"`` or
            ``"dropout:cuda"``: the streams of the two kinds are not interchangeable).
        generator: The trial's own dropout generator (a spilled job's, a fused array
            member's); ``None``: the device's default generator (the process's CPU generator,
            or the CUDA device's), which plain training draws from.

    Returns:
        ``{"dropout:<device type>": state}`` (a ``torch.ByteTensor``), for
        :attr:`TrainingState.rng`.
    """
    if generator is not None:
        state = generator.get_state()
    elif torch_device.type == "cuda":
        state = torch.cuda.get_rng_state(_cuda_index(torch_device))
    else:
        state = torch.get_rng_state()
    return {_dropout_key(torch_device): state}


def restore_rng(states: Mapping[str, torch.Tensor], torch_device: torch.device,
                generator: torch.Generator | None = None) -> None:
    """Put back the dropout stream :func:`capture_rng` took, into ``generator`` or the device's.

    Raises:
        KeyError: ``states`` holds no dropout stream of this device type
            (:func:`load_latest` with ``device_type`` never returns such a state).
    """
    state = states[_dropout_key(torch_device)]
    if generator is not None:
        generator.set_state(state)
    elif torch_device.type == "cuda":
        torch.cuda.set_rng_state(state, _cuda_index(torch_device))
    else:
        torch.set_rng_state(state)


def _dropout_key(torch_device: torch.device) -> str:
    return f"dropout:{torch_device.type}"


def _cuda_index(torch_device: torch.device) -> int:
    return torch_device.index if torch_device.index is not None else torch.cuda.current_device()


def optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                            names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Return an optimizer's per-parameter state keyed by parameter name.

    Args:
        optimizer: A ``torch.optim`` optimizer (AdamW, SGD).
        names: ``names[i]`` is the name of the optimizer's ``i``-th parameter, counting
            through its parameter groups in order (for one optimizer over
            ``model.parameters()``: ``[n for n, _ in model.named_parameters()]``; for one
            optimizer per shard, the names of that shard's parameters).

    Returns:
        Name -> the parameter's state (e.g. ``step``, ``exp_avg``, ``exp_avg_sq``), sharing
        the optimizer's tensors; merge the dicts of several optimizers with ``|``.
    """
    state = optimizer.state_dict()["state"]
    return {names[index]: values for index, values in state.items()}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer,
                                 state: Mapping[str, dict[str, Any]],
                                 names: Sequence[str]) -> None:
    """Load per-parameter state (of any layout's optimizers) into ``optimizer``.

    Entries of ``state`` for parameters this optimizer does not hold are ignored, so each
    shard's optimizer can take its part of a whole model's state. Tensors are copied, then
    moved to each parameter's device and dtype as ``Optimizer.load_state_dict`` does;
    hyperparameters and the LR stay the optimizer's own.

    Args:
        optimizer: The freshly built optimizer.
        state: Name -> state, from :func:`optimizer_state_by_name`.
        names: As for :func:`optimizer_state_by_name`.
    """
    current = optimizer.state_dict()
    current["state"] = {  # copies: ``state`` may share tensors with another live optimizer
        index: {key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in state[name].items()}
        for index, name in enumerate(names) if name in state}
    optimizer.load_state_dict(current)


def checkpoint_files(state_dir: str | os.PathLike[str]) -> list[Path]:
    """Return the checkpoint files in ``state_dir``, newest (highest step) first."""
    directory = Path(state_dir)
    if not directory.is_dir():
        return []
    found = [(int(m[1]), path.name, path) for path in directory.iterdir()
             if (m := _NAME.match(path.name))]
    return [path for _, _, path in sorted(found, reverse=True)]


class _HashingWriter(io.RawIOBase):
    """A write-only stream that hashes what it passes to the file below."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self._file = file
        self.sha256 = hashlib.sha256()
        self.error: OSError | None = None  # torch.save reports it only as "unexpected pos"

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        try:
            self._file.write(view)
        except OSError as err:
            self.error = err
            raise
        return view.nbytes


def save_checkpoint(state_dir: str | os.PathLike[str], state: TrainingState, key: str, *,
                    keep: int = 2) -> Path:
    """Write a checkpoint atomically, then delete older ones beyond the newest ``keep``.

    Checkpoints of the same or a later step than ``state.step`` are deleted too: the job
    resumed from an earlier one, so they were unusable (damaged, or another job's).

    Args:
        state_dir: The job's checkpoint directory (created if missing).
        state: The state to write (CPU tensors).
        key: :func:`job_key` of the job.
        keep: Checkpoints to keep, >= 1 (2: one to fall back to if the newest is damaged).

    Returns:
        The checkpoint file.

    Raises:
        OSError: The file cannot be written (disk full, permissions); no checkpoint file
            is left half-written.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": _FORMAT,
        "version": CHECKPOINT_VERSION,
        "job_key": key,
        "step": state.step,
        "model": state.model,
        "optimizer": state.optimizer,
        "rng": state.rng,
        "metrics": [(p.step, p.name, p.value) for p in state.metrics],
        "elapsed_s": state.elapsed_s,
        "extra": state.extra,
    }
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f"{_TMP_PREFIX}{state.step:09d}-",
                                    suffix=".ckpt")
    writer: _HashingWriter | None = None
    try:
        with os.fdopen(fd, "wb") as file:
            writer = _HashingWriter(file)
            torch.save(payload, cast(BinaryIO, writer))
            file.flush()
            os.fsync(file.fileno())
        target = directory / f"step-{state.step:09d}-{writer.sha256.hexdigest()[:16]}.ckpt"
        os.replace(tmp_name, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        failed = writer.error if writer is not None else None
        if failed is not None and not isinstance(exc, OSError):  # torch: "unexpected pos"
            raise OSError(failed.errno, failed.strerror, tmp_name) from exc
        raise
    _fsync_directory(directory)
    # Files of this or a later step are from a timeline this job abandoned (unusable or another
    # job's, else it would have resumed from them); of the rest, the newest ``keep`` stay.
    kept = 1  # the new one
    for old in checkpoint_files(directory):
        if old == target:
            continue
        if _step_of(old) < state.step and kept < keep:
            kept += 1
            continue
        with contextlib.suppress(OSError):
            old.unlink()
    return target


def _step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    assert match is not None, path
    return int(match[1])


def load_latest(state_dir: str | os.PathLike[str] | None, key: str,
                device_type: str | None = None) -> TrainingState | None:
    """Return the newest intact checkpoint of the job, or ``None`` to start from step 0.

    Files are tried newest first. One that fails its digest, cannot be read, has another
    format version, belongs to another job (``key``) or holds no dropout stream for
    ``device_type`` is skipped with a WARNING log line naming it and the reason. Temporary
    files of an interrupted write are deleted.

    Args:
        state_dir: The job's checkpoint directory (``None`` or missing: no checkpoint).
        key: :func:`job_key` of the job.
        device_type: ``"cpu"`` or ``"cuda"``: the device the job resumes on; ``None``: any.

    Returns:
        The state, or ``None`` when there is no usable checkpoint.
    """
    if state_dir is None:
        return None
    directory = Path(state_dir)
    if directory.is_dir():
        for stale in directory.glob(f"{_TMP_PREFIX}*"):
            _log.warning("%s: deleting the temporary file of an interrupted checkpoint write",
                         stale)
            with contextlib.suppress(OSError):
                stale.unlink()
    files = checkpoint_files(directory)
    for path in files:
        try:
            state = _read(path, key)
            if device_type is not None and f"dropout:{device_type}" not in state.rng:
                kinds = sorted(name.split(":", 1)[1] for name in state.rng
                               if name.startswith("dropout:"))
                raise _Unusable(f"written on a {' or '.join(kinds) or 'unknown'} device, the "
                                f"job now runs on {device_type} (a different random stream)")
        except _Unusable as err:
            _log.warning("ignoring checkpoint %s: %s", path, err)
            continue
        _log.info("resuming job from %s (step %d)", path, state.step)
        return state
    if files:
        _log.warning("no usable checkpoint in %s: the job starts from step 0", directory)
    return None


class _Unusable(Exception):
    """A checkpoint file that cannot be resumed from (the message says why)."""


def _read(path: Path, key: str) -> TrainingState:
    match = _NAME.match(path.name)
    assert match is not None, path
    digest = hashlib.sha256()
    try:
        with path.open("rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as err:
        raise _Unusable(f"cannot read it: {err}") from err
    if digest.hexdigest()[:16] != match[2]:
        raise _Unusable("its content does not match its digest (damaged or truncated)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unpickling or archive error: the file is unusable
        raise _Unusable(f"cannot load it: {type(err).__name__}: {err}") from err
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise _Unusable("not a sweepmaster training-state checkpoint")
    if payload.get("version") != CHECKPOINT_VERSION:
        raise _Unusable(f"format version {payload.get('version')!r}, this sweepmaster reads "
                        f"version {CHECKPOINT_VERSION}")
    if payload.get("job_key") != key:
        raise _Unusable("written for another job (different model, data or settings)")
    if payload.get("step") != int(match[1]):
        raise _Unusable(f"holds step {payload.get('step')!r}, its name says {int(match[1])}")
    try:
        return TrainingState(
            step=payload["step"], model=payload["model"], optimizer=payload["optimizer"],
            rng=payload["rng"],
            metrics=[MetricPoint(int(s), str(n), float(v)) for s, n, v in payload["metrics"]],
            elapsed_s=float(payload["elapsed_s"]), extra=payload["extra"],
        )
    except (KeyError, TypeError, ValueError) as err:
        raise _Unusable(f"malformed: {type(err).__name__}: {err}") from err


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

