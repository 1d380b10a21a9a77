"""The GPT with mixture-of-experts MLPs: the model expert parallelism splits.

Every block's MLP becomes ``n_expert`` MLPs of the same shape and a router, a linear map to one
logit per expert. A token goes to the ``top_k`` experts with the largest router probabilities
and their outputs are summed, weighted by those probabilities (not renormalised), so the
router learns through the weights (Switch Transformer, Fedus et al. 2021, for k = 1; GShard,
Lepikhin et al. 2020, for k = 2). Parameters grow with the experts; the FLOPs per token grow
only with k: that is the point of the design.

Two things production MoEs add are left out on purpose. No capacity limit: every token reaches
its experts ("dropless", as in MegaBlocks, Gale et al. 2022), so a single process and an
expert-parallel run compute the same function and parity tests are exact. No load-balancing
loss: it depends on the token fractions of the whole batch, and it is an exercise in
notebook-scale routing, not in parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dlab.models.gpt import GPT, MLP, GPTConfig


@dataclass
class MoEConfig(GPTConfig):
    n_expert: int = 4
    top_k: int = 1

    def problems(self) -> list[str]:
        out = super().problems()
        if not 1 <= self.top_k <= max(self.n_expert, 1):
            out.append(f"model option top_k={self.top_k} must be between 1 and "
                       f"n_expert={self.n_expert}")
        if self.n_expert < 1:
            out.append(f"model option n_expert must be at least 1 (got {self.n_expert})")
        return out

    def mlp_params(self) -> int:
        return (self.d_model * self.d_ff + self.d_ff) + (self.d_ff * self.d_model + self.d_model)

    def block_params(self) -> int:
        """A block with n_expert MLPs and the router (d x n_expert, no bias)."""
        experts = self.n_expert * self.mlp_params() + self.d_model * self.n_expert
        return super().block_params() + experts - self.mlp_params()

    def active_block_params(self) -> int:
        """A token passes through top_k experts, not all of them: ``flops_per_token`` is then
        6 N_active + 12 L d T, and a recomputed block's forward 2 N_active_block + 4 T d."""
        return self.block_params() - (self.n_expert - self.top_k) * self.mlp_params()


def route(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each (tokens, k): the top-k router probabilities and their experts."""
    return F.softmax(router_logits, dim=-1).topk(k, dim=-1)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.router(flat), self.top_k)
        return self.combine(flat, weights, experts).view_as(x)

    def combine(self, flat, weights, experts) -> torch.Tensor:
        """Every expert on the tokens routed to it; outputs summed into place, weighted.
        Expert parallelism replaces this method with one that sends tokens to other ranks."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (experts == e).nonzero(as_tuple=True)
            if len(token):
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out


class MoEGPT(GPT):
    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        for block in self.blocks:
            block.mlp = MoE(cfg)
        self.reset_parameters()
