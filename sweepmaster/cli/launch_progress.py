"""The terminal display of ``launch``: progress bars for the sweep, its trials and its devices.

Trials train concurrently and report from the executor's worker threads; rich's ``Progress`` is
thread-safe, and the display's own state is guarded by a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column

from sweepmaster.runtime.events import (
    TASK_STATISTICS,
    EvalEvent,
    StepEvent,
    TaskRecord,
)
from sweepmaster.sweep.observer import SweepObserver

__all__ = ["LaunchDisplay"]

#: Seconds of task history a device's utilization is measured over.
_UTILIZATION_WINDOW_S = 30.0


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _format_bytes(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


#: The task statistics a device's line adds up (swap and p2p bytes).
_DEVICE_TOTALS = tuple(s for s in TASK_STATISTICS if s.aggregate == "sum" and s.label)


class _Device:
    """What one device did recently: its task intervals, swap and p2p bytes, current job."""

    def __init__(self, task: TaskID) -> None:
        self.task = task
        self.intervals: deque[tuple[float, float]] = deque()
        self.totals = dict.fromkeys((stat.name for stat in _DEVICE_TOTALS), 0)
        self.current = ""

    def utilization(self, now: float) -> float:
        start = now - _UTILIZATION_WINDOW_S
        while self.intervals and self.intervals[0][1] < start:
            self.intervals.popleft()
        busy = sum(min(end, now) - max(begin, start) for begin, end in self.intervals)
        return max(0.0, min(1.0, busy / _UTILIZATION_WINDOW_S))


class LaunchDisplay(SweepObserver):
    """Progress bars for ``launch``: the sweep, each running trial, and each device.

    Args:
        console: Where to draw.
    """

    def __init__(self, console: Console) -> None:
        # Counts and times keep their width (never "0…"); a narrow console (80 columns when
        # piped) gets a short bar, and the info text wraps rather than squeezing the rest.
        narrow = console.width < 120
        self.progress = Progress(
            TextColumn("{task.description}", markup=False, table_column=Column(no_wrap=True)),
            BarColumn(bar_width=10 if narrow else 40),
            MofNCompleteColumn(table_column=Column(no_wrap=True, justify="right")),
            TextColumn("{task.fields[info]}", markup=False,
                       table_column=Column(ratio=1, overflow="fold")),
            TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
            TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=7)),
            console=console, transient=False, speed_estimate_period=300.0, expand=narrow,
        )
        self._lock = threading.Lock()
        self.sweep_task: TaskID | None = None
        self.num_done = 0  # trials of the sweep finished (before and during this launch)
        self.trial_fraction: dict[int, float] = {}  # share of its steps each running trial did
        self.trial_tasks: dict[int, TaskID] = {}
        self.trial_devices: dict[int, str] = {}
        self.eval_text: dict[int, str] = {}
        self.first_ppl: dict[int, tuple[int, float]] = {}  # (step, perplexity)
        self.last_ppl: dict[int, float] = {}
        self.devices: dict[str, _Device] = {}
        self.sharded_jobs: set[str] = set()  # jobs that ran a forward task: more than one shard

    def message(self, text: str) -> None:  # noqa: D102
        self.progress.console.print(f"[dim]{escape(text)}[/]", highlight=False)

    def sweep_started(self, name: str, n_trials: int, n_finished: int) -> None:  # noqa: D102
        self.progress.start()
        self.num_done = n_finished
        self.sweep_task = self.progress.add_task(f"sweep {name}", total=n_trials,
                                                 completed=n_finished, info=self._sweep_info())

    def trial_started(self, number: int, params: dict[str, Any], total_steps: int,
                      device: str, num_shards: int = 1) -> None:
        """A trial's bar; a trial that fits its device shows that device's bar from its start."""
        shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={_shown(v)}" for k, v in params.items())
        where = f"on {device}" if num_shards == 1 else f"spilled into {num_shards} shards"
        self.progress.console.print(f"trial {number} {where}: {shown}", markup=False,
                                    highlight=False)
        with self._lock:
            self.trial_tasks[number] = self.progress.add_task(
                f"  trial {number}", total=total_steps, info="")
            self.eval_text[number] = ""
        if num_shards == 1:  # its step tasks run there: the device's bar follows its steps
            self._ensure_device(device)
            with self._lock:
                self.trial_devices[number] = device

    def trial_step(self, number: int, event: StepEvent) -> None:  # noqa: D102
        with self._lock:
            task = self.trial_tasks.get(number)
            eval_text = self.eval_text.get(number, "")
        if task is None:
            return
        self.progress.update(
            task, completed=event.step,
            info=f"loss {event.train_loss:.3f}  {event.tokens_per_s:,.0f} tok/s{eval_text}")
        if event.total_steps:
            with self._lock:
                self.trial_fraction[number] = min(1.0, event.step / event.total_steps)
            self._show_sweep()
        if number in self.trial_devices:
            self._show_device(event.device)

    def trial_evaluated(self, number: int, event: EvalEvent) -> None:  # noqa: D102
        with self._lock:
            self.eval_text[number] = f"  eval ppl {event.eval_perplexity:,.1f}"
            self.first_ppl.setdefault(number, (event.step, event.eval_perplexity))
            self.last_ppl[number] = event.eval_perplexity

    def trial_finished(self, number: int, state: str, objective: float | None,
                       reason: str | None) -> None:
        """One line with the trial's outcome; its bar leaves."""
        colour = {"COMPLETE": "green", "PRUNED": "yellow", "FAIL": "red"}.get(state, "white")
        detail = f" objective {objective:.4f}" if objective is not None else ""
        with self._lock:
            if number in self.first_ppl:  # a resumed trial's first evaluation is past step 0
                first_step, first_ppl = self.first_ppl[number]
                detail += (f", eval ppl {first_ppl:,.1f} at step {first_step} -> "
                           f"{self.last_ppl[number]:,.1f}")
            task = self.trial_tasks.pop(number, None)
            self.trial_devices.pop(number, None)
        detail += f" ({reason})" if reason else ""
        self.progress.console.print(f"trial {number} [{colour}]{state}[/]{escape(detail)}",
                                    highlight=False)
        if task is not None:
            self.progress.remove_task(task)
        with self._lock:
            self.trial_fraction.pop(number, None)
            self.num_done += state in ("COMPLETE", "PRUNED")
        self._show_sweep()

    def _show_sweep(self) -> None:
        """The sweep's bar counts running trials by the share of their steps done.

        So the bar, and the time remaining rich estimates from its speed, move with every step
        rather than only when a trial ends.
        """
        if self.sweep_task is None:
            return
        with self._lock:
            completed = self.num_done + sum(self.trial_fraction.values())
        self.progress.update(self.sweep_task, completed=completed, info=self._sweep_info())

    def _sweep_info(self) -> str:
        """The sweep bar's text: trials finished and running now."""
        with self._lock:
            return f"{self.num_done} finished, {len(self.trial_tasks)} running"

    def task_finished(self, record: TaskRecord) -> None:
        """A device finished a shard task: its utilization, swap and p2p bytes, current job."""
        device = self._ensure_device(record.device)
        with self._lock:
            device.intervals.append((record.start_s, record.end_s))
            for name in device.totals:
                device.totals[name] += getattr(record, name)
            if record.kind == "measure":  # a fusion measurement: it has no shards to name
                device.current = f"{record.job} measuring fusion"
            elif record.kind == "pipeline":
                device.current = f"{record.job} pipelined from shard {record.shard}"
            elif record.kind == "backward" and record.job not in self.sharded_jobs:
                # a job of one shard (it fits its device): one such task per optimizer step
                device.current = f"{record.job} step {record.step + 1}"
            else:
                if record.kind == "forward":
                    self.sharded_jobs.add(record.job)
                device.current = f"{record.job} {record.kind} shard {record.shard}"
        self._show_device(record.device)

    def _ensure_device(self, name: str) -> _Device:
        with self._lock:
            device = self.devices.get(name)
            if device is None:
                task = self.progress.add_task(f"  {name} busy %", total=100, info="")
                device = self.devices[name] = _Device(task)
            return device

    def _show_device(self, name: str) -> None:
        with self._lock:
            device = self.devices[name]
            utilization = device.utilization(time.time())
            info = device.current
            for stat in _DEVICE_TOTALS:
                if device.totals[stat.name]:
                    info += f"  {stat.label} {_format_bytes(device.totals[stat.name])}"
        self.progress.update(device.task, completed=round(100 * utilization), info=info)

    def stop(self) -> None:
        """Stop drawing (the bars stay on screen)."""
        self.progress.stop()
