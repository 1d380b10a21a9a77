"""A GPT turned into its tensor-parallel shard (Megatron-LM layout).

``TensorParallelGPT(gpt, comm, sequence_parallel)`` takes the full model (built the same way on
every rank from the seed) and keeps rank r's share:

- attention split by heads: q, k, v column-parallel (their rows are grouped by head, so rank r's
  rows are heads r*n_head/t ..), proj row-parallel. Each rank runs attention on its own heads;
  nothing crosses ranks until proj's partial outputs are summed.
- MLP: fc column-parallel, GeLU locally, proj row-parallel.
- token embedding and the (tied) output projection split by vocabulary, sharing one shard;
  the loss is the vocabulary-parallel cross-entropy, so no rank holds the full logits.
- layer norms, position embedding and row-parallel biases are whole on every rank. Without
  sequence parallelism every rank computes them on the same tensors, so their gradients agree.
  With it each rank sees only its tokens, so their gradients are partial sums: they are
  all-reduced once per step (``sequence_parallel_params``), as Megatron-LM does.
- activation recomputation: each block and attention keeps the GPT's ``recompute`` flags and
  its attention core (``dlab.models.recompute``); a recomputed block's collectives run again in
  its backward, on every rank of the group in the same order.

Parameter names are those of ``GPT`` (``blocks.0.attn.q.weight`` ...), so the full state dict
is each name's shards concatenated along ``SHARD_DIMS``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlab.comm.instrumented import Comm
from dlab.models import recompute as rc
from dlab.models.gpt import GPT, MLP
from dlab.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel,
    shard_rows,
    vocab_parallel_cross_entropy,
)


def _copy_layer_norm(ln: nn.LayerNorm) -> nn.LayerNorm:
    out = nn.LayerNorm(ln.normalized_shape, eps=ln.eps)
    out.load_state_dict(ln.state_dict())
    return out


class ParallelAttention(nn.Module):
    def __init__(self, attn, comm: Comm, sp: bool):
        super().__init__()
        self.comm, self.sp, self.head_dim = comm, sp, attn.head_dim
        self.q, self.k, self.v = (ColumnParallelLinear.from_linear(m, comm, sp)
                                  for m in (attn.q, attn.k, attn.v))
        self.proj = RowParallelLinear.from_linear(attn.proj, comm, sp)
        self.core = attn.core  # swappable, as in ``Attention``: CP puts ring attention here
        self.recompute = attn.recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = column_parallel(x, [self.q, self.k, self.v], self.comm, self.sp)
        b, s, _ = q.shape
        heads = q.shape[-1] // self.head_dim  # this rank's n_head / t heads
        q, k, v = (z.view(b, s, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = rc.run(self.recompute, self.core, q, k, v)  # ``self.core`` as it is now
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, mlp, comm: Comm, sp: bool):
        super().__init__()
        self.fc = ColumnParallelLinear.from_linear(mlp.fc, comm, sp)
        self.proj = RowParallelLinear.from_linear(mlp.proj, comm, sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    def __init__(self, block, comm: Comm, sp: bool):
        super().__init__()
        self.ln1, self.ln2 = _copy_layer_norm(block.ln1), _copy_layer_norm(block.ln2)
        self.attn = ParallelAttention(block.attn, comm, sp)
        # A mixture of experts stays whole here (expert parallelism splits it, not tp): under
        # sequence parallelism each rank routes its own tokens through it.
        self.mlp = ParallelMLP(block.mlp, comm, sp) if isinstance(block.mlp, MLP) else block.mlp
        self.recompute = block.recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rc.run(self.recompute, self.layers, x)

    def layers(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelEmbedding(nn.Module):
    def __init__(self, embed, vocab_size: int, comm: Comm, sp: bool):
        super().__init__()
        self.comm, self.sp = comm, sp
        self.tok = VocabParallelEmbedding(shard_rows(embed.tok.weight, comm.rank, comm.size),
                                          vocab_size, comm, sp)
        self.pos = nn.Embedding.from_pretrained(embed.pos.weight.detach().clone(), freeze=False)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the tokens' places in their sequence (default 0, 1, ...; context
        parallelism passes its share's). Under sequence parallelism this rank embeds the
        r-th 1/t slice of them."""
        x = self.tok(idx)
        s = x.shape[1]  # this rank's tokens: all of them, or s/t with sequence parallelism
        first = self.comm.rank * s if self.sp else 0
        if positions is None:
            mine = torch.arange(first, first + s, device=idx.device)
        else:  # a copy, so the lookup saves s indices, not the whole tensor a slice views
            mine = positions[first: first + s].clone()
        return x + self.pos(mine)


class ParallelHead(nn.Module):
    """Final layer norm, then the vocabulary-parallel projection (this rank's V/t logits)."""

    def __init__(self, head, tok_shard: nn.Parameter | None, comm: Comm, sp: bool):
        super().__init__()
        self.comm, self.sp = comm, sp
        self.ln = _copy_layer_norm(head.ln)
        if tok_shard is None:
            self.weight = nn.Parameter(shard_rows(head.weight, comm.rank, comm.size))
        else:
            self._tied = [tok_shard]  # the embedding's shard: one parameter, two uses

    def projection(self) -> nn.Parameter:
        return self._tied[0] if hasattr(self, "_tied") else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.projection()
        return column_parallel(self.ln(x), [_Weight(w)], self.comm, self.sp)[0]


class _Weight:
    """A weight with no bias, in the shape ``column_parallel`` takes."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.bias = weight, None


class TensorParallelGPT(nn.Module):
    #: dimension along which each sharded parameter is split (others are whole on every rank)
    SHARD_DIMS = {"embed.tok.weight": 0, "head.weight": 0, "attn.q.weight": 0, "attn.q.bias": 0,
                  "attn.k.weight": 0, "attn.k.bias": 0, "attn.v.weight": 0, "attn.v.bias": 0,
                  "attn.proj.weight": 1, "mlp.fc.weight": 0, "mlp.fc.bias": 0,
                  "mlp.proj.weight": 1}

    def __init__(self, gpt: GPT, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        cfg, sp = gpt.cfg, sequence_parallel
        self.cfg, self.comm, self.sequence_parallel = cfg, comm, sp
        self.embed = ParallelEmbedding(gpt.embed, cfg.vocab_size, comm, sp)
        self.blocks = nn.ModuleList(ParallelBlock(b, comm, sp) for b in gpt.blocks)
        self.head = ParallelHead(gpt.head, self.embed.tok.weight if cfg.tied else None, comm, sp)
        self.vocab_start = self.embed.tok.start

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, [b, s, V/t]."""
        x = self.embed(idx, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def criterion(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.comm)

    @classmethod
    def shard_dim(cls, name: str) -> int | None:
        """The dimension ``name`` is split along, or None for a parameter whole on every rank."""
        for suffix, dim in cls.SHARD_DIMS.items():
            if name == suffix or name.endswith("." + suffix):
                return dim
        return None

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Whole-on-every-rank parameters that see only this rank's tokens under sequence
        parallelism: their gradients must be summed over the tensor-parallel group."""
        if not self.sequence_parallel:
            return []
        return [p for name, p in self.named_parameters() if self.shard_dim(name) is None]


def gather_shards(t: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    """The full tensor whose shards along ``dim`` the ranks of ``group`` hold (``t`` itself if
    ``dim`` is None: a parameter whole on every rank). Uses the raw backend, not ``Comm``: this
    is checkpoint and parity traffic, not the training step's."""
    t = t.detach()
    size = dist.get_world_size(group)
    if dim is None or size == 1:
        return t
    local = t.movedim(dim, 0).contiguous()
    full = local.new_empty((size * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(full, local, group=group)
    return full.movedim(0, dim)


def gather_full_state(model: TensorParallelGPT, group) -> dict[str, torch.Tensor]:
    """Every parameter at full size under ``GPT``'s names, on every rank of ``group``."""
    return {name: gather_shards(p, model.shard_dim(name), group).cpu().clone()
            for name, p in model.state_dict().items()}
