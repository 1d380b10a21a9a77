"""dlab: a Jupyter-first lab for distributed training.

    import dlab
    run = dlab.launch("torch-ddp", world_size=4, steps=20, wait=True)
    run.summary()
"""
from dlab.analysis.diagnose import RunFailed
from dlab.core.config import ConfigError, RunConfig
from dlab.procs.launch import launch
from dlab.procs.run import Run, attach
from dlab.procs.spawn import spawn
from dlab.ui.plots import compare as compare  # re-export; matplotlib loads on first call
from dlab.worker.validate import validate

__version__ = "0.1.0"

__all__ = ["ConfigError", "Run", "RunConfig", "RunFailed", "attach", "compare", "launch", "spawn",
           "validate"]


def load_ipython_extension(ipython) -> None:
    """``%load_ext dlab``: registers the ``%%distributed`` cell magic."""
    from dlab.tools.magic import register_magics  # IPython, a lab extra: loaded by %load_ext only
    register_magics(ipython)
