"""Data parallelism, its designs side by side.

- ``ps-sync`` / ``ps-async`` (``parameter_server.py``): a server holds the master weights and
  the optimizer; workers push gradients and pull weights, synchronously or not.
- ``ps-backup`` (``backup_workers.py``): synchronous with backup workers (the first N - b
  gradients of each step); ``ps-downpour`` (``downpour.py``): each gradient applied as it lands.
- ``dp-naive`` (``naive.py``): every rank all-reduces each gradient after backward.
- ``ddp`` (``ddp.py``, ``buckets.py``): gradients in buckets, each all-reduced from autograd
  hooks as soon as it is full, overlapping the rest of backward; ``no_sync`` accumulation.
- ``local-sgd`` (``local_sgd.py``): inner steps with no communication, the replicas averaged
  (Local SGD) or moved by an outer Nesterov step (DiLoCo) every H steps; bytes in
  ``dlab.theory.local_sgd``; ``torch-local-sgd`` is PyTorch's ``PeriodicModelAverager``.

``dlab.theory.data_parallel`` has the bytes each moves; ``torch-ddp`` (``reference.py``) is
PyTorch's DistributedDataParallel, the peer in ``python -m dlab bench ddp``.
"""
