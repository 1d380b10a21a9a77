"""Models build the same weights everywhere; the data gives the same global batch at any size."""
from __future__ import annotations

import torch

from dlab.models import GPTConfig, build
from dlab.models.corpus import make_corpus
from dlab.models.data import CORPUS, TokenData, shard


def test_parameter_count_formula_matches_the_module():
    for opts in ({}, {"tied": False}, {"n_layer": 3, "d_model": 48, "n_head": 3, "d_ff": 100}):
        model = build("gpt", opts, seed=0)
        assert sum(p.numel() for p in model.parameters()) == GPTConfig(**opts).n_params()


def test_same_seed_same_weights_whatever_ran_before():
    a = build("gpt", {}, seed=7)
    torch.randn(1000)  # disturb the global generator
    b = build("gpt", {}, seed=7)
    c = build("gpt", {}, seed=8)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.tok.weight, c.embed.tok.weight)


def test_gpt_logits_and_loss_shapes():
    model = build("gpt", {"seq_len": 16}, seed=0)
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    targets = torch.randint(0, 256, (2, 16))
    loss = model.criterion(logits, targets)
    # Small initial weights give near-uniform predictions: loss ~ ln(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_global_batch_is_a_function_of_step_and_shards_tile_it():
    data = TokenData(batch_size=8, seq_len=16, seed=0)
    x0, y0 = data.global_batch(3)
    x1, _ = TokenData(batch_size=8, seq_len=16, seed=0).global_batch(3)
    assert torch.equal(x0, x1) and torch.equal(x0[:, 1:], y0[:, :-1])
    for n in (1, 2, 4):
        parts = [shard((x0, y0), i, n) for i in range(n)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x0)


def test_committed_corpus_is_the_generator_output():
    assert CORPUS.read_text() == make_corpus()
