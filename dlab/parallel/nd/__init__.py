"""Every parallel dimension on one mesh: ``sharding.py`` (data parallelism with ZeRO 0-3 under
micro-batches), ``strategy.py`` (``nd``); the layout, its order and its rules are
``dlab.layout``."""
