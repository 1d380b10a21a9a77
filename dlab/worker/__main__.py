"""``python -m dlab.worker``: the program every rank of a training run runs (``main``)."""
from dlab.worker.main import main

main()
