"""Crash-safe training-state checkpoints: stop a job anywhere, resume it with the same numbers.

A checkpoint is everything a job needs to continue exactly where it stopped: model weights,
optimizer state, LR-schedule position, RNG states, data position (the step, and from it the
epoch and the index into :func:`~sweepmaster.runtime.plain.minibatch_indices` order), the
metric history and elapsed training time. A job resumed from a checkpoint taken after step k
ends with the weights of an uninterrupted run (DESIGN, "Exactness"): every random stream and
every optimizer number is restored bit for bit.

On disk (format version :data:`CHECKPOINT_VERSION`) a job's ``state_dir`` holds files
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

The module is shared by every training path. Plain training
(:func:`~sweepmaster.runtime.plain.train_plain`) stores one optimizer and one ``LambdaLR``; a
spilled job stores one optimizer state per shard (``None`` for a shard that owns no
parameter) and its own dropout generator; a fused array stores its fused optimizer's state and
one generator per member. Path-specific values go into :attr:`TrainingState.extra`.

Example:
    >>> state = TrainingState(step=100, model=model.state_dict(),  # doctest: +SKIP
    ...                       optimizers=[optimizer.state_dict()],
    ...                       schedulers=[scheduler.state_dict()],
    ...                       rng=capture_rng(torch.device("cpu")), metrics=metrics)
    >>> save_checkpoint(spec.state_dir, state, job_key(spec))  # doctest: +SKIP
    >>> resumed = load_latest(spec.state_dir, job_key(spec))  # doctest: +SKIP
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
from collections.abc import Mapping
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
    """A job's complete training state after ``step`` optimizer steps.

    Every tensor is on the CPU (host copies); :func:`save_checkpoint` writes it as it is.

    Attributes:
        step: Optimizer steps done; training resumes with step ``step + 1``, whose minibatch
            is number ``step`` of the job's minibatch order.
        model: The model's ``state_dict()`` (tied weights appear under each name).
        optimizers: ``state_dict()`` of each optimizer: one for plain training and fused
            arrays, one per shard for a spilled job (``None`` where a shard has none).
        schedulers: ``state_dict()`` of each LR scheduler (empty where the path computes
            the LR from the step).
        rng: Named generator states (``torch.ByteTensor``): ``"cpu"`` (the process's CPU
            generator, for a job that draws dropout from it), ``"cuda:N"``, or names of
            job-owned generators (``"dropout"``, ``"member:3"``); see :func:`capture_rng`.
        metrics: The job's recorded metrics so far, in order.
        elapsed_s: Seconds of training and evaluation before the checkpoint.
        extra: Anything else a training path needs to continue (plain values and tensors
            only: strings, numbers, booleans, None, lists, tuples, dicts, tensors).
    """

    step: int
    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any] | None]
    schedulers: list[dict[str, Any]] = field(default_factory=list)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: list[MetricPoint] = field(default_factory=list)
    elapsed_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def data_position(self, steps_per_epoch: int) -> tuple[int, int]:
        """Return ``(epoch, index)`` of the next minibatch in the job's minibatch order.

        Args:
            steps_per_epoch: Minibatches per epoch (``TrainSpec.steps_per_epoch``).
        """
        return divmod(self.step, steps_per_epoch)


def job_key(spec: TrainSpec) -> str:
    """Hash everything that decides a job's numbers, so a checkpoint resumes only its own job.

    Covers the model source (a HuggingFace config's JSON, or a directory / hub name; a factory
    is represented by its qualified name), ``dtype``, the optimizer and schedule, batch size,
    seed, total steps, evaluation cadence, the metric, and the bytes of the train and eval
    blocks. Not covered: ``name`` and output directories.

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
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    for blocks in (spec.train_data, spec.eval_data):
        if blocks is None:
            digest.update(b"none")
            continue
        digest.update(f"{tuple(blocks.shape)}{blocks.dtype}".encode())
        digest.update(blocks.detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()


def capture_rng(
    torch_device: torch.device, generators: Mapping[str, torch.Generator] | None = None
) -> dict[str, torch.Tensor]:
    """Snapshot the RNG states a job draws from.

    Call it between steps, holding whatever lock guards the process's CPU generator.

    Args:
        torch_device: The job's device: ``cpu`` snapshots the process's CPU generator
            (``"cpu"``), ``cuda:N`` that device's generator (``"cuda:N"``).
        generators: Job-owned generators by name (a spilled job's dropout generator, a fused
            array's per-member generators); each is snapshotted under its name.

    Returns:
        Name -> state (``torch.ByteTensor``), for :attr:`TrainingState.rng`.
    """
    states: dict[str, torch.Tensor] = {}
    if torch_device.type == "cuda":
        index = torch_device.index if torch_device.index is not None \
            else torch.cuda.current_device()
        states[f"cuda:{index}"] = torch.cuda.get_rng_state(index)
    else:
        states["cpu"] = torch.get_rng_state()
    for name, generator in (generators or {}).items():
        states[name] = generator.get_state()
    return states


def restore_rng(states: Mapping[str, torch.Tensor], torch_device: torch.device,
                generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put back the RNG states :func:`capture_rng` took (same device, same generator names).

    Raises:
        KeyError: A state the device or a named generator needs is missing.
    """
    if torch_device.type == "cuda":
        index = torch_device.index if torch_device.index is not None \
            else torch.cuda.current_device()
        torch.cuda.set_rng_state(states[f"cuda:{index}"], index)
    else:
        torch.set_rng_state(states["cpu"])
    for name, generator in (generators or {}).items():
        generator.set_state(states[name])


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

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self._file.write(view)
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
        "optimizers": state.optimizers,
        "schedulers": state.schedulers,
        "rng": state.rng,
        "metrics": [(p.step, p.name, p.value) for p in state.metrics],
        "elapsed_s": state.elapsed_s,
        "extra": state.extra,
    }
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f"{_TMP_PREFIX}{state.step:09d}-",
                                    suffix=".ckpt")
    try:
        with os.fdopen(fd, "wb") as file:
            writer = _HashingWriter(file)
            torch.save(payload, cast(BinaryIO, writer))
            file.flush()
            os.fsync(file.fileno())
        target = directory / f"step-{state.step:09d}-{writer.sha256.hexdigest()[:16]}.ckpt"
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
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


def load_latest(state_dir: str | os.PathLike[str] | None, key: str) -> TrainingState | None:
    """Return the newest intact checkpoint of the job, or ``None`` to start from step 0.

    Files are tried newest first. One that fails its digest, cannot be read, has another
    format version, or belongs to another job (``key``) is skipped with a WARNING log line
    naming it and the reason. Temporary files of an interrupted write are deleted.

    Args:
        state_dir: The job's checkpoint directory (``None`` or missing: no checkpoint).
        key: :func:`job_key` of the job.

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
            step=payload["step"], model=payload["model"], optimizers=payload["optimizers"],
            schedulers=payload["schedulers"], rng=payload["rng"],
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

