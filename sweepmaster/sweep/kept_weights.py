"""Where a sweep's final weights are kept: every trial's, the best one's, or none.

:class:`FinalWeightsKeeper` writes them into the sweep's own directory
(:func:`~sweepmaster.sweep.resume.sweep_output_dir`) per ``output.save``, and with ``save: best``
deletes superseded ones only after the new best is recorded, so no record ever names a deleted
or half-written folder. A save that died (``kill -9``) leaves its temporary folder
(``.trial-<n>.tmp-*``, or ``.trial-<n>.old-*`` while replacing) that no record names;
:meth:`FinalWeightsKeeper.remove_leftovers` deletes those of trials that have ended.

Versions before the ``<sweep>-<key>`` layout kept a sweep's files in ``<output.dir>/<sweep>/``;
:func:`adopt_old_layout` moves such a folder into the sweep's directory when the sweep's
records name it, so its weights stay recorded and its interrupted trials resume.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.trial import TrialState
from sqlalchemy.engine import Engine

from sweepmaster.config.schema import SweepConfig
from sweepmaster.errors import DiskFullError, disk_full_cause
from sweepmaster.runtime.training.plain import isolated_host_rng
from sweepmaster.store.queries import SweepInfo, set_checkpoint_paths, trial_progress
from sweepmaster.store.retry import run_with_retry
from sweepmaster.sweep.resume import sweep_output_dir
from sweepmaster.workload import TrainResult, TrainSpec, build_model, save_weights

__all__ = ["FinalWeightsKeeper", "adopt_old_layout"]

#: The temporary folders :func:`~sweepmaster.workload.save_weights` makes beside ``trial-<n>``.
_SAVE_LEFTOVER = re.compile(r"^\.trial-(\d+)\.(tmp|old)-")


def _is_better(value: float, best: float | None, direction: str) -> bool:
    """Whether ``value`` beats ``best`` (``None``: nothing yet) in ``direction``."""
    if best is None:
        return True
    return value < best if direction == "minimize" else value > best


class FinalWeightsKeeper:
    """Saves final weights per ``output.save`` into the sweep's directory: all, the best, none.

    ``root`` is the sweep's own directory (:func:`~sweepmaster.sweep.resume.sweep_output_dir`), so
    no other sweep ever writes or deletes there. ``save: best`` keeps the best trial's folder
    only, in an order that never leaves a record pointing at missing or partial weights: the
    new best is written next to the old one (atomically, :func:`save_weights`), recorded and
    told, and only then (:meth:`prune`) are the records of worse trials cleared and their
    folders deleted. "Best" is judged against the whole study, read when a trial ends, so
    workers sharing the sweep never delete each other's better weights, nor the folder of a
    trial still running. With ``save: best`` the path is recorded in sweepmaster's progress
    row only: Optuna's user attributes cannot change once a trial finished, so they would keep
    naming deleted folders; ``save: all`` also sets the ``checkpoint_path`` user attribute.

    Args:
        config: The sweep (``output.save``, ``study.direction``).
        study: Its study.
        root: The sweep's directory; weights go to ``root/trial-<n>``.
        record: Records trials' ``checkpoint_path`` (``None``: clears it), e.g.
            :func:`~sweepmaster.store.set_checkpoint_paths` of the sweep.
    """

    def __init__(self, config: SweepConfig, study: optuna.Study, root: Path,
                 record: Callable[[dict[int, str | None]], None]) -> None:
        self.mode = config.output.save
        self.study = study
        self.root = root
        self.record = record
        self.direction = config.study.direction

    def _best_value(self) -> float | None:
        """The study's best objective now (every worker's trials), or ``None``."""

        def read() -> float | None:
            try:
                return self.study.best_value
            except ValueError:  # no COMPLETE trial yet
                return None

        return run_with_retry(read, "read the best trial of the study")

    def save(self, number: int, spec: TrainSpec, result: TrainResult) -> Path | None:
        """Save trial ``number``'s weights if ``output.save`` keeps them; return where.

        Building the model to hold them draws from the CPU generator; that happens under
        :func:`~sweepmaster.runtime.training.plain.isolated_host_rng`, so trials training on the
        CPU meanwhile keep their random streams (their dropout draws from it).

        Raises:
            StorageError: The study could not be read through a database outage.
            DiskFullError: The filesystem of the sweep's directory is full; the weights kept
                before are intact.
        """
        if self.mode == "none" or not math.isfinite(result.objective):
            return None
        if self.mode == "best" and not _is_better(result.objective, self._best_value(),
                                                  self.direction):
            return None
        with isolated_host_rng():  # the weights are loaded next: the init's draws are lost
            model = build_model(spec.model, spec.dtype, spec.peft)
        model.load_state_dict(result.state_dict)
        target = self.root / f"trial-{number}"
        try:
            return save_weights(model, target)  # nothing half-written is left on failure
        except Exception as exc:
            if disk_full_cause(exc) is None:
                raise
            raise DiskFullError(target, f"the weights of trial {number}") from exc

    def prune(self, number: int) -> None:
        """``save: best``: trial ``number`` was told COMPLETE; delete worse trials' weights.

        Deleted: the folders of COMPLETE trials no better than it, and of trials that ended
        without completing (a crash between saving and telling). Kept: running trials' folders
        (another worker may be recording them) and better ones. Records first, then folders.

        Raises:
            StorageError: The database stayed unavailable longer than the retry policy allows
                (then nothing was deleted).
        """
        if self.mode != "best":
            return
        trials = {t.number: t for t in run_with_retry(
            lambda: self.study.get_trials(deepcopy=False), "read the trials of the study")}
        value = trials[number].value
        doomed: dict[int, Path] = {}
        for folder in self.root.glob("trial-*"):
            other = trials.get(int(folder.name[6:])) if folder.name[6:].isdigit() else None
            if other is None or other.number == number or not other.state.is_finished():
                continue
            if other.state != TrialState.COMPLETE or not _is_better(
                    other.value if other.value is not None else math.nan, value,
                    self.direction):
                doomed[other.number] = folder
        if not doomed:
            return
        self.record(dict.fromkeys(sorted(doomed)))
        for folder in doomed.values():
            shutil.rmtree(folder, ignore_errors=True)

    def remove_leftovers(self) -> list[Path]:
        """Delete the temporary folders of weight saves that died; return the ones deleted.

        A folder ``.trial-<n>.tmp-*`` (or ``.old-*``) belongs to the save of trial ``n``. Only
        those of trials that have ended (or that the study does not know) are deleted: the
        trial of a live save is RUNNING until it is told, so another launch of the sweep saving
        weights right now keeps its folder; a killed trial's folder goes once it is failed as
        stale (:func:`~sweepmaster.sweep.resume.fail_stale`).

        Raises:
            StorageError: The study could not be read through a database outage.
        """
        found = {folder: int(match[1]) for folder in self.root.glob(".trial-*")
                 if (match := _SAVE_LEFTOVER.match(folder.name)) and folder.is_dir()}
        if not found:
            return []
        trials = {t.number: t for t in run_with_retry(
            lambda: self.study.get_trials(deepcopy=False), "read the trials of the study")}
        removed = []
        for folder, number in sorted(found.items()):
            trial = trials.get(number)
            if trial is None or trial.state.is_finished():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        return removed


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` lies under ``folder`` (relative ones: from the working directory)."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))


def _move_missing(source: Path, target: Path, merge: bool = True) -> list[Path]:
    """Move ``source`` to ``target``, or (``merge``) the entries of it that ``target`` lacks.

    Only the ``state`` folder (one training-state folder per trial series) is merged again
    below; a ``trial-<n>`` folder ``target`` already has stays in ``source``. Returns what
    stayed.
    """
    if not target.exists():
        os.replace(source, target)
        return []
    if not (merge and source.is_dir() and target.is_dir()):
        return [source]
    stayed = [kept for entry in sorted(source.iterdir())
              for kept in _move_missing(entry, target / entry.name, entry.name == "state")]
    if not stayed:
        source.rmdir()
    return stayed


def _recorded_paths(study: optuna.Study, engine: Engine, sweep_id: int) -> dict[int, str]:
    """Trial number -> ``checkpoint_path`` in Optuna's user attributes or (newer) progress rows."""
    paths = {t.number: t.user_attrs["checkpoint_path"] for t in run_with_retry(
        lambda: study.get_trials(deepcopy=False), "read the trials of the study")
        if isinstance(t.user_attrs.get("checkpoint_path"), str)}
    rows = run_with_retry(lambda: trial_progress(engine, sweep_id), "read the trials' progress")
    paths.update({row.trial_number: row.checkpoint_path for row in rows if row.checkpoint_path})
    return paths


def adopt_old_layout(config: SweepConfig, sweep: SweepInfo, study: optuna.Study,
                     engine: Engine) -> str | None:
    """Move an older version's ``<output.dir>/<sweep>/`` into the sweep's directory if it is its.

    The folder provably belongs to this sweep when a record of it (a ``checkpoint_path`` in
    sweepmaster's progress rows or in Optuna's user attributes) names a path inside it: then
    its weights (``trial-<n>/``) and the training state of interrupted trials (``state/``)
    move to :func:`~sweepmaster.sweep.resume.sweep_output_dir` (entries that one already has stay),
    the progress rows name the new paths, and the old name becomes a link to the new folder,
    so the paths in Optuna's user attributes (which cannot change) still lead to the weights.
    Otherwise nothing moves: another database's sweep of the same name, launched from the same
    folder, may own it. Relative paths are taken from the working directory, as ``output.dir``.

    Args:
        config: The sweep (``output.dir``, ``name``).
        sweep: Its record.
        study: Its study.
        engine: The database of its records.

    Returns:
        One line for the launch to show, saying what is kept where; ``None`` when there is
        no old folder.

    Raises:
        StorageError: The records could not be read or written through a database outage.
    """
    old, new = Path(config.output.dir) / config.name, sweep_output_dir(config, sweep)
    if not old.is_dir() or old.is_symlink():
        return None
    named = {number: path for number, path in _recorded_paths(study, engine, sweep.id).items()
             if _inside(Path(path), old)}
    if not named:
        return (f"{old} holds files of an older sweepmaster that no record of this sweep names: "
                f"left there; this sweep keeps its weights and training state in {new}")
    stayed = _move_missing(old, new)
    moved = {number: new / Path(os.path.abspath(path)).relative_to(os.path.abspath(old))
             for number, path in named.items()}
    set_checkpoint_paths(engine, sweep.id,
                         {number: str(path) for number, path in moved.items() if path.exists()})
    what = f"moved {old} (this sweep's files, written by an older sweepmaster) to {new}"
    if stayed:
        shown = ", ".join(str(path.relative_to(old)) for path in stayed)
        return f"{what}, but for {shown}, which {new} has already: left in {old}"
    try:
        old.symlink_to(new.name, target_is_directory=True)
    except OSError:
        pass  # the progress rows name the new folder; only Optuna's user attributes do not
    return f"{what}; its interrupted trials resume from there"
