"""Scheduling: SHARP's Sharded-LRTF and baselines, pipelined mode, the simulator, exact makespans.

Pure Python, no torch. Import a name from the module that defines it:

- ``chains``: ``JobSpec``, ``TaskSpec``, ``ShardKey``, ``TaskKind``.
- ``scheduler``: the ``Policy`` interface; ``residency``: the residency cache's rule.
- ``policies``: ``ShardedLRTF`` and the baselines, ``policy_names``.
- ``pipeline``: pipelined mode's steps and shapes.
- ``simulate``: the simulator, given and measuring what ``sim_model`` declares;
  ``durations``: a real run's task seconds.
- ``optimal``: exact minimum makespans (MILP).
"""
