"""Data: the global batch of a step, and each rank's share of it.

The loop asks for the *global* batch of step ``s`` and every rank gets the same tensors; a
strategy takes the part it needs (its data-parallel shard, or all of it for a tensor-parallel
rank, or only inputs on a first pipeline stage). The batch is a pure function of
``(seed, step)``, so a run at any world size sees the same global batch as the single-process
reference (the parity tests rest on this), and resuming at step ``s`` needs only ``s``.

Tokens are bytes: the vocabulary is the 256 byte values, so no tokenizer is downloaded or
trained and any text file works.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dlab.models.corpus import make_corpus

#: the repository's corpus (a source checkout has it; an installed package makes the same text)
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.txt"
#: every token id is one of the 256 byte values
BYTE_VOCAB = 256


def load_corpus() -> torch.Tensor:
    """The corpus as a uint8 tensor: ``data/corpus.txt`` when present (a source checkout),
    else the same text generated in memory (an installed package has no data/)."""
    raw = CORPUS.read_bytes() if CORPUS.exists() else make_corpus().encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _generator(seed: int, step: int) -> torch.Generator:
    # One generator per step, seeded from both: step s's batch never depends on step s-1's.
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class TokenData:
    """Random windows of ``seq_len + 1`` bytes; inputs are the first ``seq_len``, targets the
    next byte at every position."""

    def __init__(self, batch_size: int, seq_len: int, seed: int):
        self.tokens = load_corpus()
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=_generator(self.seed, step))
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len


class TeacherData:
    """Regression onto a fixed random two-layer teacher: x ~ N(0, 1), y = W2 tanh(W1 x)."""

    def __init__(self, batch_size: int, d_in: int, d_out: int, seed: int):
        g = _generator(seed, -1)
        self.w1 = torch.randn(d_in, 2 * d_in, generator=g) / d_in ** 0.5
        self.w2 = torch.randn(2 * d_in, d_out, generator=g) / (2 * d_in) ** 0.5
        self.batch_size, self.d_in, self.seed = batch_size, d_in, seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, self.d_in, generator=_generator(self.seed, step))
        return x, torch.tanh(x @ self.w1) @ self.w2

    def tokens_per_batch(self) -> int:
        return self.batch_size  # one sample counts as one "token" for throughput


def make_data(config) -> TokenData | TeacherData:
    if config.model in ("gpt", "moe"):
        return TokenData(config.batch_size, config.model_config().seq_len, config.seed)
    mc = config.model_config()
    return TeacherData(config.batch_size, mc.d_in, mc.d_out, config.seed)


def shard(batch: tuple[torch.Tensor, ...], index: int, count: int) -> tuple[torch.Tensor, ...]:
    """Rank ``index`` of ``count``'s contiguous slice of every tensor along the batch dimension,
    as DistributedSampler without shuffling hands out samples. The config check makes the
    batch divide evenly, so every shard has the same size and averaging the shards' mean losses
    equals the global mean loss."""
    return tuple(t.chunk(count)[index] for t in batch)
