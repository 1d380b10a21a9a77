"""The planner's public face: ``from dlab.plan import plan, search, PlanLayout, models, clusters``.

It lives in ``dlab.theory.plan`` (the theory layer: formulas and the planner, each formula
once); this module names what a notebook or a script needs.
"""
from dlab.theory.plan import PlanError, PlanLayout, Prediction, clusters, models, plan, published, stacks
from dlab.theory.plan.ranges import step_range
from dlab.theory.plan.search import pareto, search

__all__ = ["PlanError", "PlanLayout", "Prediction", "clusters", "models", "pareto", "plan",
           "published", "search", "stacks", "step_range"]
