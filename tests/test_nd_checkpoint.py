"""``nd`` checkpoints reshard: each rank writes its pieces of the logical tensors (pipeline
stage, tensor-parallel slice, ZeRO cut), and a run at another layout - or ``single`` - cuts its
own out of them and continues as the uninterrupted run, to 1e-5 on every rank (fp32, SGD with
momentum: the momentum is the optimizer state a resume must restore). The same layout resumes
bit for bit. The 8-rank cases of issue #40 are ``slow``."""
from __future__ import annotations

import shutil

import pytest
import torch
from helpers import final_state, losses, max_param_diff

import dlab
from dlab.runtime import checkpoint, checkpoint_load

GPT = {"model": "gpt", "batch_size": 8, "steps": 6, "optimizer": "sgd", "save_final": True,
       "model_options": {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}}
SAVED_AT = 3


def saved(run):
    return run.path / "checkpoints" / f"step-{SAVED_AT:08d}"


def assert_continues(later, clean, tol: float):
    """``later`` (resumed at SAVED_AT) takes the remaining steps as ``clean`` did: losses and
    every rank's full parameters within ``tol`` (0: bit for bit)."""
    got, want = losses(later), losses(clean)[SAVED_AT:]
    assert len(got) == len(want), (got, want)
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= tol, f"{later.path.name}: losses differ by {worst:.2e}: {got} vs {want}"
    ref = final_state(clean)
    for r in range(later.world_size):
        diff, name = max_param_diff(final_state(later, r), ref)
        assert diff <= tol, f"{later.path.name} rank {r}: {name} differs by {diff:.2e}"


def test_pp2_dp2_zero2_reshards_into_tp2_and_single(runs_dir):
    """Saved by pp2 x dp2 ZeRO-2 (each rank: one stage's blocks, a chunk of each unit cut at
    arbitrary offsets), loaded by tp2 (each rank: every block, a slice of each matrix along its
    split dimension) and by ``single`` (whole tensors)."""
    clean = dlab.launch("nd", 4, runs_dir=runs_dir, wait=True, checkpoint_every=SAVED_AT,
                        options={"pp": 2, "dp": 2, "zero": 2}, **GPT)
    states = checkpoint_load.Reader(saved(clean)).states
    cut = set(states["rank0.pt"]["params"]) & set(states["rank1.pt"]["params"])
    assert cut, "no parameter straddles two data ranks' chunks: the case tests no ZeRO cut"
    assert all(states["rank1.pt"]["optim"][n]["momentum_buffer"]["data"].abs().max() > 0 for n in cut)
    tp = dlab.launch("nd", 2, runs_dir=runs_dir, wait=True, resume=str(saved(clean)),
                     options={"tp": 2}, **GPT)
    one = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, resume=str(saved(clean)), **GPT)
    for later in (tp, one):
        assert_continues(later, clean, 1e-5)


def test_same_layout_resumes_bit_for_bit(runs_dir):
    """pp2 x tp2 with ZeRO 0 (the tp-replicated parameters and the last stage's copy of the tied
    matrix are written once, by one holder) resumes under the same layout exactly."""
    options = {"pp": 2, "tp": 2}
    clean = dlab.launch("nd", 4, runs_dir=runs_dir, wait=True, checkpoint_every=SAVED_AT,
                        options=options, **GPT)
    again = dlab.launch("nd", 4, runs_dir=runs_dir, wait=True, resume=str(saved(clean)),
                        options=options, **GPT)
    assert losses(again) == losses(clean)[SAVED_AT:]
    for r in range(4):
        mine, want = final_state(again, r), final_state(clean, r)
        assert all(torch.equal(mine[k], want[k]) for k in want), r
    # refused before any process starts: another model, and a checkpoint missing a rank's pieces
    wider = {**GPT, "model_options": {**GPT["model_options"], "d_model": 64}}
    with pytest.raises(dlab.ConfigError, match="checkpoint has d_model=32, this run d_model=64"):
        dlab.launch("nd", 2, runs_dir=runs_dir, resume=str(saved(clean)), options={"tp": 2}, **wider)
    maimed = runs_dir / "maimed"
    shutil.copytree(saved(clean), maimed)
    (maimed / "rank3.pt").unlink()
    with pytest.raises(dlab.ConfigError, match=r"rank3\.pt is listed in the manifest but missing"):
        dlab.launch("nd", 2, runs_dir=runs_dir, resume=str(maimed), options={"tp": 2}, **GPT)


def test_a_missing_piece_is_refused_naming_the_tensor():
    """Two tensor-parallel slices of a matrix, each cut in two runs (a ZeRO cut of a tp shard):
    all four assemble the whole; without one, the reader names the tensor and the gap."""
    full = torch.randn(6, 4)
    pieces = []
    for offset in (0, 2):
        part = full.narrow(1, offset, 2).reshape(-1)
        pieces += [checkpoint.piece(part[:5], 0, full.shape, (1, offset, 2)),
                   checkpoint.piece(part[5:], 5, full.shape, (1, offset, 2))]
    merged = checkpoint.merge([{"params": {"w": p}, "optim": {}} for p in pieces])
    assert torch.equal(merged["params"]["w"]["data"].view(6, 4), full)
    gap = r"params w: the pieces cover 17 of 24 elements \(first missing at flat offset 11\)"
    with pytest.raises(checkpoint.CorruptCheckpoint, match=gap):
        checkpoint.merge([{"params": {"w": p}, "optim": {}} for p in pieces[:3]])


EIGHT = {"pp": 2, "tp": 2, "dp": 2, "zero": 3}


@pytest.mark.slow
@pytest.mark.parametrize("world,options", [(4, {"dp": 4, "zero": 1}),
                                           (4, {"cp": 2, "tp": 2}),
                                           (1, None)])
def test_pp2_tp2_dp2_zero3_reshards(world, options, runs_dir):
    """Issue #40's cases: saved under pp2 x tp2 x dp2 ZeRO-3 on 8 ranks, loaded under dp4 ZeRO-1,
    under cp2 x tp2 and under ``single``."""
    clean = dlab.launch("nd", 8, runs_dir=runs_dir, wait=True, checkpoint_every=SAVED_AT,
                        options=EIGHT, **GPT)
    if options is None:
        later = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, resume=str(saved(clean)), **GPT)
    else:
        later = dlab.launch("nd", world, runs_dir=runs_dir, wait=True, resume=str(saved(clean)),
                            options=options, **GPT)
    assert_continues(later, clean, 1e-5)


@pytest.mark.slow
def test_pp2_tp2_dp2_zero3_resumes_bit_for_bit(runs_dir):
    clean = dlab.launch("nd", 8, runs_dir=runs_dir, wait=True, checkpoint_every=SAVED_AT,
                        options=EIGHT, **GPT)
    again = dlab.launch("nd", 8, runs_dir=runs_dir, wait=True, resume=str(saved(clean)),
                        options=EIGHT, **GPT)
    assert_continues(again, clean, 0.0)


MOE = {**GPT, "model": "moe", "model_options": {**GPT["model_options"], "n_layer": 2,
                                                 "n_expert": 4, "top_k": 2}}


@pytest.mark.slow
def test_experts_reshard_across_ep(runs_dir):
    """Saved with the experts spread over ep 2 (each rank holds 2 of 4 under their global
    names, replicated over tp; sequence parallel, as MoE under tp needs), loaded with ZeRO-2
    over ep 2 x dp 4 without tp, and by ``single`` (every expert whole)."""
    clean = dlab.launch("nd", 4, runs_dir=runs_dir, wait=True, checkpoint_every=SAVED_AT,
                        options={"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}, **MOE)
    other = dlab.launch("nd", 4, runs_dir=runs_dir, wait=True, resume=str(saved(clean)),
                        options={"dp": 4, "ep": 2, "zero": 2}, **MOE)
    one = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, resume=str(saved(clean)), **MOE)
    for later in (other, one):
        assert_continues(later, clean, 1e-5)
