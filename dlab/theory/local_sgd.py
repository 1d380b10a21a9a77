"""What Local SGD and DiLoCo move: one all-reduce of the parameters every H steps.

Notation as ``dlab.theory.data_parallel``: P bytes of parameters (fp32), N ranks, bytes per
rank counted in the ring convention (sent = received = 2 (N-1)/N * S for an all-reduce of S).

Both strategies sync after every H local steps and after the run's last step (so the replicas
end equal); Local SGD all-reduces the parameters, DiLoCo the outer gradient, both P bytes:

    sync step       sent = received = 2 (N-1)/N * P     (what ``ddp`` moves on every step)
    other steps     0
    over S steps    2 (N-1)/N * P * ceil(S / H) / S     -> ddp's bytes / H for S a multiple of H

(Stich 2019; Lin et al. 2020; Douillard et al. 2023, who report 500x less communication at
H = 500.) Not counted, as in every strategy: the loop's 4-byte all-reduce of the logged loss.
"""
from __future__ import annotations

import math

from dlab.theory.data_parallel import allreduce_bytes


def sync_steps(steps: int, sync_every: int) -> list[int]:
    """The steps (0-based) after which the replicas sync: every H-th, and the last."""
    return sorted({*range(sync_every - 1, steps, sync_every), steps - 1})


def bytes_per_step(param_bytes: float, world_size: int, sync_every: int, step: int, steps: int
                   ) -> dict[str, float]:
    """``{"sent": ..., "recv": ...}`` for one rank on step ``step`` of a run of ``steps``."""
    b = allreduce_bytes(param_bytes, world_size) if step in sync_steps(steps, sync_every) else 0.0
    return {"sent": b, "recv": b}


def mean_bytes_per_step(param_bytes: float, world_size: int, sync_every: int, steps: int) -> float:
    """Bytes one rank sends per step averaged over a run: ddp's, times ceil(S / H) / S."""
    return allreduce_bytes(param_bytes, world_size) * math.ceil(steps / sync_every) / steps
