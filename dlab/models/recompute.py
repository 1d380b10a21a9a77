"""Activation recomputation ("activation checkpointing"): keep less for backward, compute again.

Two granularities, chosen by the GPT's model options (as Megatron-Core keeps
``recompute_granularity`` in its ``TransformerConfig``: it changes how the model runs, not what
it holds, so a checkpoint loads under any of them):

- ``recompute="full"``: a recomputed block keeps only its input; backward runs its forward
  again, then its backward (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").
  ``recompute_every=k`` recomputes every k-th block (the k-th, 2k-th, ... : indices k-1, 2k-1,
  ...); the others keep their activations, trading memory for less recomputation.
- ``recompute="selective"``: only the attention core (q, k, v -> y: scores, softmax, weighted
  sum) is recomputed, in every block. In Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", sec. 4.1) that is the part whose activations grow
  with s^2 (5 a s^2 b of the 34 s b h + 5 a s^2 b bytes per layer) while its FLOPs are a small
  share of the layer's, so it is the best memory saved per FLOP spent.

The flags are set on the modules when the model is built (``apply``): ``Block.recompute`` and
``Attention.recompute``. The tensor-parallel copies take them over, and everything that runs
blocks (a pipeline stage, ZeRO-3's hooked blocks, the expert-parallel MoE) runs them as they
are. The recomputation is inside ``Block.forward`` and around ``Attention.core`` as called,
under any hooks registered on the block, so:

- ZeRO-3 / FSDP gather a block by a forward pre-hook and again by a hook on the gradient of the
  block's output: when the recomputation runs, in that block's backward, its parameters are
  gathered; the recomputed forward does not fire the module's hooks, so nothing frees them.
- the core is looked up at call time, so whatever ``core`` is then (ring attention, put there
  by context parallelism) is what gets recomputed.
- collectives inside a recomputed region (tensor parallelism's, the all-to-all of expert
  parallelism, the ring's K/V exchange) run again in backward; every rank recomputes the same
  regions in the same order, so they still pair up.

Why reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``): it saves the region's inputs
with ``ctx.save_for_backward`` under whatever ``saved_tensors_hooks`` are active, so
``dlab.core.metrics.ActivationMeter`` counts what recomputation keeps (the block's input, or q, k,
v). The non-reentrant version installs saved-tensor hooks of its own inside the region and keeps
the inputs in a closure: the meter would see nothing of a recomputed block. The price of the
reentrant one: gradients flow only to inputs that require them (an input that does not is made
a leaf that does, below), and it supports ``backward()``, not ``torch.autograd.grad``, which
dlab does not use.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

RECOMPUTE = ("none", "selective", "full")


def recomputed_blocks(n_layer: int, recompute: str, every: int = 1) -> list[int]:
    """Indices of the blocks that ``recompute="full"`` recomputes whole: every ``every``-th."""
    if recompute != "full":
        return []
    return [i for i in range(n_layer) if (i + 1) % every == 0]


def problems(recompute, every, n_layer: int) -> list[str]:
    """What is wrong with the two model options, each saying what to change."""
    out = []
    if recompute not in RECOMPUTE:
        out.append(f"model option recompute must be one of {', '.join(map(repr, RECOMPUTE))} (got "
                   f"{recompute!r}): 'full' (a block keeps only its input) or 'selective' (the "
                   f"attention core is recomputed)")
    if isinstance(every, int) and every < 1:
        out.append(f"model option recompute_every must be at least 1 (got {every})")
    elif recompute != "full" and every != 1:
        out.append(f"model option recompute_every={every} applies to recompute='full' only; set "
                   f"recompute='full' or leave recompute_every at 1")
    elif recompute == "full" and isinstance(every, int) and every > n_layer >= 1:
        out.append(f"model option recompute_every={every} is more than n_layer={n_layer}: no block "
                   f"would be recomputed; use recompute_every between 1 and {n_layer}")
    return out


def apply(blocks, recompute: str, every: int = 1) -> None:
    """Set each block's ``recompute`` (whole block) and its attention's (the core only)."""
    whole = set(recomputed_blocks(len(blocks), recompute, every))
    for i, block in enumerate(blocks):
        block.recompute = i in whole
        block.attn.recompute = recompute == "selective"


def run(flag: bool, fn, *args: torch.Tensor):
    """``fn(*args)``, recomputed in backward when ``flag`` is set and autograd is recording.
    Only the tensors in ``args`` are kept for backward (counted by the activation meter);
    ``fn``'s own activations are dropped and made again when the backward reaches them."""
    if not (flag and torch.is_grad_enabled()):
        return fn(*args)
    # Reentrant checkpointing differentiates only towards inputs that require a gradient; with
    # none (a frozen embedding before block 0), the block's own parameters would get none.
    args = tuple(a if a.requires_grad else a.detach().requires_grad_() for a in args)
    return _torch_checkpoint(fn, *args, use_reentrant=True)
