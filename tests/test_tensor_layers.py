"""The tensor-parallel building blocks against their single-process originals, on 2 and 4 ranks:
column- then row-parallel linears against two ``nn.Linear`` (outputs and every gradient), with
and without sequence parallelism; the vocabulary-parallel embedding and cross-entropy against
``nn.Embedding`` and ``F.cross_entropy``; the bytes one layer moves and the activation bytes the
model saves against ``dlab.theory.tensor``. Config checks refuse what cannot be split."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dlab
from dlab.core.config import ConfigError

B, S, D, FF, V = 2, 8, 12, 16, 32  # every size divides by 4


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _seq(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=1)[rank]


def _column_row(comm, sp: bool) -> dict[str, float]:
    """fc (column) -> GeLU -> proj (row) on this rank's shards vs the same on full layers."""
    from dlab.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    r, t = comm.rank, comm.size
    torch.manual_seed(0)
    fc, proj = nn.Linear(D, FF), nn.Linear(FF, D)
    x = torch.randn(B, S, D, requires_grad=True)
    up = torch.randn(B, S, D)  # the gradient arriving from above
    (proj(F.gelu(fc(x))) * up).sum().backward()
    want_y = proj(F.gelu(fc(x))).detach()

    col = ColumnParallelLinear.from_linear(fc, comm, sp)
    row = RowParallelLinear.from_linear(proj, comm, sp)
    xl = (_seq(x, r, t) if sp else x).detach().clone().requires_grad_()
    before = comm.totals().sent_bytes
    y = row(F.gelu(col(xl)))
    (y * (_seq(up, r, t) if sp else up)).sum().backward()
    sent = comm.totals().sent_bytes - before
    # Under sequence parallelism the row bias saw only this rank's tokens: its gradient is a
    # partial sum (the strategy all-reduces such gradients once per step).
    bias_grad = row.bias.grad.clone()
    if sp:
        torch.distributed.all_reduce(bias_grad)
    return {
        "y": _err(y, _seq(want_y, r, t) if sp else want_y),
        "x.grad": _err(xl.grad, _seq(x.grad, r, t) if sp else x.grad),
        "fc.weight.grad": _err(col.weight.grad, fc.weight.grad.chunk(t, 0)[r]),
        "fc.bias.grad": _err(col.bias.grad, fc.bias.grad.chunk(t, 0)[r]),
        "proj.weight.grad": _err(row.weight.grad, proj.weight.grad.chunk(t, 1)[r]),
        "proj.bias.grad": _err(bias_grad, proj.bias.grad),
        "sent": sent,
    }


def _vocab_parallel(comm, sp: bool) -> dict[str, float]:
    from dlab.parallel.tensor.layers import VocabParallelEmbedding, vocab_parallel_cross_entropy

    r, t = comm.rank, comm.size
    torch.manual_seed(1)
    emb = nn.Embedding(V, D)
    idx = torch.randint(0, V, (B, S))
    up = torch.randn(B, S, D)
    (emb(idx) * up).sum().backward()
    mine = VocabParallelEmbedding(emb.weight.detach().chunk(t)[r].clone(), V, comm, sp)
    out = mine(idx)
    (out * (_seq(up, r, t) if sp else up)).sum().backward()
    want = emb(idx).detach()

    logits = torch.randn(B, S, V, requires_grad=True)
    target = torch.randint(0, V, (B, S))
    loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
    loss.backward()
    local = logits.detach().chunk(t, -1)[r].clone().requires_grad_()
    mine_loss = vocab_parallel_cross_entropy(local, target, r * V // t, comm)
    mine_loss.backward()
    return {
        "embedding": _err(out, _seq(want, r, t) if sp else want),
        "embedding.grad": _err(mine.weight.grad, emb.weight.grad.chunk(t)[r]),
        "loss": abs(mine_loss.item() - loss.item()),
        "logits.grad": _err(local.grad, logits.grad.chunk(t, -1)[r]),
    }


def _model_bytes_and_memory(comm, sp: bool) -> dict[str, float]:
    """One transformer layer's bytes, and the whole model's saved activations, measured."""
    from dlab import models
    from dlab.core.metrics import ActivationMeter
    from dlab.parallel.tensor.model import TensorParallelGPT
    from dlab.theory import tensor as est

    opts = {"n_layer": 2, "d_model": 16, "n_head": 4, "seq_len": 8, "vocab_size": 32}
    model = TensorParallelGPT(models.build("gpt", opts, 0), comm, sp)
    idx = torch.randint(0, 32, (B, 8))
    x = model.embed(idx).detach().requires_grad_()
    before = comm.totals().sent_bytes
    model.blocks[0](x).sum().backward()
    layer = comm.totals().sent_bytes - before

    meter = ActivationMeter(model.parameters())
    with meter.track():
        loss = model.criterion(model(idx), idx)
    saved = meter.current
    loss.backward()
    return {"layer_bytes": layer, "layer_formula": est.layer_bytes(opts, B, comm.size, sp),
            "activations": saved,
            "activations_formula": est.activation_bytes(opts, B, comm.size, sp)["total"],
            "released": meter.current}


def _model_matches_gpt(comm, sp: bool, tied: bool) -> dict[str, float]:
    """The whole tensor-parallel GPT against the GPT it was cut from: loss, and every
    parameter's gradient once the shards are put back together."""
    import torch.distributed as dist

    from dlab import models
    from dlab.parallel.tensor.model import TensorParallelGPT

    opts = {"n_layer": 2, "d_model": 16, "n_head": 4, "seq_len": 8, "vocab_size": 32,
            "tied": tied}
    full = models.build("gpt", opts, 0)
    model = TensorParallelGPT(models.build("gpt", opts, 0), comm, sp)
    idx, target = torch.randint(0, 32, (B, 8)), torch.randint(0, 32, (B, 8))
    want = full.criterion(full(idx), target)
    want.backward()
    got = model.criterion(model(idx), target)
    got.backward()
    worst = 0.0
    grads = dict(full.named_parameters())
    for name, p in model.named_parameters():
        g, dim = p.grad.clone(), model.shard_dim(name)
        if dim is None and sp:
            dist.all_reduce(g)  # partial sums over this rank's tokens
        if dim is not None:
            parts = [torch.empty_like(g) for _ in range(comm.size)]
            dist.all_gather(parts, g)
            g = torch.cat(parts, dim)
        worst = max(worst, _err(g, grads[name].grad))
    assert set(grads) == {n for n, _ in model.named_parameters()}
    return {f"model loss (tied={tied})": abs(got.item() - want.item()),
            f"model grads (tied={tied})": worst}


def _all_checks() -> dict:
    from dlab.comm.instrumented import Comm

    comm = Comm(None)
    return {sp: {**_column_row(comm, sp), **_vocab_parallel(comm, sp),
                 **_model_bytes_and_memory(comm, sp), **_model_matches_gpt(comm, sp, True),
                 **_model_matches_gpt(comm, sp, False)} for sp in (False, True)}


# the 4-way split runs the same code as the 2-way one: slow, like the 4-rank tp parity cases
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_parallel_layers_match_their_originals(world_size, runs_dir):
    from dlab.theory.tensor import layer_bytes

    results = dlab.spawn(_all_checks, world_size, runs_dir=runs_dir)
    t = world_size
    for rank, by_sp in enumerate(results):
        for sp, got in by_sp.items():
            where = f"rank {rank}, sequence_parallel={sp}"
            for key in ("y", "x.grad", "fc.weight.grad", "fc.bias.grad", "proj.weight.grad",
                        "proj.bias.grad", "embedding", "embedding.grad", "loss", "logits.grad",
                        "model loss (tied=True)", "model grads (tied=True)",
                        "model loss (tied=False)", "model grads (tied=False)"):
                assert got[key] < 1e-5, f"{key} differs by {got[key]:.2e} ({where})"
            # column + row is one sub-layer: half of a transformer layer's traffic
            assert got["sent"] == pytest.approx(layer_bytes({"d_model": D, "seq_len": S}, B, t, sp) / 2)
            assert got["layer_bytes"] == pytest.approx(got["layer_formula"]) and got["layer_bytes"] > 0
            assert got["activations"] == got["activations_formula"], where
            assert got["released"] == 0, where  # backward freed everything it saved
    # sequence parallelism saves less: everything outside the regions is 1/t
    assert results[0][True]["activations"] < results[0][False]["activations"]


@pytest.mark.parametrize("options,model_options,expect", [
    ({"tp": 3}, {"n_head": 3, "d_model": 24}, "tp=3 takes 3 ranks, which does not divide world_size=4"),
    ({"tp": 4}, {"n_head": 2}, "tp=4 must divide the model's 2 heads"),
    ({"tp": 4}, {"n_head": 4, "d_ff": 66}, "d_ff=66 is not divisible by tp=4"),
    ({"tp": 4}, {"n_head": 4, "vocab_size": 258}, "vocab_size=258 is not divisible by tp=4"),
    ({"tp": 4, "sequence_parallel": True}, {"n_head": 4, "seq_len": 30},
     "splits the 30 tokens over tp=4"),
    ({"tp": 4, "overlap": True}, {}, "unknown option(s) ['overlap']"),
])
def test_configs_that_cannot_split_are_refused(options, model_options, expect, runs_dir):
    with pytest.raises(ConfigError) as err:
        dlab.launch("tp", 4, runs_dir=runs_dir, options=options, model_options=model_options)
    assert expect in str(err.value)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())  # refused before any process


def test_korthikanti_formula_has_the_papers_shape():
    """Korthikanti et al. eq. 2-4: sequence parallelism divides the whole layer by t; tensor
    parallelism alone leaves 10 s b h bytes (norms, linear inputs, dropout masks) undivided."""
    from dlab.theory.tensor import korthikanti_layer_bytes as k

    opts = {"d_model": 64, "n_head": 4, "seq_len": 128}
    s, b, h, a = 128, 2, 64, 4
    assert k(opts, b, 1, False) == s * b * h * (34 + 5 * a * s / h)
    for t in (2, 4, 8):
        assert k(opts, b, t, True) == pytest.approx(k(opts, b, 1, False) / t)
        assert k(opts, b, t, False) - k(opts, b, t, True) == pytest.approx(s * b * h * (10 - 10 / t))
