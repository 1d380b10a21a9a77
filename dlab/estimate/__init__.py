"""The analytic model: what theory predicts for a configuration, to set beside what was measured.

One module per subject: ``comm`` (alpha-beta cost of collectives), and, as the strategy
families arrive, memory, bubble and bytes-moved formulas of their own.
"""
