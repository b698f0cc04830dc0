"""Training: plain and the one spilled trainer (its parts, one member or K), layers, checkpoints.

Import a name from the module that defines it:

- ``plain``: ``train_plain``, the reference every other path reproduces; ``optimizers``: the
  table of optimizers.
- ``shard_trainer``: ``ShardTrainer``, the one trainer every spilled job runs, holding its parts:
  ``shard_members`` (the members protocol: one module in ``spill``, K stacked members in
  ``fused_spill``), ``boundaries``, ``planned``, ``tasks``, ``shard_store`` (with ``host_update``,
  the optimizer step on the host), ``compute``, ``bookkeeping`` over ``member_runs``; flat
  shard buffers in ``flat``.
- ``fused_*`` and ``members``: stacked shards, their members, memory plans, optimizers and noise.
- ``pipelined`` and ``pipeline_*``: Harmony's pipeline over several devices.
- ``layers``: a model as a list of layers; ``layerpass``: their passes under a memory plan;
  ``swap``: saved activations between device and host; ``replay`` and ``member_dropout``:
  dropout replay; ``training_state``: crash-safe training state.
"""
