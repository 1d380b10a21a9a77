"""The planner: memory, step time and MFU of any layout of any transformer on any cluster,
a search over layouts, and checks of both against runs here and results published at scale.

    from dlab.theory.plan import plan, search, PlanLayout, models, clusters
    p = plan(models.preset("llama3-70b"), clusters.preset("h100-sxm"),
             PlanLayout(dp=16, tp=8, pp=8, zero=1, sequence_parallel=True, micro_batch=1), 1024, 8192)

``spec`` (the model), ``cluster`` (and its ``kernels`` and ``collectives``), ``stacks``, ``layout``,
``memory``, ``ops`` and ``time`` (a GPU step), ``cpu`` (the lab's CPU), ``predict``, ``ranges``,
``search``, ``rows`` and ``published``: one subject each.
"""
from dlab.theory.plan import cluster as clusters
from dlab.theory.plan import spec as models
from dlab.theory.plan import stacks
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.predict import PlanError, Prediction, plan

__all__ = ["PlanError", "PlanLayout", "Prediction", "clusters", "models", "plan", "stacks"]
