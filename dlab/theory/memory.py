"""Memory per rank and bytes moved per step for data parallelism and the ZeRO stages.

Two levels, kept apart on purpose:

- ``paper_memory`` / ``paper_bytes_moved``: the ZeRO paper's formulas (Rajbhandari et al. 2020,
  sections 5 and 7) for Psi parameters, N ranks, K bytes of optimizer state per parameter:

      DDP      (2 + 2 + K) Psi        stage 1  (2 + 2) Psi + K Psi / N
      stage 2  2 Psi + (2 + K) Psi / N        stage 3  (2 + 2 + K) Psi / N

  with 2-byte (bf16/fp16) weights and gradients and K = 12 for mixed-precision Adam (fp32
  master weights 4 + momentum 4 + variance 4). Bytes moved per rank per step: 2 Psi x (N-1)/N
  for DDP, stages 1 and 2 (a reduce-scatter and an all-gather are one all-reduce), 3 Psi x
  (N-1)/N for stage 3 (parameters gathered for forward and again for backward).

- ``zero_memory`` / ``zero_bytes_moved``: what dlab's ``zero1/2/3`` hold and send, exactly:
  every unit padded to a multiple of N, one Adam step counter (a 4-byte tensor) per unit, the
  root unit gathered once per step in stage 3. The tests hold the measured figures to these to
  the byte; they differ from the paper's only by the padding, the counters and the root.

In fp32 (no mixed precision) weights and gradients are 4 bytes and the master weights are the
parameters themselves, so K = 8 (Adam) or 4 (SGD with momentum).
"""
from __future__ import annotations

from dataclasses import dataclass

from dlab import models
from dlab.comm import gloo
from dlab.core.precision import PRECISIONS

STAGES = (0, 1, 2, 3)


def _check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (0 is plain data parallelism), got {stage!r}")


def paper_memory(psi: float, world_size: int, stage: int, k: float = 12, weight_bytes: float = 2,
                 grad_bytes: float | None = None) -> dict[str, float]:
    """Bytes per rank by category, the ZeRO paper's accounting (no padding, no counters):
    stage >= 1 divides the optimizer state by N, >= 2 the gradients too, 3 the weights too.
    ``grad_bytes`` defaults to ``weight_bytes`` (Megatron's fp32 gradient buffer: 4)."""
    _check_stage(stage)
    n = world_size
    g = weight_bytes if grad_bytes is None else grad_bytes
    return {"parameters": weight_bytes * psi / (n if stage >= 3 else 1),
            "gradients": g * psi / (n if stage >= 2 else 1),
            "optimizer": k * psi / (n if stage >= 1 else 1)}


def paper_bytes_moved(psi: float, world_size: int, stage: int, weight_bytes: float = 2) -> float:
    """Bytes one rank sends per step (ring collectives): 2 or 3 times the parameters' bytes,
    times (N-1)/N."""
    _check_stage(stage)
    n = world_size
    return (3 if stage == 3 else 2) * (n - 1) / n * weight_bytes * psi


@dataclass
class Units:
    """Element counts of the flat units: the root (0 when the model has none) and the blocks."""
    root: int
    blocks: list[int]

    @property
    def all(self) -> list[int]:
        return ([self.root] if self.root else []) + list(self.blocks)

    @property
    def psi(self) -> int:
        return sum(self.all)


def gpt_units(cfg) -> Units:
    """Units of a ``GPTConfig``: token + position embeddings, final norm (+ untied head) in the
    root; one unit per block (the same count as ``GPTConfig.n_params``)."""
    d, f, v, t = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)
    root = v * d + t * d + 2 * d + (0 if cfg.tied else v * d)
    return Units(root, [block] * cfg.n_layer)


def mlp_units(cfg) -> Units:
    w = cfg.widths()
    return Units(0, [a * b + b for a, b in zip(w[:-1], w[1:], strict=True)])


def model_units(model: str, options: dict) -> Units:
    cfg = models.model_config(model, options)
    return gpt_units(cfg) if model == "gpt" else mlp_units(cfg)


def padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


def _owned_padding(numel: int, world_size: int, rank: int) -> int:
    """Padding elements inside rank ``rank``'s chunk of a unit of ``numel`` elements."""
    size = padded(numel, world_size)
    chunk = size // world_size
    lo, hi = rank * chunk, (rank + 1) * chunk
    return max(0, hi - max(lo, numel))


def _precision(mixed_precision: bool, optimizer: str) -> tuple[int, int]:
    """(bytes per weight or gradient element, optimizer bytes per owned element)."""
    state = 8 if optimizer == "adam" else 4  # Adam: momentum + variance; SGD: momentum
    return (2, state + 4) if mixed_precision else (4, state)  # + the fp32 master in bf16 runs


def zero_memory(units: list[int] | Units, world_size: int, stage: int, mixed_precision: bool = False,
                optimizer: str = "adam", rank: int = 0) -> dict[str, int]:
    """Bytes rank ``rank`` of dlab's ``zero{stage}`` holds between steps, by category, padding
    included; ``padding`` is the part of that total that is padding."""
    _check_stage(stage)
    if stage == 0:
        raise ValueError("dlab's ZeRO units start at stage 1; for DDP use ddp_memory")
    units = units.all if isinstance(units, Units) else list(units)
    n = world_size
    w, k = _precision(mixed_precision, optimizer)
    full = sum(padded(u, n) for u in units)
    chunk = full // n
    pad_full = full - sum(units)
    pad_own = sum(_owned_padding(u, n, rank) for u in units)
    counters = 4 * len(units) if optimizer == "adam" else 0
    return {
        "parameters": w * (chunk if stage == 3 else full),
        "gradients": w * (full if stage == 1 else chunk),
        "optimizer": k * chunk + counters,
        "padding": (w * (pad_own if stage == 3 else pad_full) + w * (pad_full if stage == 1 else pad_own)
                    + k * pad_own),
    }


def ddp_memory(param_numels: list[int], optimizer: str = "adam", precision: str = "fp32"
               ) -> dict[str, int]:
    """A full replica: weights, gradients, optimizer state (+ a step counter per tensor), at
    the bytes per parameter ``precision`` names (``dlab.core.precision``: in mixed precision
    the optimizer state holds the fp32 master too, and SGD keeps one moment where Adam keeps
    two)."""
    psi = sum(param_numels)
    prec = PRECISIONS[precision]
    k = prec.adam_bytes if optimizer == "adam" else prec.adam_bytes - 4
    counters = 4 * len(param_numels) if optimizer == "adam" else 0
    return {"parameters": prec.weight_bytes * psi, "gradients": prec.grad_bytes * psi,
            "optimizer": k * psi + counters}


def zero_bytes_moved(units: Units, world_size: int, stage: int, mixed_precision: bool = False) -> float:
    """Bytes one rank sends per step in dlab's ``zero{stage}`` (``torch-ddp`` for stage 0),
    under ``dlab.comm.instrumented``'s ring convention: a reduce-scatter or all-gather of S
    bytes sends (N-1)/N S. Stage 3 gathers each block twice and the root once."""
    _check_stage(stage)
    n = world_size
    w, _ = _precision(mixed_precision, "adam")
    ring = (n - 1) / n
    if stage == 0:
        return 2 * ring * 4 * units.psi
    total = 0.0
    for i, u in enumerate(units.all):
        is_root = bool(units.root) and i == 0
        gathers = 2 if stage == 3 and not is_root else 1
        total += ring * w * padded(u, n) * (1 + gathers)  # one reduce-scatter + the gathers
    return total


def zero_wire_bytes(units: Units, world_size: int, rank: int, stage: int,
                    reduce_scatter: str = "backend", mixed_precision: bool = False) -> int:
    """Bytes rank ``rank`` writes on Gloo per step in dlab's ``zero{stage}`` (the model of
    Gloo's real algorithms, ``dlab.comm.gloo``, framing included), for the gradient
    reduce-scatter by the backend (a whole all-reduce on Gloo: 2 (N-1)/N S) or by dlab's ring
    (``reduce_scatter="ring"``: (N-1)/N S), and the parameter all-gathers. The per-step record's
    ``wire_bytes`` measures it."""
    _check_stage(stage)
    n = world_size
    w, _ = _precision(mixed_precision, "adam")
    total = 0
    for i, u in enumerate(units.all):
        size = w * padded(u, n)
        gathers = 2 if stage == 3 and not (bool(units.root) and i == 0) else 1
        total += (gloo.ring_reduce_scatter_wire(size, n) if reduce_scatter == "ring"
                  else gloo.gloo_reduce_scatter_bytes(size, n, rank, w))
        total += gathers * gloo.gloo_all_gather_bytes(size, n)
    return total
