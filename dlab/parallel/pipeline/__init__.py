"""Pipeline parallelism: the model cut into stages by layers, micro-batches flowing through them
on a schedule written as data (naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V).

``schedules`` writes each rank's action list, ``simulate`` runs it on paper, ``executor`` runs
it on real ranks, ``strategy`` registers the ``pipeline-*`` strategies.
"""
from dlab.parallel.pipeline import strategy  # noqa: F401  (registers the pipeline-* strategies)
