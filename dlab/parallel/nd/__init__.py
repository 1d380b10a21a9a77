"""Every parallel dimension on one mesh: ``compose.py`` (one step per dimension, in order),
``sharding.py`` (data parallelism with ZeRO 0-3 under micro-batches), ``state.py`` (checkpoint
pieces), ``strategy.py`` (``nd``), ``pipelines.py`` (the ``pipeline-*`` presets); the layout,
its order and its rules are ``dlab.layout``."""
