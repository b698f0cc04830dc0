"""Planning: layer profiles, shard partitions, pipeline packs, memory plans, fusion degrees.

Import a name from the module that defines it:

- ``profile``: per-layer profiles (``LayerProfile``, ``ModelProfile``, ``profile_model``);
  ``attention``: the attention kernel a profile traces; ``timing``: FLOPs and copy rates.
- ``plans``: ``JobPlan``, ``ShardPlan``, ``LayerTooLargeError``, ``KeyedCache``.
- ``partition``: ``plan_job`` and the plan cache; ``packing``: Harmony's balanced packing;
  ``pilot``: Hydra's pilot pass; ``shard_costs``: the cost model both partitioners pack by.
- ``task_bytes``: the bytes each shard task moves; ``pipeline_plan``: pipeline packs.
- ``memplan``: mu-TWO's swap/recompute plans, over ``memtrace`` (one layer's trace),
  ``memprofile`` (a plan's shards traced), ``memsim`` (the simulator), ``memgreedy`` and
  ``memplan_milp`` (greedy and optimal decisions).
- ``fusion_degree``: how many trials of one architecture train as one fused array.
"""
