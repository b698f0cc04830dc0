"""Devices and their memory: CUDA GPUs and virtual devices, meters, budgets, the transfer engine.

Import a name from the module that defines it:

- ``device``: ``Device``, ``CudaDevice``, ``VirtualDevice``, ``parse_devices``,
  ``parse_size``, the executor's devices and their ``TransferStats``.
- ``settings``: the torch-free syntax of sizes, device specs and fusion modes.
- ``budget``: a CUDA device's measured budget and its headroom.
- ``meter``: memory meters (``CudaMeter``, ``VirtualMeter``) and ``format_bytes``.
- ``transfer``: the one transfer layer (``TransferEngine``, ``Transfer``, ``engine_for``).
- ``staging``: its pinned staging pool.
- ``host_syncs``: counting the calls that make the host wait for a GPU.
"""
