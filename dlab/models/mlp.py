"""A plain MLP regressor: the smallest model whose memory and traffic are easy to count by hand.

``d_in -> d_hidden (x n_layer, ReLU) -> d_out`` with biases. Its parameter count is exact
arithmetic, which is what the memory-accounting tests check the meters against. It learns a
fixed random teacher network (see ``dlab.models.data.TeacherData``), so its loss goes down.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MLPConfig:
    d_in: int = 32
    d_hidden: int = 64
    d_out: int = 8
    n_layer: int = 2  # hidden layers

    def problems(self) -> list[str]:
        return [f"model option {f} must be at least 1 (got {getattr(self, f)})"
                for f in ("d_in", "d_hidden", "d_out", "n_layer") if getattr(self, f) < 1]

    def widths(self) -> list[int]:
        return [self.d_in] + [self.d_hidden] * self.n_layer + [self.d_out]

    def n_params(self) -> int:
        w = self.widths()
        return sum(a * b + b for a, b in zip(w, w[1:]))

    def flops_per_token(self) -> float:
        """Per sample: 6 FLOPs per weight (forward 2, backward 4)."""
        w = self.widths()
        return 6 * sum(a * b for a, b in zip(w, w[1:]))

    def hardware_flops_per_token(self) -> float:
        """Nothing is recomputed: what the hardware runs is what the model needs."""
        return self.flops_per_token()

    def to_dict(self) -> dict:
        return asdict(self)


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.widths()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(w, w[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)

    @staticmethod
    def criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)
