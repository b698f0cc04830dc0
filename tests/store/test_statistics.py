"""The statistics tables: one declaration, from which columns, rows, exports and views derive."""

from __future__ import annotations

import dataclasses

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from sweepmaster.dashboard.schemas import DeviceLane, TaskSpan
from sweepmaster.runtime.events import (
    TASK_STATISTICS,
    TRIAL_STATISTICS,
    TaskRecord,
    TrialStatistics,
    statistic,
    statistics_table,
)
from sweepmaster.store import TrialProgressRow, create_store_engine, upgrade_to_head
from sweepmaster.store.models import ALEMBIC_VERSION_TABLE, Base, TaskEvent, TrialProgress
from sweepmaster.store.progress import DEVICE_STATS
from sweepmaster.sweep.export import CSV_COLUMNS
from sweepmaster.sweep.results import TrialRow
from sweepmaster.workload.spec import TrainResult


def test_a_statistic_row_comes_from_its_field() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Stats:
        moved_bytes: int = statistic(0, unit="bytes", aggregate="sum", label="moved",
                                     added_in="0099", description="Bytes moved.")
        num_misses: int | None = statistic(None, unit="count", aggregate="max",
                                           description="Misses, where counted.")

    moved, misses = statistics_table(Stats)
    assert (moved.name, moved.unit, moved.label, moved.nullable, moved.optional) == (
        "moved_bytes", "bytes", "moved", False, True)
    assert (misses.name, misses.nullable, misses.label, misses.column_name) == (
        "num_misses", True, None, "num_misses")


def test_every_record_of_a_trial_carries_every_trial_statistic() -> None:
    names = [stat.name for stat in TRIAL_STATISTICS]
    assert [f.name for f in dataclasses.fields(TrialStatistics)] == names
    for record in (TrialProgressRow, TrialRow):
        assert set(names) <= {f.name for f in dataclasses.fields(record)}
    assert DEVICE_STATS == tuple(names)
    # launch copies every statistic but the plan's shard count from the trainer's result
    result_fields = {f.name for f in dataclasses.fields(TrainResult)}
    assert set(names) - result_fields == {"num_shards"}
    # the CSV writes them together, in the table's order
    start = CSV_COLUMNS.index(names[0])
    assert list(CSV_COLUMNS[start:start + len(names)]) == names


def test_each_statistic_has_its_column() -> None:
    for model, table in ((TrialProgress, TRIAL_STATISTICS), (TaskEvent, TASK_STATISTICS)):
        columns = model.__table__.c
        for stat in table:
            column = columns[stat.column_name]
            wide = isinstance(column.type, sa.BigInteger)
            assert wide == (stat.unit == "bytes") and column.nullable == stat.nullable
            assert (column.server_default is not None) == (
                stat.added_in is not None and not stat.nullable)
    assert {f.name for f in dataclasses.fields(TaskRecord)} >= {s.name for s in TASK_STATISTICS}


def test_the_timeline_models_show_the_summed_task_statistics() -> None:
    summed = [stat for stat in TASK_STATISTICS if stat.aggregate == "sum"]
    assert [s.column_name for s in summed] == ["bytes", "p2p_bytes"]
    assert {s.column_name for s in summed} <= set(TaskSpan.model_fields)
    assert {s.name for s in summed} <= set(DeviceLane.model_fields)
    assert TaskSpan.model_fields["p2p_bytes"].description == summed[1].description
    assert TaskSpan.model_fields["bytes"].is_required()
    assert not TaskSpan.model_fields["p2p_bytes"].is_required()


def test_the_columns_are_those_the_migrations_make_server_defaults_included(
        sqlite_url: str) -> None:
    upgrade_to_head(sqlite_url)
    engine = create_store_engine(sqlite_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={
                "include_name": lambda name, type_, parents: (
                    type_ != "table" or (name or "").startswith("sm_")),
                "version_table": ALEMBIC_VERSION_TABLE,
                "compare_server_default": True,
            })
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()
