"""Data parallelism, three designs side by side.

- ``ps-sync`` / ``ps-async`` (``parameter_server.py``): a server holds the master weights and
  the optimizer; workers push gradients and pull weights, synchronously or not.
- ``dp-naive`` (``naive.py``): every rank all-reduces each gradient after backward.
- ``ddp`` (``ddp.py``, ``buckets.py``): gradients in buckets, each all-reduced from autograd
  hooks as soon as it is full, overlapping the rest of backward; ``no_sync`` accumulation.

``dlab.estimate.data_parallel`` has the bytes each moves; ``torch-ddp`` (``reference.py``) is
PyTorch's DistributedDataParallel, the peer in ``python -m dlab bench ddp``.
"""
from dlab.parallel.data_parallel import ddp, naive, parameter_server  # noqa: F401 - registers
