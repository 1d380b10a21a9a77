"""Training precisions: one vocabulary for ``nd``'s ``precision`` option, the planner's layouts
and the notebooks.

A precision names the dtype the model computes in, the bytes each parameter costs in model
state, and whether the loss is scaled. Bytes per parameter (w weights, g gradients, k
optimizer state with Adam), the ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 3.1):

    name               compute   w   g   k                        loss scaling
    fp32               fp32      4   4   8  (two moments)         no
    bf16               bf16      2   2   12 (fp32 master + moments) no (bf16 has fp32's range)
    bf16-fp32-grads    bf16      2   4   12 (Megatron-LM: gradients accumulated and reduced in fp32)
    fp16               fp16      2   2   12                       dynamic (fp16 overflows at 65504)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    compute: torch.dtype
    weight_bytes: int
    grad_bytes: int
    adam_bytes: int  # optimizer state per parameter with Adam, the fp32 master included
    loss_scaled: bool = False

    @property
    def bytes(self) -> tuple[int, int, int]:
        """(weights, gradients, Adam's optimizer state) bytes per parameter."""
        return self.weight_bytes, self.grad_bytes, self.adam_bytes

    @property
    def mixed(self) -> bool:
        """Whether the optimizer keeps fp32 master weights beside the compute copy."""
        return self.compute != torch.float32


PRECISIONS = {p.name: p for p in (
    Precision("fp32", torch.float32, 4, 4, 8),
    Precision("bf16", torch.bfloat16, 2, 2, 12),
    Precision("bf16-fp32-grads", torch.bfloat16, 2, 4, 12),
    Precision("fp16", torch.float16, 2, 2, 12, loss_scaled=True),
)}
