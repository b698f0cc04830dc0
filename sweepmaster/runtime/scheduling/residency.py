"""The residency cache's rule: which shards each device keeps between tasks (pure Python).

Hydra (Nagrecha & Kumar, 2022, https://arxiv.org/abs/2110.08633) keeps a shard on its device
between two tasks of it. :class:`Residency` is the one rule for which shards stay and which are
evicted to make room: the executor's residency cache follows it
(:mod:`~sweepmaster.runtime.execution.device_workers`), every
:class:`~sweepmaster.runtime.scheduling.scheduler.Policy` keeps its belief of what the devices
hold by it, and the simulator (:mod:`~sweepmaster.runtime.scheduling.simulate`) plays it.

Example:
    >>> from sweepmaster.runtime.scheduling.chains import JobSpec
    >>> residency = Residency([100.0])
    >>> task = JobSpec.from_shards("a", 1, [1.0], [1.0], [40], [40]).task(0)
    >>> residency.task_starts(0, task)
    []
    >>> residency.keys(0)
    [('a', 0)]
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from sweepmaster.runtime.scheduling.chains import ShardKey, TaskSpec

__all__ = ["PEAK_MARGIN", "Residency"]

#: Planned task peaks are estimates (within 15% of the metered peak,
#: tests/runtime/training/test_spill.py): a task needs this fraction of its planned peak free
#: beyond it, beside what other shards keep.
PEAK_MARGIN = 0.15


class Residency:
    """The residency cache: which shards each device keeps between tasks, and their bytes.

    One rule for the executor, the policies and the simulator (``(job_id, shard)`` keys):

    * after its task, a shard stays resident on its device when its job's next task is of the
      same shard (:meth:`stays`: Hydra's step boundary, a job of one shard), keeping its
      parameters there, and its optimizer state when that task updates it too
      (:meth:`task_ended`); what it changed is written back when it is evicted;
    * before a task of key ``k`` with planned peak ``P`` (bytes) runs on device ``d``, ``k`` is
      dropped from any other device (one copy) and the least recently used keys other than
      ``k`` are evicted from ``d`` until ``P * (1 + PEAK_MARGIN)`` plus their bytes fits ``d``'s
      capacity (:meth:`make_room`); a task whose peak is unknown (``None``) takes the device.

    So several jobs keep shards on one device at once while they fit beside the task that runs.
    Not thread-safe; a :class:`Policy` guards its own with its lock, the executor with its
    condition.

    Args:
        capacity_bytes: Per device, the bytes its tasks and kept shards share (the device
            budget; ``math.inf``: unbounded).

    Raises:
        ValueError: A capacity is not positive.
    """

    def __init__(self, capacity_bytes: Sequence[float]) -> None:
        if any(not capacity > 0 for capacity in capacity_bytes):
            raise ValueError(f"capacities must be positive, got {list(capacity_bytes)}")
        self.capacity_bytes = tuple(capacity_bytes)
        self._kept: list[OrderedDict[ShardKey, int]] = [OrderedDict() for _ in capacity_bytes]
        self._where: dict[ShardKey, int] = {}

    @staticmethod
    def stays(task: TaskSpec, following: TaskSpec | None) -> bool:
        """Whether ``task``'s shard stays resident after it.

        It does when ``following``, its job's next task (``None`` at the job's end), is of the
        same shard.
        """
        return following is not None and following.shard == task.shard

    def task_peak_bytes(self, device: int, task: TaskSpec) -> int | None:
        """The planned peak of ``task`` on ``device`` (bytes): what :meth:`make_room` is given.

        Its ``peak_bytes``, plus its ``state_bytes`` while ``device`` holds its shard (the
        optimizer state kept there sits beside the whole task); a state kept on another device
        goes home before the task and is promoted for its update only, within ``peak_bytes``.
        The one rule of the executor, the policies and the simulator. ``None``: unknown.
        """
        peak = task.peak_bytes
        if peak is not None and self.holds(device, (task.job_id, task.shard)):
            peak += task.state_bytes
        return peak

    def task_starts(self, device: int, task: TaskSpec) -> list[ShardKey]:
        """Make room on ``device`` for ``task`` (:meth:`make_room`) and hold its shard there.

        Room for its :meth:`task_peak_bytes`. The shard is held with its ``promote_bytes``
        (most recently used) until :meth:`task_ended`.

        Returns:
            The keys evicted from ``device``, least recently used first.
        """
        key = (task.job_id, task.shard)
        evicted = self.make_room(device, key, self.task_peak_bytes(device, task))
        self.keep(device, key, task.promote_bytes)
        return evicted

    def task_ended(self, device: int, task: TaskSpec, following: TaskSpec | None) -> int | None:
        """Keep or drop ``task``'s shard on ``device`` after it, by :meth:`stays`.

        A shard that stays is held (most recently used) with the bytes it keeps there: the
        task's ``kept_bytes`` (its optimizer state too, a job of one shard between its steps),
        else its ``promote_bytes``.

        Returns:
            The bytes the shard keeps on ``device``; ``None``: it does not stay.
        """
        key = (task.job_id, task.shard)
        if not self.stays(task, following):
            self.discard(device, key)
            return None
        num_bytes = task.promote_bytes if task.kept_bytes is None else task.kept_bytes
        self.keep(device, key, num_bytes)
        return num_bytes

    def holds(self, device: int, key: ShardKey) -> bool:
        """Whether ``device`` holds the shard ``key``."""
        return self._where.get(key) == device

    def keys(self, device: int) -> list[ShardKey]:
        """The shards ``device`` holds, least recently used first."""
        return list(self._kept[device])

    def kept_bytes(self, device: int, exclude: ShardKey | None = None) -> int:
        """Bytes the shards held on ``device`` keep there (``exclude``'s not counted)."""
        return sum(b for key, b in self._kept[device].items() if key != exclude)

    def make_room(self, device: int, key: ShardKey, peak_bytes: int | None) -> list[ShardKey]:
        """Make room on ``device`` for a task of ``key`` whose planned peak is ``peak_bytes``.

        ``key`` held on another device is dropped there (its task's job writes it back); on
        ``device`` the least recently used other keys are evicted until the task's peak (with
        :data:`PEAK_MARGIN`) and what the rest keep fit the capacity (``None``: every other).

        Returns:
            The keys evicted from ``device``, least recently used first.
        """
        other = self._where.get(key)
        if other is not None and other != device:
            self.discard(other, key)
        kept = self._kept[device]
        capacity = self.capacity_bytes[device]
        need = math.inf if peak_bytes is None else peak_bytes * (1 + PEAK_MARGIN)
        evicted = []
        for victim in list(kept):
            if need + self.kept_bytes(device, exclude=key) <= capacity:
                break
            if victim != key:
                self.discard(device, victim)
                evicted.append(victim)
        return evicted

    def keep(self, device: int, key: ShardKey, num_bytes: int) -> None:
        """Hold ``key`` on ``device`` (most recently used), keeping ``num_bytes`` there.

        A copy on another device is dropped (one copy per shard).
        """
        other = self._where.get(key)
        if other is not None and other != device:
            self.discard(other, key)
        kept = self._kept[device]
        kept[key] = num_bytes
        kept.move_to_end(key)
        self._where[key] = device

    def discard(self, device: int, key: ShardKey) -> None:
        """Forget ``key`` on ``device`` if it is held there."""
        if self._where.get(key) == device:
            del self._kept[device][key], self._where[key]

    def drop_job(self, job_id: str) -> None:
        """Forget every shard of ``job_id`` (the job left)."""
        for kept in self._kept:
            for key in [k for k in kept if k[0] == job_id]:
                del kept[key], self._where[key]
