"""Every scheduling policy, for the suites each of them runs, and task chains to give them.

A test that every policy must pass takes ``cls`` and is decorated ``@each_policy()``; a new
policy in :func:`policy_names` joins every such suite by itself.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sweepmaster.runtime.scheduling.chains import JobSpec, TaskSpec
from sweepmaster.runtime.scheduling.policies import policy_names
from sweepmaster.runtime.scheduling.scheduler import Policy

__all__ = ["POLICIES", "chain", "each_policy"]

POLICIES: dict[str, type[Policy]] = policy_names()
"""Every policy class by its name: the executor's and the simulator's choices."""


def each_policy(but: tuple[type[Policy], ...] = ()) -> pytest.MarkDecorator:
    """Parametrize a test's ``cls`` by every policy class but ``but``; ids are their names."""
    names = [name for name, cls in POLICIES.items() if cls not in but]
    return pytest.mark.parametrize("cls", [POLICIES[name] for name in names], ids=names)


def chain(job_id: str, *seconds: float, num_steps: int = 1,
          shard_of: Callable[[int], int] | None = None) -> JobSpec:
    """A job whose step is one forward task per entry of ``seconds`` on shards 0, 1, ...

    ``shard_of`` maps a task's index to its shard instead; each task moves no bytes.
    """
    tasks = tuple(TaskSpec(job_id, i, i if shard_of is None else shard_of(i), "forward", s, 0, 0)
                  for i, s in enumerate(seconds))
    return JobSpec(job_id, tasks, num_steps)
