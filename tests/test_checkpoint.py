"""Checkpoints: exact resume after a killed rank, atomicity under a killed writer, corruption
refused by name, and reading a checkpoint at another layout."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from helpers import TINY_GPT, assert_ranks_agree, assert_same_checkpoint, final_state, losses

import dlab
from dlab.runtime import checkpoint, checkpoint_load

RUN = {**TINY_GPT, "steps": 8, "save_final": True}


# slow: notebook 12 kills a torch-ddp rank and resumes it bit for bit under make test, and the
# preemption test (test_stragglers_preemption.py) resumes from a checkpoint bit for bit
@pytest.mark.parametrize("strategy", [pytest.param("torch-ddp", marks=pytest.mark.slow),
                                      pytest.param("zero3", marks=pytest.mark.slow)])
def test_killed_rank_resumes_bitwise_identical(strategy, runs_dir):
    """Train 8 steps uninterrupted, vs. kill rank 1 at step 5 and let torchrun restart every rank
    from the step-4 checkpoint: the same losses and parameters, bit for bit (CPU, fp32). With
    ``zero3`` every rank wrote and reads back its own shard of parameters and Adam state."""
    clean = dlab.launch(strategy, 2, runs_dir=runs_dir, wait=True, **RUN)
    hurt = dlab.launch(strategy, 2, runs_dir=runs_dir, wait=True, checkpoint_every=2, max_restarts=1,
                       fault={"rank": 1, "step": 5, "kind": "kill"}, **RUN)
    assert {m["attempt"] for m in hurt.metrics(0)} == {0, 1}, "the fault must have fired and restarted"
    restart = [e for e in hurt.timeline(0) if e["kind"] == "restart"]
    assert restart and restart[0]["from_step"] == 4
    assert losses(hurt) == losses(clean)
    b = final_state(clean)
    for r in range(2):
        a = final_state(hurt, r)
        assert all(torch.equal(a[k], b[k]) for k in b), r
    kept = [p.name for p in checkpoint.complete(hurt.path / "checkpoints")]
    assert kept == ["step-00000006", "step-00000008"]
    files = {p.name for p in (hurt.path / "checkpoints" / "step-00000008").iterdir()}
    assert ({"rank0.pt", "rank1.pt"} <= files) == (strategy == "zero3"), files


@pytest.mark.slow  # the default run resumes from an async checkpoint in test_stragglers_preemption
def test_async_and_full_checkpoints_resume_the_same(runs_dir):
    """A run resumed from an asynchronous checkpoint (written by a thread while training went
    on) and one resumed from a full checkpoint both take the remaining steps exactly as the
    uninterrupted run: the same losses and, on every rank, the same parameters bit for bit
    (SGD, whose update shows any gradient or state that was saved wrong)."""
    base = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, wait=True, checkpoint_every=4,
                       checkpoint_async=True, **RUN)
    assert "checkpoint_s" in base.metrics(0)[3]
    full = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, wait=True, checkpoint_every=4,
                       checkpoint_kind="full", **{**RUN, "steps": 4})
    from_async = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, wait=True,
                             resume=str(base.path / "checkpoints" / "step-00000004"), **RUN)
    from_full = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, wait=True, resume=str(full.path), **RUN)
    want = final_state(base)
    for later in (from_async, from_full):
        assert [m["step"] for m in later.metrics(0)] == [4, 5, 6, 7]
        assert losses(later) == losses(base)[4:]
        for r in range(2):
            got = final_state(later, r)
            assert all(torch.equal(got[k], want[k]) for k in want), (later.path.name, r)


class _Held:
    """A replica whose weight training would go on changing after a save."""
    replicated = True

    def __init__(self):
        self.weight = torch.arange(1000, dtype=torch.float32)

    def checkpoint_state(self):
        return {"params": {"w": checkpoint.piece(self.weight)}, "optim": {}, "hparams": []}


def test_an_async_save_holds_the_values_of_the_step_it_was_called_at(tmp_path, monkeypatch):
    """Training changes the parameters in place right after ``save`` returns; the writer thread
    (held back here until then) must write the values as they were at the call, so the state
    is copied before ``save`` returns, not read by the thread later."""
    release = threading.Event()
    write = checkpoint._write

    def held_back(obj, path):
        assert release.wait(10)
        return write(obj, path)

    monkeypatch.setattr(checkpoint, "_write", held_back)
    model = _Held()
    saver = checkpoint.Checkpointer(tmp_path / "checkpoints", 0, 1, asynchronous=True)
    saver.save(model, 4)
    model.weight.add_(1.0)  # the next optimizer step
    release.set()
    saver.wait()
    saved = checkpoint_load.Reader(checkpoint.latest(tmp_path / "checkpoints")).tensor("params", "w")
    assert torch.equal(saved, torch.arange(1000, dtype=torch.float32))


# slow: notebook 12's checked cells reshard the harder case, zero3's flat shards, 4 -> 2 -> 1 in
# the default run (make test), with losses held to the reference's to 1e-5
@pytest.mark.slow
def test_reshard_four_ranks_to_two_and_to_single(runs_dir, reference):
    four = dlab.launch("torch-ddp", 4, runs_dir=runs_dir, wait=True, checkpoint_every=4,
                       **{**RUN, "steps": 4})
    two = dlab.launch("torch-ddp", 2, runs_dir=runs_dir, wait=True, resume=str(four.path), **RUN)
    one = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, resume=str(four.path), **RUN)
    ref = reference(**RUN)
    for run in (two, one):
        got, want = losses(run), losses(ref)[4:]
        assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, want)) < 1e-5
        mine, theirs = final_state(run), final_state(ref)
        assert max((mine[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-5, run.path.name
        assert_ranks_agree(run)


@pytest.mark.slow  # notebook 12 reshards zero3 4 -> 2 -> 1 in the default run
def test_zero3_shards_reshard_four_to_two_and_to_single(runs_dir, reference):
    """ZeRO-3 cuts parameters at arbitrary flat offsets; its pieces load into 2 ranks of zero3
    (other cuts), into single (whole tensors) and, back the other way, into zero2 shards."""
    four = dlab.launch("zero3", 4, runs_dir=runs_dir, wait=True, checkpoint_every=4,
                       **{**RUN, "steps": 4})
    two = dlab.launch("zero3", 2, runs_dir=runs_dir, wait=True, resume=str(four.path), **RUN)
    one = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, resume=str(four.path),
                      checkpoint_every=6, **{**RUN, "steps": 6})
    back = dlab.launch("zero2", 2, runs_dir=runs_dir, wait=True, resume=str(one.path), **RUN)
    ref = reference(**RUN)
    want = final_state(ref)
    for run, first, end in ((two, 4, 8), (one, 4, 6), (back, 6, 8)):
        got = losses(run)
        assert len(got) == end - first
        assert max(abs(a - b) for a, b in zip(got, losses(ref)[first:end])) < 1e-5, run.path.name
    for run in (two, back):
        mine = final_state(run)
        assert max((mine[k] - want[k]).abs().max().item() for k in want) < 1e-5, run.path.name
        assert_ranks_agree(run)


def test_zero2_resumes_and_reshards_parameters_its_shard_boundary_cuts(runs_dir):
    """The default run's ZeRO resume: zero2 on 2 ranks, SGD with momentum (its buffer is the
    optimizer state a resume must restore), checkpointed at step 3 of 6. Resumed on 2 ranks
    (the same cuts: each rank loads its chunk of the parameters the boundary cuts, and of
    their momentum) and resharded into ``single`` (whole tensors assembled from both ranks'
    pieces), both finish like the uninterrupted run, to 1e-5 on every rank; the zero2 resume's
    own step-6 checkpoint holds every parameter and momentum of the uninterrupted run's, bit
    for bit (the same cuts sum the same numbers), so no moment was lost at the resume.
    (test_checkpoint_state.py looks at every moment of every ZeRO stage right after a resume.)"""
    run = {**RUN, "steps": 6}
    clean = dlab.launch("zero2", 2, runs_dir=runs_dir, wait=True, checkpoint_every=3, **run)
    saved = clean.path / "checkpoints" / "step-00000003"
    states = checkpoint_load.Reader(saved).states
    assert {"rank0.pt", "rank1.pt"} <= set(states), "zero2 writes a file per rank"
    # the checkpoint itself says which parameters the shard boundary cut: pieces in both files
    cut = set(states["rank0.pt"]["params"]) & set(states["rank1.pt"]["params"])
    assert cut, "no parameter straddles the two ranks' chunks: the case tests nothing"
    assert all(states["rank1.pt"]["optim"][name]["momentum_buffer"]["data"].abs().max() > 0
               for name in cut), "the momentum of a cut parameter is zero at the checkpoint"
    resumed = dlab.launch("zero2", 2, runs_dir=runs_dir, wait=True, resume=str(saved),
                          checkpoint_every=3, **run)
    one = dlab.launch("single", 1, runs_dir=runs_dir, wait=True, resume=str(saved), **run)
    want = final_state(clean)
    for later in (resumed, one):
        got = losses(later)
        assert len(got) == 3, later.path.name
        worst = max(abs(a - b) for a, b in zip(got, losses(clean)[3:]))
        assert worst < 1e-5, (later.path.name, got, losses(clean)[3:])
        for r in range(later.world_size):
            mine = final_state(later, r)
            diff, name = max(((mine[k] - want[k]).abs().max().item(), k) for k in want)
            assert diff < 1e-5, f"{later.path.name} rank {r}: {name} differs by {diff:.2e}"
    end = "checkpoints/step-00000006"
    assert_same_checkpoint(checkpoint_load.Reader(resumed.path / end),
                           checkpoint_load.Reader(clean.path / end))


class _Replica:
    replicated = True

    def __init__(self, n: int):
        self.weight = torch.arange(n, dtype=torch.float32)

    def checkpoint_state(self):
        return {"params": {"w": checkpoint.piece(self.weight)}, "optim": {}, "hparams": []}


def _save_forever(root, n):
    """Child process: keeps saving a big checkpoint, to be killed in the middle of one."""
    saver = checkpoint.Checkpointer(root, 0, 1, keep=5)
    for step in range(100, 200):
        saver.save(_Replica(n), step)


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    checkpoint.Checkpointer(root, 0, 1).save(_Replica(10), 1)
    child = multiprocessing.get_context("fork").Process(target=_save_forever, args=(root, 20_000_000))
    child.start()
    while not list(root.glob(".partial-*")):
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert list(root.glob(".partial-*")), "the kill should have caught a save midway"
    newest = checkpoint.latest(root)
    reader = checkpoint_load.Reader(newest)  # complete, verified, loadable
    assert reader.step in (1, *range(100, 200))
    assert newest.name.startswith("step-") and ".partial" not in str(newest)


def test_a_corrupt_shard_is_refused_naming_the_file(tmp_path):
    root = tmp_path / "checkpoints"
    checkpoint.Checkpointer(root, 0, 1).save(_Replica(1000), 3)
    shard = checkpoint.latest(root) / "rank0.pt"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"rank0\.pt: SHA-256 does not match"):
        checkpoint_load.Reader(checkpoint.latest(root))


def test_pieces_from_any_layout_assemble_the_same_tensor():
    """Four ranks' uneven cuts of one flattened tensor (as ZeRO's padded shards cut it) merge
    into the whole, and any range reads back."""
    full = torch.randn(5, 7)
    cuts = [0, 9, 20, 21, 35]
    states = [{"params": {"w": checkpoint.piece(full.reshape(-1)[a:b], start=a, shape=full.shape)},
               "optim": {}, "rank": r} for r, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    merged = checkpoint.merge(states)["params"]["w"]
    assert torch.equal(merged["data"].view(5, 7), full)


def test_bad_resume_path_is_refused_before_start(tmp_path):
    with pytest.raises(dlab.ConfigError, match="neither a checkpoint nor a run"):
        dlab.launch("torch-ddp", 2, resume=str(tmp_path), runs_dir=tmp_path / "runs", **TINY_GPT)


@pytest.mark.parametrize("fmt,readable", [("dlab-checkpoint/2", True), ("dlab-checkpoint/3", True),
                                          ("dlab-checkpoint/4", False), ("dlab-checkpoint/1", False)])
def test_a_manifest_of_a_format_this_dlab_cannot_read_is_refused(tmp_path, fmt, readable):
    manifest = {"format": fmt, "step": 3}
    manifest["digest"] = checkpoint.digest(manifest)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    if readable:  # /2 has no tensor-parallel slices, so /3's reader reads it the same
        assert checkpoint_load.read_manifest(tmp_path)["step"] == 3
    else:
        with pytest.raises(checkpoint.CorruptCheckpoint, match="not a dlab-checkpoint/3 checkpoint"):
            checkpoint_load.read_manifest(tmp_path)
