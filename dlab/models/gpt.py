"""A small decoder-only transformer (GPT-2 shape), written to be split.

Every piece a later strategy cuts is its own module with a plain layout:

- ``GPT.embed`` (token + position) and ``GPT.head`` (final norm + projection to the
  vocabulary) are separate, so a pipeline can give the first stage the embedding and the last
  the head; with ``tied=True`` the head reuses the embedding matrix (Press & Wolf, 2017).
- ``Attention`` keeps q, k and v as three ``nn.Linear`` layers whose output rows are grouped by
  head, so tensor parallelism splits them by rows (heads) and ``proj`` by columns
  (Megatron-LM, Shoeybi et al. 2019).
- ``MLP`` is ``fc`` (d -> d_ff) then ``proj`` (d_ff -> d): column- then row-parallel.
- ``Block`` is the unit FSDP / ZeRO-3 gathers and a pipeline stage holds a run of.
- ``Attention.core`` is the attention proper (q, k, v -> y), a swappable function: context
  parallelism replaces it with ring attention; ``GPT.forward`` takes the tokens' ``positions``,
  so a rank holding a slice of the sequence embeds its tokens where they are.

Initialisation follows GPT-2: N(0, 0.02), residual projections scaled by 1/sqrt(2 L), so the
residual stream's variance does not grow with depth. Dropout is absent on purpose: parity tests
compare strategies bit for bit up to float rounding, and dropout would need its RNG sharded too.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_ff: int = 0  # 0 means 4 * d_model, the GPT-2 ratio
    tied: bool = True

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model

    def problems(self) -> list[str]:
        out = []
        for field in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, field) < 1:
                out.append(f"model option {field} must be at least 1 (got {getattr(self, field)})")
        if self.n_head >= 1 and self.d_model % self.n_head:
            out.append(f"d_model={self.d_model} does not divide into n_head={self.n_head} heads; "
                       f"pick d_model a multiple of n_head")
        return out

    def n_params(self) -> int:
        """Parameter count from the shapes (checked against the module in the tests)."""
        d, f, v, t, n = self.d_model, self.d_ff, self.vocab_size, self.seq_len, self.n_layer
        block = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)  # 2 LN, q/k/v/proj, MLP
        head = 2 * d + (0 if self.tied else v * d)
        return v * d + t * d + n * block + head

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N for the weights (2 forward + 4 backward per multiply-add)
        plus 12 L d T for attention scores and values (PaLM, Chowdhery et al. 2022, app. B).
        Embedding lookups do no multiplies, so N excludes the position table."""
        n = self.n_params() - self.seq_len * self.d_model
        return 6 * n + 12 * self.n_layer * self.d_model * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v over (batch, heads, tokens, head_dim)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.core = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        # The head count is read off the local width, so the same code runs on a tensor-parallel
        # shard that holds n_head / tp of the heads.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and the projection to vocabulary logits. With a tied head the weight is
    the embedding matrix, handed in, not a parameter of this module."""

    def __init__(self, cfg: GPTConfig, tied_weight: nn.Parameter | None):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.tied_weight = tied_weight is not None
        if tied_weight is None:
            self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        else:
            self._tied = [tied_weight]  # a list, so the module does not register it twice

    def projection(self) -> torch.Tensor:
        return self._tied[0] if self.tied_weight else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.projection())


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg, self.embed.tok.weight if cfg.tied else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if p.dim() == 1 and name.endswith(("ln1.weight", "ln2.weight", "ln.weight")):
                nn.init.ones_(p)  # layer-norm scales start as the identity
            elif p.dim() == 1:
                nn.init.zeros_(p)  # biases and layer-norm shifts
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, std=residual_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @staticmethod
    def criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over every position of the batch."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
