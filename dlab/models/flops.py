"""FLOPs per trained token of a decoder-only transformer, counted once for the runtime (the lab's
GPT, ``dlab.models.gpt.GPTConfig``) and for the planner (any model, ``dlab.theory.plan.spec``).

The convention is PaLM's (Chowdhery et al. 2022, app. B), the one MFU divides by:

    model FLOPs per token      6 N + 12 L d s

N the parameters one token is multiplied by (2 FLOPs each forward, 4 backward), L layers of
width d, and the attention core's scores and values, 2 d s each forward over all s keys (the
causal mask is not discounted), 3 times over with backward. What recomputation repeats is
counted in the same convention (HFU counts it, MFU does not): a layer recomputed whole runs its
forward again, 2 N_layer + 4 d s; selective recomputation repeats the attention core only,
4 d s a layer (Korthikanti et al. 2022, sec. 4-5).
"""
from __future__ import annotations


def attention_forward(d_model: int, keys: int) -> float:
    """Forward FLOPs per token of one layer's attention core: q k^T and the weighted sum of v,
    2 d s each."""
    return 4 * d_model * keys


def per_token(multiplied: float, n_layer: int, d_model: int, keys: int) -> float:
    """Model FLOPs per trained token (module docstring) of a model whose token meets
    ``multiplied`` parameters."""
    return 6 * multiplied + 3 * n_layer * attention_forward(d_model, keys)


def recomputed_layers(n_layer: int, recompute: str, every: int = 1) -> int:
    """How many layers ``recompute="full"`` recomputes whole: every ``every``-th (the lab's
    ``recompute_every``, ``dlab.models.recompute.recomputed_blocks``; torchtitan's selective
    layer checkpointing)."""
    if recompute != "full":
        return 0
    return n_layer // every


def recomputed_per_token(recompute: str, every: int, n_layer: int, layer_multiplied: float,
                         d_model: int, keys: int) -> float:
    """FLOPs per token that recomputation repeats (module docstring): ``layer_multiplied`` the
    parameters a token meets in one layer."""
    if recompute == "selective":
        return n_layer * attention_forward(d_model, keys)
    layers = recomputed_layers(n_layer, recompute, every)
    return layers * (2 * layer_multiplied + attention_forward(d_model, keys))


def utilization(flops_per_token: float, tokens: float, seconds: float, peak_flops: float,
                world_size: int = 1) -> float:
    """The share of ``world_size`` devices' peak that ``tokens`` in ``seconds`` used, at
    ``flops_per_token`` (the model's for MFU, with what recomputation repeats for HFU): what
    ``dlab.worker.train`` records per step and what the planner predicts."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"seconds and peak_flops must be positive (got {seconds}, {peak_flops})")
    return flops_per_token * tokens / seconds / (peak_flops * world_size)
