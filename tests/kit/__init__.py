"""What the test files share, in one place (imported as ``from tests.kit.<module> import ...``).

- :mod:`tests.kit.data`: where the text data and examples are (shared, else shipped).
- :mod:`tests.kit.sweeps`: tiny ``sweep.yaml`` files.
- :mod:`tests.kit.models`: tiny GPT-2 configs and random token blocks.
- :mod:`tests.kit.spill`: the tiny spilled job (3 layers, dropout, 4 shards), its optimizers,
  plans and the checks against plain training.
- :mod:`tests.kit.fused`: the tiny fused array's members and the checks of a fused run.
- :mod:`tests.kit.records`: the executor's task records, and their replay in simulated time.
- :mod:`tests.kit.storages`: storage URLs for SQLite and PostgreSQL (fixtures).
- :mod:`tests.kit.threads`: thread fixtures (one intra-op thread, descheduled copy threads).
- :mod:`tests.kit.hub`: a HuggingFace hub cache and server, offline.
- :mod:`tests.kit.tcp_proxy`: a TCP forwarder to cut a database off on demand.

Modules that import torch are imported only by the tests that train.
"""
