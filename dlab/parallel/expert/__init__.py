"""Expert parallelism: the experts of a mixture-of-experts model spread over ranks."""
from dlab.parallel.expert import strategy  # noqa: F401 - registers the strategy
