"""The GPT with mixture-of-experts MLPs: the model expert parallelism splits.

Every block's MLP becomes ``n_expert`` MLPs of the same shape and a router, a linear map to one
logit per expert. A token goes to the ``top_k`` experts with the largest router probabilities
and their outputs are summed, weighted by those probabilities (not renormalised), so the
router learns through the weights (Switch Transformer, Fedus et al. 2021, for k = 1; GShard,
Lepikhin et al. 2020, for k = 2). Parameters grow with the experts; the FLOPs per token grow
only with k: that is the point of the design.

By default the layer is dropless (every token reaches its experts, as in MegaBlocks, Gale et
al. 2022) and has no auxiliary loss. Three model options add what production MoEs train with:

- ``capacity_factor`` c > 0: each expert takes at most C = ceil(c G k / E) assignments per
  *group* of G tokens (GShard's groups); the rest are dropped (the token's MLP output is 0, so
  the residual carries it through). A group is one sequence, and the queue order is first
  choices before second choices, then position in the sequence (GShard, Lepikhin et al. 2020,
  sec. 2.2). Because a group is a sequence and every strategy that splits the batch does so by
  whole sequences, ``single`` and ``ep`` drop exactly the same assignments.
- ``aux_loss`` a: a E sum_e f_e P_e added to the loss (Switch Transformer, Fedus et al. 2021,
  eq. 4, with f_e the fraction of the k top-k assignments that went to e, before capacity, and
  P_e the mean router probability of e). f_e is a count of the *whole* batch: under ``ep`` the
  counts are all-reduced, each rank adds a E sum_e f_e P_e(its tokens), and the mean of those
  over the ranks is the whole batch's loss, value and gradient.
- ``z_loss`` z: z mean_tokens(logsumexp(router logits))^2 (ST-MoE, Zoph et al. 2022, eq. 5), a
  per-token mean, so equal shards average to the whole batch's.

Each layer keeps its last step's routing: tokens per expert before capacity (``routed``) and
dropped (``dropped``); ``moe_stats`` collects them for the run's metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dlab.models.gpt import GPT, MLP, GPTConfig

#: the options that change training rather than the model's shape (capacity, balancing
#: losses); only strategies that route every layer's tokens as ``single`` does train them
#: (``Strategy.trains_moe_options``)
TRAINING_OPTIONS = ("capacity_factor", "aux_loss", "z_loss")


@dataclass
class MoEConfig(GPTConfig):
    n_expert: int = 4
    top_k: int = 1
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss: float = 0.0
    z_loss: float = 0.0

    def problems(self) -> list[str]:
        out = super().problems()
        for name in TRAINING_OPTIONS:
            if getattr(self, name) < 0:
                out.append(f"model option {name}={getattr(self, name)} must be >= 0 (0 turns it off)")
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


def capacity(factor: float, group: int, k: int, n_expert: int) -> int:
    return math.ceil(factor * group * k / n_expert)


def drop_over_capacity(experts: torch.Tensor, group: int, limit: int) -> torch.Tensor:
    """``experts`` (tokens, k), tokens in groups of ``group`` consecutive ones, with every
    assignment past its expert's first ``limit`` in its group replaced by -1. Queue order in a
    group: all first choices by position, then all second choices, ..."""
    n_tok, k = experts.shape
    slot_major = experts.view(n_tok // group, group, k).transpose(1, 2).reshape(n_tok // group, -1)
    onehot = F.one_hot(slot_major, int(experts.max()) + 1)
    place = ((onehot.cumsum(dim=1) * onehot).sum(-1) - 1)  # 0-based place in its expert's queue
    kept = slot_major.masked_fill(place >= limit, -1)
    return kept.view(n_tok // group, k, group).transpose(1, 2).reshape(n_tok, k)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg, self.top_k = cfg, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_expert))
        # Sums the per-expert counts over the ranks that share a batch (set by ``ep``); the
        # balancing loss's fractions are the whole batch's.
        self.sum_counts = None
        self.aux = None
        self.routed = self.dropped = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        weights, experts = route(logits, self.top_k)
        self.routed = torch.bincount(experts.reshape(-1), minlength=cfg.n_expert).detach()
        if cfg.capacity_factor > 0:
            group = x.shape[-2]  # a sequence
            experts = drop_over_capacity(experts, group, capacity(cfg.capacity_factor, group,
                                                                  self.top_k, cfg.n_expert))
        kept = experts[experts >= 0]
        self.dropped = self.routed - torch.bincount(kept, minlength=cfg.n_expert)
        self.aux = self.auxiliary_loss(logits) if cfg.aux_loss or cfg.z_loss else None
        return self.combine(flat, weights, experts).view_as(x)

    def auxiliary_loss(self, logits: torch.Tensor) -> torch.Tensor:
        cfg, loss = self.cfg, logits.new_zeros(())
        if cfg.aux_loss:
            counts = self.routed.to(logits.dtype)
            if self.sum_counts is not None:
                counts = self.sum_counts(counts.clone())
            fraction = counts / counts.sum()
            mean_prob = F.softmax(logits, dim=-1).mean(dim=0)
            loss = loss + cfg.aux_loss * cfg.n_expert * (fraction * mean_prob).sum()
        if cfg.z_loss:
            loss = loss + cfg.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return loss

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

    def criterion(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy plus every layer's auxiliary losses of this forward, if any."""
        loss = GPT.criterion(logits, targets)
        for block in self.blocks:
            if block.mlp.aux is not None:
                loss = loss + block.mlp.aux
        return loss


def moe_stats(model: torch.nn.Module) -> dict:
    """The last step's routing of every MoE layer of ``model`` (this rank's tokens): tokens per
    expert before capacity, and dropped; {} for a model without MoE layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.routed is not None]
    if not layers:
        return {}
    return {"moe": {"routed": [m.routed.tolist() for m in layers],
                    "dropped": [m.dropped.tolist() for m in layers]}}
