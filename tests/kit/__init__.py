"""What the test files share, in one place: ``from tests.kit.<module> import ...``.

- :mod:`tests.kit.data`: where the text data and examples are (shared, else shipped).
- :mod:`tests.kit.sweeps`: tiny ``sweep.yaml`` files.
- :mod:`tests.kit.models`: tiny GPT-2 configs, random token blocks, byte units.
- :mod:`tests.kit.spill`: the tiny spilled job (3 layers, dropout, 4 shards), its optimizers,
  profile and plan, plain training's result, and the checks against it.
- :mod:`tests.kit.fused`: the tiny fused array's members and the checks of a fused run.
- :mod:`tests.kit.lora`: the tiny LoRA base and its token blocks.
- :mod:`tests.kit.callbacks`: callbacks that record a run and end it after a step.
- :mod:`tests.kit.records`: the executor's task records, and their replay in simulated time.
- :mod:`tests.kit.policies`: every scheduling policy (``@each_policy()``) and task chains.
- :mod:`tests.kit.caches`: the suite every plan and measurement cache passes; a dict double.
- :mod:`tests.kit.storages`: storage URLs for SQLite and PostgreSQL (fixtures).
- :mod:`tests.kit.threads`: thread fixtures, and threads started together.
- :mod:`tests.kit.hub`: a HuggingFace hub cache and server, offline.
- :mod:`tests.kit.tcp_proxy`: a TCP forwarder that cuts a database off on demand.

The fixtures of ``storages``, ``threads`` and ``caches`` are registered for every test by
``tests/conftest.py``. Modules that import torch are imported only by the tests that train.
"""
