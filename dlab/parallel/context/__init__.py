"""Context parallelism: the sequence split over ranks, attention computed across them."""
from dlab.parallel.context import strategy  # noqa: F401 - registers the strategies
