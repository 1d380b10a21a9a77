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
  so a rank holding a slice of the sequence embeds its tokens where they are. By default it is
  the fused ``F.scaled_dot_product_attention`` (on the CPU it saves q, k, v, its output and a
  log-sum-exp per row, never an s x s matrix); ``attention_core="math"`` writes it out and
  keeps the s x s probabilities, the term activation recomputation is about.
- ``recompute`` / ``recompute_every`` recompute whole blocks or the attention core in backward
  instead of keeping their activations (``dlab.models.recompute``).

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

from dlab.models import flops
from dlab.models import recompute as rc


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    d_ff: int = 0  # 0 means 4 * d_model, the GPT-2 ratio
    tied: bool = True
    #: activation recomputation: "none", "selective" (the attention core) or "full" (whole blocks)
    recompute: str = "none"
    #: with recompute="full": every k-th block is recomputed, the others keep their activations
    recompute_every: int = 1
    #: "fused" (F.scaled_dot_product_attention) or "math" (written out, keeps the s x s softmax)
    attention_core: str = "fused"

    #: fields that change how the model runs, not its parameters: a checkpoint written under
    #: one value loads under another
    EXECUTION_FIELDS = ("recompute", "recompute_every", "attention_core")

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
        out += rc.problems(self.recompute, self.recompute_every, self.n_layer)
        if self.attention_core not in CORES:
            out.append(f"model option attention_core must be one of {', '.join(map(repr, CORES))} "
                       f"(got {self.attention_core!r}): 'fused' (the default) or 'math' (keeps "
                       f"the s x s softmax for backward)")
        return out

    def block_params(self) -> int:
        """Parameters of one block: 2 layer norms, q/k/v/proj with biases, the MLP."""
        d, f = self.d_model, self.d_ff
        return 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)

    def active_block_params(self) -> int:
        """Parameters of one block that a token's forward multiplies by (all of them here)."""
        return self.block_params()

    def n_params(self) -> int:
        """Parameter count from the shapes (checked against the module in the tests)."""
        d, v, t = self.d_model, self.vocab_size, self.seq_len
        head = 2 * d + (0 if self.tied else v * d)
        return v * d + t * d + self.n_layer * self.block_params() + head

    def attention_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's attention core: q k^T and the weighted sum of
        v, 2 T d each, over all T keys (PaLM counts them so, causal mask or not)."""
        return flops.attention_forward(self.d_model, self.seq_len)

    def multiplied_params(self) -> int:
        """Parameters a token is multiplied by: embedding lookups do no multiplies, so the
        position table is out; a block counts ``active_block_params``."""
        idle = self.n_layer * (self.block_params() - self.active_block_params())
        return self.n_params() - idle - self.seq_len * self.d_model

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6 N + 12 L d T (``dlab.models.flops``, PaLM's convention,
        the count the planner makes too). This is the MFU numerator: what the model needs,
        whatever the implementation recomputes."""
        return flops.per_token(self.multiplied_params(), self.n_layer, self.d_model, self.seq_len)

    def recompute_flops_per_token(self, recompute: str | None = None, every: int | None = None) -> float:
        """FLOPs per token of the forwards that recomputation runs again in backward, counted
        as ``flops_per_token`` counts (2 per parameter, attention as above): with ``"full"`` one
        forward of every recomputed block, 2 N_block + 4 T d each; with ``"selective"`` the
        attention core's forward in every layer, 4 T d each (Korthikanti et al. 2022, sec. 4.1
        and 5: full recompute adds one forward, about 33% of a step's FLOPs; selective ~2-3%
        at their sizes). Defaults: this config's own settings."""
        recompute = self.recompute if recompute is None else recompute
        every = self.recompute_every if every is None else every
        return flops.recomputed_per_token(recompute, every, self.n_layer, self.active_block_params(),
                                          self.d_model, self.seq_len)

    def hardware_flops_per_token(self, recompute: str | None = None, every: int | None = None) -> float:
        """What the hardware computes per token: the model's FLOPs plus the recomputed forwards,
        the HFU numerator (Chowdhery et al. 2022, app. B: hardware FLOPs utilization counts the
        rematerialisation, model FLOPs utilization does not)."""
        return self.flops_per_token() + self.recompute_flops_per_token(recompute, every)

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


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same function written out, as the unfused attention Korthikanti et al. count: the
    softmax's output P (b, heads, s, s) is saved for backward (by the softmax and by P v).
    The scale and the additive causal mask are applied in place to q k^T, which autograd does
    not need again, so nothing else of size s x s is saved."""
    s = q.shape[-2]
    mask = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    scores = (q @ k.transpose(-2, -1)).mul_(1 / math.sqrt(q.shape[-1])).add_(mask)
    return F.softmax(scores, dim=-1) @ v


#: the attention cores a GPT can be built with (``GPTConfig.attention_core``)
CORES = {"fused": causal_attention, "math": math_attention}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.core = CORES[cfg.attention_core]
        self.recompute = False  # selective recomputation of the core (``dlab.models.recompute``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        # The head count is read off the local width, so the same code runs on a tensor-parallel
        # shard that holds n_head / tp of the heads.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = rc.run(self.recompute, self.core, q, k, v)  # ``self.core`` as it is now
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then + mlp(ln2(x)). With ``recompute``
    set it keeps only ``x`` for backward and runs ``layers`` again there."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.recompute = False  # full recomputation of this block (``dlab.models.recompute``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rc.run(self.recompute, self.layers, x)

    def layers(self, x: torch.Tensor) -> torch.Tensor:
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
        rc.apply(self.blocks, cfg.recompute, cfg.recompute_every)
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
