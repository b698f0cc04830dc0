"""One launch's loop: ask Optuna for trials, train them on the executor, tell Optuna the results.

:func:`~sweepmaster.sweep.run.run_sweep` opens the study and the store and runs a :class:`Launch`:

1. While the executor has room for more jobs, ask Optuna for a trial and build its
   :class:`~sweepmaster.workload.spec.TrainSpec`. Each job takes its own share of a device
   (:func:`device_share`, from its own plan): a spilled one half (SHARP alternates two), one that
   fits its planned footprint's share, at least half, so two resident jobs share a device where
   they fit together; trials are asked while the running jobs' shares sum below the number of
   devices.
2. Trials that may fuse (same :func:`~sweepmaster.workload.architecture.fusion_group_key`:
   model config, dtype, batch and block size, optimizer kind) wait in a pool until the pool holds
   the fusion degree K of their architecture
   (:meth:`~sweepmaster.runtime.executor.ShardExecutor.fusion_choice`, from
   ``resources.fusion``, chosen for the widest trial the search space allows:
   :func:`~sweepmaster.config.train_specs.widest_member`); then they are submitted as one fused
   array (:meth:`~sweepmaster.runtime.executor.ShardExecutor.submit_fused`), its members
   recorded in ``sm_fusion_groups``. So about K x capacity trials are asked at a time: when more
   than that wait (trials of several architectures alternate), the fullest pool is submitted as it
   is, and so are all pools when Optuna has no more trials to give. K = 1 trains each trial alone.
   Trials that spill fuse too, into a spilled fused array of stacked shards, when
   ``resources.fusion`` is a fixed K (``auto`` keeps them alone).
   A fused array refills (spilled or not): when members leave it (pruned, finished,
   failed), its training thread asks the launch (:meth:`Launch.refill`) and the launch gives
   each free slot the next trial of the array's group, from its pool or asked from Optuna,
   which joins the array at once (``ShardExecutor.join_fused``) instead of waiting for a new array
   (a trial the executor refuses, whose array would outgrow its device or its stacked plan,
   waits in the pool);
   joins and leaves are recorded in ``sm_fusion_groups`` with the array's step.
3. Every trial, fused or not, reports its progress to the store and its evaluations to Optuna
   (pruning honoured: a pruned member leaves its array, the others go on); as each trial's
   future resolves, its final state and objective are told to Optuna and the best checkpoints
   saved.
4. Every asked trial records Optuna's trial heartbeat until it is told
   (:class:`~sweepmaster.sweep.resume.TrialHeartbeat`); trials of a dead process are failed by
   :func:`~sweepmaster.sweep.resume.fail_stale` at the start and every grace period, and re-queued
   to resume from their checkpoints. A trial's training state is deleted once it is told COMPLETE
   or PRUNED.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
from optuna.trial import Trial, TrialState

from sweepmaster import study as study_manager
from sweepmaster.config.schema import SweepConfig
from sweepmaster.config.train_specs import widest_member
from sweepmaster.errors import DiskFullError, StorageError, disk_full_cause
from sweepmaster.runtime import ShardExecutor
from sweepmaster.runtime.events import TRIAL_STATISTICS, TaskRecord
from sweepmaster.store import ProgressRecorder, TaskEventRecorder
from sweepmaster.store.retry import RetryPolicy, run_with_retry
from sweepmaster.sweep.kept_weights import FinalWeightsKeeper
from sweepmaster.sweep.observer import SweepObserver
from sweepmaster.sweep.resume import TrialHeartbeat, fail_stale
from sweepmaster.sweep.signals import interrupt_reason
from sweepmaster.sweep.trial_callbacks import TrialCallbacks
from sweepmaster.workload import TrainResult, TrainSpec
from sweepmaster.workload.architecture import architecture_key, fusion_group_key

__all__ = ["Launch", "device_share", "max_concurrent_trials"]

_log = logging.getLogger(__name__)



class GroupSink(Protocol):
    """Records fused arrays' members (``sm_fusion_groups``; :mod:`sweepmaster.store.fusion`)."""

    def joined(self, job: str, architecture_key: str, trial_numbers: Sequence[int],
               joined_step: int) -> None:
        """Trials joined array ``job`` after its ``joined_step`` steps (0: they founded it)."""

    def left(self, job: str, trial_number: int, left_step: int) -> None:
        """A trial left array ``job`` after its ``left_step`` steps."""


#: The smallest share of a device a job takes: two jobs per device at most, so that while one
#: job's task runs the other is ready (SHARP); more buys nothing on a device that runs one task
#: at a time.
MIN_DEVICE_SHARE = 0.5


def device_share(executor: ShardExecutor, spec: TrainSpec, num_members: int = 1) -> float:
    """The share of one device a job of ``spec`` (K = ``num_members`` trials) takes, from its plan.

    A job that spills shares the devices task by task (SHARP): half a device, so two alternate
    on each. A job that fits is one shard kept resident between its steps: its planned plain
    footprint's share of the budget, at least :data:`MIN_DEVICE_SHARE`, so two resident jobs
    share a device where they fit together and SHARP interleaves them. A fused array of K > 1
    fills its device by design (its K was chosen to fit one): a whole device, half when it
    spills. On the unmetered host CPU (nothing moves, so nothing overlaps) a job takes a whole
    device.

    Raises:
        LayerTooLargeError: A layer of ``spec`` alone does not fit the devices.
    """
    spills = executor.will_spill(spec)
    if spills:
        return MIN_DEVICE_SHARE
    if num_members > 1 or any(device.meter is None for device in executor.devices):
        return 1.0
    plan = executor.plan(spec)
    return min(1.0, max(MIN_DEVICE_SHARE, plan.plain_bytes / plan.budget_bytes))


def max_concurrent_trials(executor: ShardExecutor, spec: TrainSpec) -> int:
    """How many jobs like ``spec`` (trials, or fused arrays) train at once on ``executor``.

    As many as their shares (:func:`device_share`) fit the devices.

    Raises:
        LayerTooLargeError: A layer of ``spec`` alone does not fit the devices.
    """
    return max(1, math.floor(len(executor.devices) / device_share(executor, spec)))


@dataclass
class _Array:
    """A fused array this launch submitted: its group and K, and whether it may still refill.

    An array is live until its last vacancy call (all K slots free) gives it no trial; the
    executor makes that call however the array ends.
    """

    group: tuple[str, str]
    num_slots: int
    live: bool
    num_shards: int = 1  # of its stacked plan when it spills


@dataclass
class _Trial:
    """An asked trial: its spec, callbacks and fusion group, the job training it once submitted."""

    trial: Trial
    spec: TrainSpec
    callbacks: TrialCallbacks
    group: tuple[str, str] | None = None  # fusion_group_key, None: trains alone
    k: int = 1  # its group's fusion degree
    share: float = 1.0  # of a device, its job's (device_share)
    job: str = ""
    joined_step: int = 0  # the array's steps when it joined (0: it founded it)


class Launch:
    """One launch's loop (module doc): ask trials while there is room, fuse, submit, tell.

    The loop runs on the calling thread; :meth:`refill` runs on the executor's training threads.
    Both hold one lock while they touch the launch's state (pools, running trials, the study).

    Args:
        config: The sweep.
        study: Its Optuna study.
        executor: Trains the jobs.
        make_spec: Builds a trial's spec (``name`` set to ``trial-<number>``).
        recorder: Progress rows and metrics.
        timeline: The device timeline.
        record_group: Records a fused array's members.
        observer: Progress display.
        keeper: Saves checkpoints.
        ask_lock: Makes the context held while a trial is asked, so that several workers of
            the study never get the same grid cell (default: none;
            :func:`~sweepmaster.store.locks.study_lock`).
    """

    def __init__(self, config: SweepConfig, study: optuna.Study, executor: ShardExecutor,
                 make_spec: Callable[[Trial], TrainSpec], recorder: ProgressRecorder,
                 timeline: TaskEventRecorder, record_group: GroupSink,
                 observer: SweepObserver, keeper: FinalWeightsKeeper,
                 ask_lock: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
                 ) -> None:
        self.config = config
        self.study = study
        self.executor = executor
        self.make_spec = make_spec
        self.recorder = recorder
        self.timeline = timeline
        self.record_group = record_group
        self.observer = observer
        self.keeper = keeper
        self.ask_lock = ask_lock
        self.running: dict[concurrent.futures.Future[TrainResult], _Trial] = {}
        self.pools: dict[tuple[str, str], list[_Trial]] = {}
        self.degrees: dict[tuple[str, str], int] = {}
        self.shares: dict[str, float] = {}  # job name -> its share of a device
        self.num_run = 0
        self.num_failed = 0
        self.heartbeat = TrialHeartbeat(study._storage)
        self.stale_check_s = config.resources.trial_heartbeat.interval_s
        self.target = 0
        self.arrays: dict[str, _Array] = {}  # fused job name -> the array
        self._lock = threading.RLock()
        self._closing = False  # no more refills: the loop has ended or is stopping
        self._handoff: list[Trial] = []  # asked by a refill, of another group: placed here
        self._wake: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(self, target: int) -> None:
        """Train trials until the study has ``target`` finished ones (or the grid is done).

        A launch stops asking for new trials once ``target`` of its own trials have failed
        (not counting interruptions): failures that many come from the sweep, not from chance,
        and asking on would never end. The sweep then ends ``failed`` or ``incomplete``.

        Trials of a dead process are failed and re-queued first and then every heartbeat
        interval, and then the temporary folders of their weight saves deleted; with the heartbeat
        on, a launch with nothing left to ask waits while trials of other processes run (they
        finish, or go stale and are re-queued for it to run).
        """
        self.target = target
        next_check = -math.inf
        try:
            while True:
                with self._lock:
                    if time.monotonic() >= next_check:
                        if self.stale_check_s is not None:
                            fail_stale(self.study, keep=self.heartbeat.trial_ids())
                        self.keeper.remove_leftovers()  # of saves that died, once told
                        next_check = time.monotonic() + (self.stale_check_s or math.inf)
                    while self._handoff:
                        self._add(self._handoff.pop(0))
                    self._ask(target)
                    # an array whose members all left may still refill: not idle until it ends
                    idle = not self.running and not any(a.live for a in self.arrays.values())
                    if idle and (self.stale_check_s is None or not self._others_running()):
                        self._closing = True
                        return
                    waiting: list[concurrent.futures.Future[Any]] = [*self.running, self._wake]
                if idle:
                    time.sleep(max(0.0, next_check - time.monotonic()))
                    continue
                done, _ = concurrent.futures.wait(
                    waiting, timeout=self.stale_check_s,
                    return_when=concurrent.futures.FIRST_COMPLETED)
                with self._lock:
                    if self._wake.done():
                        self._wake = concurrent.futures.Future()
                    for future in done:
                        if future in self.running:  # else a refill told it already
                            self._finish(future)
        finally:
            with self._lock:
                self._closing = True
            self.heartbeat.close()

    def _others_running(self) -> bool:
        """Whether trials of other processes (live or dead) are RUNNING in the study."""
        ours = {t.trial._trial_id for t in self.running.values()}
        running = run_with_retry(
            lambda: self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)),
            "read the running trials of the study")
        return any(t._trial_id not in ours for t in running)

    def _num_waiting(self) -> int:
        return sum(len(pool) for pool in self.pools.values())

    def _room(self) -> float:
        """Devices left: their number less the shares of the jobs training (and refilling)."""
        live = {name for name, array in self.arrays.items() if array.live}
        jobs = {running.job for running in self.running.values()} | live
        return len(self.executor.devices) - sum(self.shares.get(job, 1.0) for job in jobs)

    def _ask(self, target: int) -> None:
        """Ask trials while the executor has room; submit full pools, and all when none is left."""
        while self._room() > 0:
            trial = self._next_trial()
            if trial is None:
                for group in list(self.pools):
                    self._submit(self.pools.pop(group))
                return
            self._add(trial)

    def _next_trial(self) -> Trial | None:
        """Optuna's next trial for this launch, or ``None`` when no more should start now."""
        if self.num_failed >= self.target:  # as many failures as trials wanted: the sweep's
            return None
        with self.ask_lock():
            trial = study_manager.next_trial(self.study, self.config, self.target,
                                             num_running=len(self.running) + self._num_waiting())
        if trial is not None:
            self.num_run += 1
        return trial

    def _add(self, trial: Trial) -> None:
        """Build a trial's spec; submit it alone or pool it for a fused array."""
        pending = self._prepare(trial)
        if pending is None:
            return
        group, k = pending.group, pending.k
        if group is None or k <= 1:
            self._submit([pending])
            return
        pool = self.pools.setdefault(group, [])
        pool.append(pending)
        free = max(1, math.floor(self._room() / pending.share))  # jobs that may still start
        if len(pool) >= k:
            self._submit(self.pools.pop(group))
        elif self._num_waiting() >= free * max(self.degrees.values()):
            fullest = max(self.pools, key=lambda g: len(self.pools[g]))
            self._submit(self.pools.pop(fullest))  # too many trials wait: fuse fewer

    def _prepare(self, trial: Trial, joining: tuple[str, str] | None = None) -> _Trial | None:
        """A trial's spec, callbacks and group; ``None``: it failed (told FAIL) or was handed off.

        With ``joining`` (a refill, on a training thread) a trial of another group is handed to
        the loop (placed there like any asked trial), so that nothing is measured or planned
        beside a training array.
        """
        self.heartbeat.add(trial._trial_id)
        callbacks = TrialCallbacks(trial, self.recorder, self.observer, self.config.study.metric)
        try:
            spec = self.make_spec(trial)
            group = fusion_group_key(spec) if self.executor.fusion != "off" else None
            if joining is not None and group != joining:
                self._handoff.append(trial)
                return None
            k = self._degree(spec, group)
            share = device_share(self.executor, spec, k)
        except StorageError:  # the database is gone: the sweep stops, the trial runs again
            raise
        except Exception as exc:  # one trial's failure never ends the sweep
            self._failed(trial, _reason(exc))
            return None
        except BaseException as stop:  # Ctrl-C or SIGTERM while it was prepared (or its
            # fusion degree measured)
            self._failed(trial, f"{interrupt_reason(stop)}; runs again on relaunch",
                         interrupted=True)
            raise
        return _Trial(trial, spec, callbacks, group, k, share)

    def refill(self, job: str, free: int, array_step: int) -> None:
        """Give the free slots of fused array ``job`` the next trials of its group (refill).

        The executor's vacancy hook, on the array's training thread, at a step boundary where
        members have left it. First the members that left are told (Optuna's pruner and
        sampler see them), then each free slot takes a trial of the array's group waiting in
        the pool, or else the next trial Optuna gives; it joins the array at once
        (``ShardExecutor.join_fused``), trained as it would be alone. A trial Optuna gives of
        another group goes to the loop, which places it as usual, and the refill stops there.
        """
        with self._lock:
            array = self.arrays.get(job)
            if array is None:
                return
            try:
                if not self._closing:
                    for left in [f for f, t in self.running.items()
                                 if t.job == job and f.done()]:
                        self._finish(left)
                    self._join(job, array, free, array_step)
            finally:
                members = [f for f, t in self.running.items() if t.job == job and not f.done()]
                if free == array.num_slots and not members:
                    array.live = False  # it has ended: the loop may start another job
                if not self._wake.done():
                    self._wake.set_result(None)  # the loop waits on new futures, or asks again

    def _join(self, job: str, array: _Array, free: int, array_step: int) -> None:
        """Give up to ``free`` trials of its group to array ``job`` (see :meth:`refill`)."""
        group = array.group
        for _ in range(free):
            pool = self.pools.get(group, [])
            if pool:
                pending: _Trial | None = pool.pop(0)
                if not pool:
                    del self.pools[group]
            elif (trial := self._next_trial()) is not None:
                pending = self._prepare(trial, joining=group)
                if pending is None and trial in self._handoff:
                    return  # of another group: the loop places it
                if pending is None:
                    continue  # it failed
            else:
                return
            assert pending is not None
            pending.callbacks.num_shards = array.num_shards
            future = self.executor.join_fused(job, pending.spec, pending.callbacks)
            if future is None:  # the array is ending, or would outgrow its device with the
                # trial (a LoRA rank wider than its K was chosen for): it waits for another
                self.pools.setdefault(group, []).insert(0, pending)
                return
            pending.job, pending.joined_step = job, array_step
            self.running[future] = pending
            number = pending.trial.number
            self.observer.message(f"trial {number} joins fused array {job} at its step "
                                  f"{array_step}")
            try:
                self.record_group.joined(job, architecture_key(pending.spec), [number],
                                         array_step)
            except StorageError as err:  # informational: the trial trains anyway
                _log.warning("trial %d joining %s not recorded: %s", number, job, err)

    def _degree(self, spec: TrainSpec, group: tuple[str, str] | None) -> int:
        """The fusion degree of ``spec``'s group (chosen once per group per launch).

        Chosen for the group's widest trial
        (:func:`~sweepmaster.config.train_specs.widest_member`): refills may bring it.
        """
        if group is None:
            return 1
        if group not in self.degrees:
            if self.executor.fusion == "auto":
                self.observer.message(f"choosing the fusion degree of architecture {group[0]} "
                                      "(measured once on a device, then cached)")
            widest = widest_member(self.config, spec)
            # A measurement waits for a device: an array refilling there must not wait for us.
            self._lock.release()
            try:
                choice = self.executor.fusion_choice(widest)
            finally:
                self._lock.acquire()
            sized = "" if widest.peft is None or spec.peft is None or \
                widest.peft.r == spec.peft.r else \
                f" (sized for LoRA rank {widest.peft.r}, the largest the search space allows)"
            self.observer.message(f"fusion of architecture {group[0]}: {choice.note}{sized}")
            self.degrees[group] = choice.k
        return self.degrees[group]

    def _submit(self, trials: list[_Trial]) -> None:
        """Submit one trial alone, or several as one fused array; failures fail its trials."""
        specs = [t.spec for t in trials]
        callbacks = [t.callbacks for t in trials]
        if len(trials) == 1:
            name = specs[0].name
            if self.executor.will_spill(specs[0]):
                callbacks[0].num_shards = len(self.executor.plan(specs[0]).shards)
        else:
            name = "trials-" + "+".join(str(t.trial.number) for t in trials)
        num_shards = 1
        try:
            if len(trials) > 1 and self.executor.will_spill(specs[0]):  # stacked shards
                plan = self.executor.stacked_plan(self.executor.fused_spec(specs), len(specs))
                num_shards = len(plan.shards)
                for callback in callbacks:
                    callback.num_shards = num_shards
            self.timeline.name_job(name, trials[0].trial.number if len(trials) == 1 else None)
            if len(trials) == 1:
                futures = [self.executor.submit(specs[0], callbacks[0])]
            else:
                futures = self.executor.submit_fused(specs, callbacks, name=name,
                                                     on_vacancy=self.refill)
        except Exception as exc:  # one job's failure never ends the sweep
            for t in trials:
                self._failed(t.trial, _reason(exc))
            return
        self.shares[name] = max(t.share for t in trials)
        for t, future in zip(trials, futures, strict=True):
            t.job = name
            self.running[future] = t
        if len(trials) > 1:
            assert trials[0].group is not None
            self.arrays[name] = _Array(trials[0].group, len(trials), live=True,
                                       num_shards=num_shards)
            numbers = [t.trial.number for t in trials]
            self.observer.message(f"trials {', '.join(map(str, numbers))} train as one fused "
                                  f"array ({name}, K = {len(trials)})")
            try:
                self.record_group.joined(name, architecture_key(specs[0]), numbers, 0)
            except StorageError as err:  # informational: the trials train anyway
                _log.warning("fused array %s not recorded: %s", name, err)

    def _finish(self, future: concurrent.futures.Future[TrainResult]) -> None:
        """Tell Optuna and the store how a trial ended.

        Raises:
            DiskFullError: A full disk ended it (its training state, or its weights): the
                sweep stops; a trial that did not finish resumes on relaunch.
        """
        running = self.running.pop(future)
        trial = running.trial
        if running.job in self.arrays:  # a fused array's member left it
            steps = running.callbacks.last_step - running.callbacks.first_step
            try:
                self.record_group.left(running.job, trial.number, running.joined_step + steps)
            except StorageError as err:  # informational
                _log.warning("trial %d leaving %s not recorded: %s", trial.number,
                             running.job, err)
        try:
            result = future.result()
        except (KeyboardInterrupt, StorageError):  # Ctrl-C in a callback; the database is gone
            self.running[future] = running  # the trial runs again on relaunch
            raise
        except Exception as exc:
            full = disk_full_cause(exc)
            if full is not None:  # a checkpoint could not be written: not the trial's fault;
                self.running[future] = running  # it resumes on relaunch, the sweep stops
                path = getattr(full, "filename", None) or running.spec.state_dir or "?"
                raise DiskFullError(path, f"the training state of trial {trial.number}") \
                    from exc
            self._failed(trial, _reason(exc))
            return
        try:
            self._tell(running, result)
        except optuna.exceptions.UpdateFinishedTrialError:
            self._taken_over(trial)

    def _tell(self, running: _Trial, result: TrainResult) -> None:
        """Tell Optuna and the store that a trial trained to its end (COMPLETE or PRUNED).

        Raises:
            DiskFullError: Its weights could not be kept (a full disk): it is told COMPLETE
                with its objective first, without weights, and the sweep stops.
        """
        trial, config = running.trial, self.config
        stats = _device_stats(result, running.callbacks.num_shards)
        if result.pruned:
            self.recorder.finished(trial.number, "PRUNED", device_stats=stats)
            study_manager.tell(self.study, trial, state=TrialState.PRUNED)
            self._ended(running)
            self.observer.trial_finished(trial.number, "PRUNED", None, None)
            return
        if not math.isfinite(result.objective):
            self._failed(trial, f"objective {config.study.metric} is {result.objective}")
            return
        full: DiskFullError | None = None
        try:
            path = self.keeper.save(trial.number, running.spec, result)
        except DiskFullError as err:  # the objective is recorded all the same; then it stops
            path, full = None, err
        if path is not None and self.keeper.mode == "all":
            study_manager.set_user_attr(trial, "checkpoint_path", str(path))
        for key, value in config.constants().items():
            study_manager.set_user_attr(trial, key, value)
        self.recorder.finished(trial.number, "COMPLETE", objective=result.objective,
                               checkpoint_path=str(path) if path else None,
                               device_stats=stats)
        study_manager.tell(self.study, trial, result.objective)
        self._ended(running)
        if path is not None:
            self.keeper.prune(trial.number)
        self.observer.trial_finished(trial.number, "COMPLETE", result.objective, None)
        if full is not None:
            raise full

    def _ended(self, running: _Trial) -> None:
        """A trial was told COMPLETE or PRUNED: no heartbeat, no training state kept."""
        self.heartbeat.remove(running.trial._trial_id)
        state_dir = running.spec.state_dir
        if state_dir is not None:
            shutil.rmtree(state_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the sweep's last one: no empty state/ left
                state_dir.parent.rmdir()

    def _failed(self, trial: Trial, reason: str, *, interrupted: bool = False) -> None:
        try:
            study_manager.fail_trial(self.study, trial, reason, interrupted=interrupted)
        except optuna.exceptions.UpdateFinishedTrialError:
            self._taken_over(trial)
            return
        self.num_failed += not interrupted
        self.recorder.finished(trial.number, "FAIL", failure_reason=reason)
        self.heartbeat.remove(trial._trial_id)
        self.observer.trial_finished(trial.number, "FAIL", None, reason)

    def _taken_over(self, trial: Trial) -> None:
        """Another process failed this live trial (its heartbeat could not be recorded).

        That happens when this process lost the database for longer than the trial heartbeat's
        grace period while another worker of the sweep could reach it: the trial was re-queued
        there and runs again, so this process drops it without writing anything more.
        """
        reason = ("failed by another worker while this one could not reach the database; "
                  "its retry trains it again")
        self.heartbeat.remove(trial._trial_id)
        with contextlib.suppress(StorageError, ValueError):  # ValueError: recorded COMPLETE
            self.recorder.finished(trial.number, "FAIL", failure_reason=reason)
        self.observer.trial_finished(trial.number, "FAIL", None, reason)

    def abandon(self) -> None:
        """The database stayed unreachable: stop every trial and leave it to the relaunch.

        No retry here (that window has passed): each trial is marked interrupted (FAIL, queued
        again on relaunch) if the database answers at once; otherwise it stays RUNNING, its
        heartbeat stops, and the next launch fails it as stale and re-queues it. Either way it
        resumes from its last training-state checkpoint.
        """
        once = RetryPolicy(timeout_s=0.0)
        for trial in self._stop_all():
            try:
                study_manager.fail_trial(self.study, trial,
                                         "the database was unreachable; runs again on relaunch",
                                         interrupted=True, retry=once)
            except (StorageError, optuna.exceptions.UpdateFinishedTrialError):
                break
        self.heartbeat.close()
        self.running.clear()
        self.pools.clear()
        self._handoff.clear()

    def interrupt(self, why: str = "interrupted (Ctrl-C)") -> None:
        """Stop every running and waiting trial and mark it FAIL, to run again on relaunch."""
        for trial in self._stop_all():
            self._failed(trial, f"{why}; runs again on relaunch", interrupted=True)
        self.running.clear()
        self.pools.clear()
        self._handoff.clear()

    def _stop_all(self) -> list[Trial]:
        """Close the launch to refills and cancel every running job (abandon, interrupt).

        Returns:
            The trials to mark: the running ones, then those waiting in the pools or handed
            over to a refill.
        """
        with self._lock:  # a refill running now finishes first; none starts after
            self._closing = True
        for running in self.running.values():
            running.callbacks.stop()
        for job in {running.job for running in self.running.values()}:
            self.executor.cancel(job)
        waiting = [t.trial for pool in self.pools.values() for t in pool]
        return [*(t.trial for t in self.running.values()), *waiting, *self._handoff]

    def task_finished(self, record: TaskRecord) -> None:
        """A device ran a task: into the timeline, and to the display."""
        self.timeline.record(record)
        self.observer.task_finished(record)

    def flush(self) -> None:
        """Write what the recorders still buffer."""
        self.recorder.flush()
        self.timeline.flush()


def _reason(exc: BaseException) -> str:
    """A failed trial's one-line reason."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


def _device_stats(result: TrainResult, num_shards: int) -> dict[str, int | None]:
    """How a trial used its device, for ``sm_trial_progress`` (shards only when it spilled).

    Every statistic of :data:`TRIAL_STATISTICS` is the result's attribute of its name, but
    ``num_shards``, which the job's plan knows.
    """
    stats = {stat.name: getattr(result, stat.name) for stat in TRIAL_STATISTICS
             if stat.name != "num_shards"}
    return {**stats, "num_shards": num_shards if result.swap_bytes else None}
