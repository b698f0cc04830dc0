"""Training: plain, spilled, pipelined and fused trainers, layers, swap, replay, checkpoints.

Import a name from the module that defines it:

- ``plain``: ``train_plain``, the reference every other path reproduces; ``optimizers``: the
  table of optimizers.
- ``spill`` / ``fused_spill``: spilled jobs of one member / of K stacked members, both run by
  ``chain`` over the parts built in ``job_parts`` (``shard_store``, ``boundaries``, ``compute``,
  ``planned``, ``bookkeeping``, ``member_runs``, ``tasks``); flat shard buffers in ``flat``.
- ``fused_*`` and ``members``: stacked shards, their members, memory plans, optimizers and noise.
- ``pipelined`` and ``pipeline_*``: Harmony's pipeline over several devices.
- ``layers``: a model as a list of layers; ``layerpass``: their passes under a memory plan;
  ``swap``: saved activations between device and host; ``replay`` and ``member_dropout``:
  dropout replay; ``checkpoint``: crash-safe training state.
"""
