"""What other records tell about some trials: the devices each ran on, and their retries.

``status`` and the dashboard show these beside each trial; they come from the device timeline
(``sm_task_events``, ``sm_fusion_groups``) and Optuna's attributes of retried trials.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import and_, select
from sqlalchemy.engine import Engine

from sweepmaster.store import optuna_tables as ot
from sweepmaster.store.models import FusionGroupMember
from sweepmaster.store.models import TaskEvent as TaskEventRow

__all__ = [
    "TrialLinks",
    "trial_links",
]


@dataclass(frozen=True)
class TrialLinks:
    """What other records tell about some trials: the devices each ran on, and their retries.

    Attributes:
        devices: Per trial number, every device that ran one of its tasks (its own, or those of
            the fused array it was a member of), sorted; trials without tasks are absent.
        retried_by: Per trial number, the trial that runs it again after it was interrupted
            (sweepmaster's ``retry_of`` user attribute, or of a heartbeat retry the last
            entry of Optuna's ``retry_history`` system attribute, else its ``failed_trial``:
            a retry that was itself retried links to its own retry, not the series' first).
    """

    devices: dict[int, tuple[str, ...]]
    retried_by: dict[int, int]


#: Attributes naming the trial a retry repeats, the most direct last: (table, key).
_RETRY_ATTRS = ((ot.user_attrs, "retry_of"), (ot.system_attrs, "failed_trial"),
                (ot.system_attrs, "retry_history"))


def trial_links(
    engine: Engine, sweep_id: int, study_id: int, numbers: Sequence[int]
) -> TrialLinks:
    """Return the devices and the retries of the given trials.

    Args:
        engine: An engine on the sweep database.
        sweep_id: The sweep's ``id``.
        study_id: Its Optuna ``study_id``.
        numbers: Trial numbers.

    Returns:
        Their :class:`TrialLinks`.
    """
    wanted = set(numbers)
    devices: dict[int, set[str]] = {}
    retried_by: dict[int, int] = {}
    if not wanted:
        return TrialLinks({}, {})
    events, groups = TaskEventRow.__table__, FusionGroupMember.__table__
    e, g = events.c, groups.c
    with engine.connect() as connection:
        if ot.has_table(connection, TaskEventRow.__tablename__):
            own = select(e.trial_number, e.device).distinct().where(
                e.sweep_id == sweep_id, e.trial_number.in_(wanted))
            found = list(connection.execute(own))
            if ot.has_table(connection, FusionGroupMember.__tablename__):
                fused = select(g.trial_number, e.device).distinct().join(
                    groups, and_(g.sweep_id == e.sweep_id, g.job == e.job)
                ).where(e.sweep_id == sweep_id, g.trial_number.in_(wanted))
                found += list(connection.execute(fused))
            for number, device in found:
                devices.setdefault(number, set()).add(device)
        repeats: dict[int, int] = {}  # retry -> the trial it runs again (the most direct)
        for table, key in _RETRY_ATTRS:
            query = select(ot.trials.c.number, table.c.value_json).join(
                ot.trials, ot.trials.c.trial_id == table.c.trial_id
            ).where(ot.trials.c.study_id == study_id, table.c.key == key)
            for retry, value_json in connection.execute(query):
                try:
                    earlier = json.loads(value_json)
                except ValueError:
                    continue
                if isinstance(earlier, list) and earlier:  # retry_history: oldest first
                    earlier = earlier[-1]
                if isinstance(earlier, int) and earlier != retry:
                    repeats[retry] = earlier
        for retry, earlier in repeats.items():
            if earlier in wanted:
                retried_by[earlier] = min(retry, retried_by.get(earlier, retry))
    return TrialLinks({n: tuple(sorted(d)) for n, d in devices.items()}, retried_by)
