"""A layout on paper: how a run arranges its ranks, before any process or tensor exists.

``Layout`` (``layout.py``: degrees, order, the one set of rules), ``ranks`` (which ranks form
each group), ``schedules`` (a pipeline's action lists), ``stages`` (which blocks each stage
holds), ``tokens`` (which positions each context-parallel rank holds). The strategies build
process groups and models from these; the formulas and the planner reason about them.
"""
from dlab.layout.layout import CP, CP_ATTENTION, DP, EP, MESH_ORDER, PP, SCHEDULES, TP, Layout, Shape, shape

__all__ = ["CP", "CP_ATTENTION", "DP", "EP", "MESH_ORDER", "PP", "SCHEDULES", "TP", "Layout", "Shape",
           "shape"]
