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


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training",
    sec. 3.2): multiply the loss by ``scale`` so that small gradients stay above fp16's smallest
    normal (6.1e-5); divide the gradients by it before the optimizer; when a gradient overflows
    (inf or NaN) skip the step and halve the scale, and after ``interval`` clean steps double it.
    PyTorch's ``torch.amp.GradScaler`` follows the same rule (init 2^16, factor 2, interval 2000).

    Distributed use: every rank must take the same decision, so the flag ``unscale`` returns is
    all-reduced with MAX over every rank that holds a piece of the gradients before ``update``.
    """

    def __init__(self, init: float = 2.0 ** 16, factor: float = 2.0, interval: int = 2000):
        if init <= 0 or factor <= 1 or interval < 1:
            raise ValueError(f"LossScaler needs init > 0, factor > 1 and interval >= 1 "
                             f"(got init={init}, factor={factor}, interval={interval})")
        self.scale, self.factor, self.interval = float(init), float(factor), int(interval)
        self.clean_steps = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grads) -> torch.Tensor:
        """Divide each gradient by the scale in place (in fp32 where the gradient is fp32) and
        return a float flag, 1.0 where any value is inf or NaN, for the caller to all-reduce."""
        found = torch.zeros(())
        for g in grads:
            if g is None:
                continue
            g.div_(self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        return found

    def update(self, found_inf) -> bool:
        """Adjust the scale after a step; True where the step may be applied."""
        if float(found_inf) > 0:
            self.scale /= self.factor
            self.clean_steps = 0
            self.skipped += 1
            return False
        self.clean_steps += 1
        if self.clean_steps % self.interval == 0:
            self.scale *= self.factor
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])
