"""Execution: the shard executor's jobs, their plans, its device workers and their shared state.

Import a name from the module that defines it:

- ``job_plans``: ``PlanSettings`` and the plans an executor gives its jobs.
- ``jobs``: ``ExecutorJob``, ``SpilledRun``, ``TaskSink``; ``fused_jobs``: fused arrays and
  the measurement of fusion degrees.
- ``policy_chain``: a job's chain of shard tasks for the policy (``shard_chain``).
- ``device_workers``: one thread per device running shard tasks (``DeviceWorkers``).
- ``state``: what the executor and its workers share (``ExecutorState``, ``JobCancelledError``).
- ``replan`` and ``attempts``: re-planning a job that ran out of memory, and its progress across
  attempts.
"""
