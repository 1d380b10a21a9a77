"""Every parallel dimension on one mesh: ``layout.py`` (degrees, order, checks),
``sharding.py`` (data parallelism with ZeRO 0-3 under micro-batches), ``strategy.py`` (``nd``)."""
from dlab.parallel.nd import strategy  # noqa: F401 - registers the strategy
