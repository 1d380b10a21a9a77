"""The analytic model: what theory predicts for a configuration, to set beside what was measured.

One module per subject: ``comm`` (alpha-beta cost of collectives), ``memory`` (model state per
rank), ``data_parallel``, ``pipeline`` (bubble, activations in flight), ``tensor``, ``context``,
``expert`` and ``hybrid`` (3D: DP x PP x TP): bytes moved and memory of each family;
``activations`` (what the GPT saves for backward, with and without recomputation).
"""
