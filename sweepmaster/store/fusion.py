"""Fusion records: the fusion-degree cache (``sm_fusion_measurements``) and fused arrays.

``resources.fusion: auto`` measures, once per architecture key, device kind and budget, the
throughput and memory of K = 1, 2, 4, ... trials fused (mu-TWO's sub-array selection,
:mod:`~sweepmaster.runtime.planning.fusion_degree`). :class:`StoreFusionCache` is the store's
implementation of the runtime's :class:`~sweepmaster.runtime.planning.fusion_degree.FusionCache`:
one row per K, so every later launch, worker or ``sweepmaster plan`` reads the measurement instead
of measuring again. The table's unique constraint on ``(architecture_key, device_kind,
budget_bytes, num_members)`` makes saving idempotent and safe for writers in several processes:
the first measurement saved is kept.

:func:`record_fusion_group` writes the members of one fused array to ``sm_fusion_groups``
(what the dashboard's devices page lists), founders at array step 0 and, as the array refills,
each trial that joins it at the array step it joined; :func:`record_member_left` marks the step a
member left.

Example:
    >>> executor = Executor("cuda", fusion="auto",
    ...                     fusion_cache=StoreFusionCache(engine))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy.exc
from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Engine

from sweepmaster.errors import StorageError
from sweepmaster.runtime.planning.fusion_degree import FusionMeasurement
from sweepmaster.store.cache_counts import CacheCounts
from sweepmaster.store.engine import first_line
from sweepmaster.store.models import FusionGroupMember, FusionMeasurementRecord, utcnow

__all__ = [
    "FusionGroupRecorder",
    "StoreFusionCache",
    "count_fusion_measurements",
    "fusion_groups",
    "load_fusion_measurements",
    "record_fusion_group",
    "record_member_left",
    "save_fusion_measurements",
]


def load_fusion_measurements(
    engine: Engine, key: str, budget_bytes: int, device_kind: str
) -> list[FusionMeasurement] | None:
    """Return the stored measurements of an entry in increasing K, or ``None``.

    ``step_seconds`` is not stored: it is 0 in what this returns (the runtime recomputes it from
    the throughput, :func:`~sweepmaster.runtime.planning.fusion_degree.with_step_seconds`).

    Args:
        engine: An engine on a database at head (:func:`~sweepmaster.store.upgrade_to_head`).
        key: The fusion key (:func:`~sweepmaster.runtime.planning.fusion_degree.fusion_cache_key`).
        budget_bytes: The budget measured under (bytes; 0 for the host CPU).
        device_kind: :func:`~sweepmaster.runtime.planning.partition.device_kind` of the device.

    Raises:
        StorageError: The database cannot be read.
    """
    r = FusionMeasurementRecord
    query = (
        select(r.num_members, r.trials_tokens_per_s, r.peak_bytes, r.fits)
        .where(r.architecture_key == key, r.budget_bytes == budget_bytes,
               r.device_kind == device_kind)
        .order_by(r.num_members)
    )
    try:
        with engine.connect() as connection:
            rows = connection.execute(query).all()
    except sqlalchemy.exc.DBAPIError as err:
        raise StorageError(f"cannot read the fusion cache: {first_line(err)}") from err
    if not rows:
        return None
    return [
        FusionMeasurement(int(k), float(rate or 0.0), int(peak or 0), bool(fits), 0.0)
        for k, rate, peak, fits in rows
    ]


def save_fusion_measurements(
    engine: Engine,
    key: str,
    budget_bytes: int,
    device_kind: str,
    measurements: Sequence[FusionMeasurement],
) -> bool:
    """Store the measurements of an entry (one row per K) unless it has some already.

    All rows go in one transaction; two processes saving the same entry at once leave one
    measurement, and neither raises.

    Args:
        engine: An engine on a database at head.
        key: The fusion key (at most 64 characters).
        budget_bytes: The budget measured under (bytes; 0 for the host CPU).
        device_kind: The device kind (at most 32 characters).
        measurements: One per K.

    Returns:
        Whether this call wrote the rows (``False``: the entry existed; it is kept).

    Raises:
        StorageError: The database rejected the write for another reason.
    """
    if not measurements:
        return False
    now = utcnow()
    rows = [
        {"architecture_key": key, "device_kind": device_kind, "budget_bytes": budget_bytes,
         "num_members": m.k, "trials_tokens_per_s": m.trials_tokens_per_s,
         "peak_bytes": m.peak_bytes, "fits": m.fits, "created_at": now}
        for m in measurements
    ]
    try:
        with engine.begin() as connection:
            connection.execute(insert(FusionMeasurementRecord), rows)
    except sqlalchemy.exc.IntegrityError:
        return False  # the unique constraint: another writer saved this entry first
    except sqlalchemy.exc.DBAPIError as err:
        raise StorageError(f"cannot write the fusion cache: {first_line(err)}") from err
    return True


def count_fusion_measurements(engine: Engine) -> int:
    """Number of stored measurement rows (one per entry and K)."""
    with engine.connect() as connection:
        query = select(func.count()).select_from(FusionMeasurementRecord)
        return int(connection.execute(query).scalar_one())


class StoreFusionCache:
    """The fusion-degree cache in the table ``sm_fusion_measurements``.

    It implements :class:`~sweepmaster.runtime.planning.fusion_degree.FusionCache`.

    Thread-safe (each call is its own transaction) and safe across processes (see
    :func:`save_fusion_measurements`).

    Args:
        engine: An engine on a database at head.

    Attributes:
        counts: Its :meth:`get` calls that returned measurements (hits) or ``None`` (misses),
            and its :meth:`put` calls that wrote rows (saved).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.counts = CacheCounts()

    def get(
        self, key: str, budget_bytes: int, device_kind: str
    ) -> list[FusionMeasurement] | None:
        """Return the measurements of an entry (``step_seconds`` 0), or ``None``.

        Raises:
            StorageError: The database cannot be read.
        """
        found = load_fusion_measurements(self._engine, key, budget_bytes, device_kind)
        self.counts.count_read(found is not None)
        return found

    def put(
        self,
        key: str,
        budget_bytes: int,
        device_kind: str,
        measurements: Sequence[FusionMeasurement],
    ) -> None:
        """Store the measurements of an entry; an existing entry is kept.

        Raises:
            StorageError: The database rejected the write.
        """
        self.counts.count_write(save_fusion_measurements(
            self._engine, key, budget_bytes, device_kind, measurements))


def record_fusion_group(
    engine: Engine, sweep_id: int, job: str, architecture_key: str, trial_numbers: Sequence[int],
    joined_step: int = 0,
) -> None:
    """Record members of one fused array (one ``sm_fusion_groups`` row per member trial).

    Args:
        engine: The store's engine.
        sweep_id: The sweep the trials belong to.
        job: The array's job name (as in ``sm_task_events``; at most 128 characters).
        architecture_key: The members' architecture key.
        trial_numbers: The member trials.
        joined_step: The array's steps when they joined it: 0 for its founding members, later
            for trials that refill it.

    Raises:
        StorageError: The database rejected the write (nothing is written).
    """
    rows = [{"sweep_id": sweep_id, "job": job, "architecture_key": architecture_key,
             "trial_number": number, "joined_step": joined_step} for number in trial_numbers]
    try:
        with engine.begin() as connection:
            connection.execute(insert(FusionGroupMember), rows)
    except sqlalchemy.exc.DBAPIError as err:
        raise StorageError(f"cannot record fused array {job!r}: {first_line(err)}") from err


def record_member_left(
    engine: Engine, sweep_id: int, job: str, trial_number: int, left_step: int
) -> None:
    """Record the array step at which a member trial left its fused array.

    Args:
        engine: The store's engine.
        sweep_id: The sweep.
        job: The array's job name.
        trial_number: The member.
        left_step: The array's steps when it left (finished, pruned or failed).

    Raises:
        StorageError: The database rejected the write.
    """
    m = FusionGroupMember
    query = (update(m).where(m.sweep_id == sweep_id, m.job == job, m.trial_number == trial_number)
             .values(left_step=left_step))
    try:
        with engine.begin() as connection:
            connection.execute(query)
    except sqlalchemy.exc.DBAPIError as err:
        raise StorageError(f"cannot record trial {trial_number} leaving fused array {job!r}: "
                           f"{first_line(err)}") from err


class FusionGroupRecorder:
    """Records one sweep's fused arrays as they form, refill and empty (``sm_fusion_groups``).

    What a launch records members through (:class:`~sweepmaster.sweep.launch.GroupSink`).
    Thread-safe: each call is its own transaction.

    Args:
        engine: The store's engine, on a database at head.
        sweep_id: The sweep.
    """

    def __init__(self, engine: Engine, sweep_id: int) -> None:
        self._engine = engine
        self._sweep_id = sweep_id

    def joined(self, job: str, architecture_key: str, trial_numbers: Sequence[int],
               joined_step: int) -> None:
        """Trials joined array ``job`` at its step ``joined_step`` (:func:`record_fusion_group`).

        Raises:
            StorageError: The database rejected the write.
        """
        record_fusion_group(self._engine, self._sweep_id, job, architecture_key, trial_numbers,
                            joined_step)

    def left(self, job: str, trial_number: int, left_step: int) -> None:
        """A trial left array ``job`` at its step ``left_step`` (:func:`record_member_left`).

        Raises:
            StorageError: The database rejected the write.
        """
        record_member_left(self._engine, self._sweep_id, job, trial_number, left_step)


def fusion_groups(engine: Engine, sweep_id: int) -> dict[str, list[int]]:
    """A sweep's fused arrays: job name -> member trial numbers (ascending), in job order."""
    m = FusionGroupMember
    query = (select(m.job, m.trial_number).where(m.sweep_id == sweep_id)
             .order_by(m.job, m.trial_number))
    groups: dict[str, list[int]] = {}
    with engine.connect() as connection:
        for job, number in connection.execute(query):
            groups.setdefault(str(job), []).append(int(number))
    return groups
