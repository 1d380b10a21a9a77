"""Checkpoints that do not fit are refused, before start where that can be known, naming the
file or the difference: another model, another optimizer or learning rate, an edited manifest,
a missing file or piece, nothing left to run. Another layout is not a difference: pieces
reshard."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_GPT

import dlab
from dlab import models
from dlab.core.config import RunConfig
from dlab.runtime import checkpoint, checkpoint_load
from dlab.worker.validate import problems

GPT2 = TINY_GPT["model_options"]  # n_layer=2, d_model=32, n_head=2, seq_len=32


def _saved(tmp_path, step: int = 4, strategy: str = "torch-ddp", world: int = 2, **model_options):
    """A real checkpoint of a GPT (its weights and Adam state) as ``strategy`` on ``world``
    ranks would write it; its directory."""
    cfg = RunConfig(strategy, world_size=world, model_options={**GPT2, **model_options})
    model = models.build("gpt", cfg.model_options, 0)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()

    class Replica:
        replicated = True

        def checkpoint_state(self):
            return checkpoint.replica_state(model, optimizer)

    root = tmp_path / "run" / "checkpoints"
    checkpoint.Checkpointer(root, 0, world, meta=checkpoint.run_meta(cfg)).save(Replica(), step)
    return checkpoint.latest(root)


def _refused(tmp_path, says: str, strategy: str = "single", world: int = 1, **config):
    runs = tmp_path / "runs"
    with pytest.raises(dlab.ConfigError, match=says):
        dlab.launch(strategy, world, runs_dir=runs, **{**TINY_GPT, "steps": 8, **config})
    assert not runs.exists(), "a refused run must not leave a run directory"


def test_resume_into_fewer_layers_is_refused_before_start(tmp_path):
    ckpt = _saved(tmp_path)
    _refused(tmp_path, "checkpoint has n_layer=2, this run n_layer=1", resume=str(ckpt),
             model_options={**GPT2, "n_layer": 1})


def test_resume_into_another_width_is_refused_naming_every_difference(tmp_path):
    ckpt = _saved(tmp_path)
    _refused(tmp_path, r"checkpoint has d_ff=128, this run d_ff=256.*checkpoint has d_model=32, "
             r"this run d_model=64", resume=str(ckpt.parent.parent),
             model_options={**GPT2, "d_model": 64})


def test_resume_into_another_layout_of_the_same_model_is_accepted(tmp_path):
    ckpt = _saved(tmp_path, strategy="zero3", world=4)
    for strategy, world in (("single", 1), ("torch-ddp", 2), ("zero3", 2)):
        cfg = RunConfig(strategy, world_size=world, steps=8, resume=str(ckpt), model_options=GPT2)
        assert problems(cfg) == [], (strategy, problems(cfg))


def test_resume_at_or_past_the_last_step_is_refused(tmp_path):
    ckpt = _saved(tmp_path, step=8)
    _refused(tmp_path, "checkpoint is at step 8 and steps=8: nothing to run; raise steps",
             resume=str(ckpt))
    _refused(tmp_path, "checkpoint is at step 8 and steps=5", resume=str(ckpt), steps=5)


def test_resume_with_another_optimizer_or_lr_is_refused_before_start(tmp_path):
    """The checkpoint holds Adam's moments at lr=0.003 (its manifest says so): SGD cannot start
    from them (every rank would fail on a missing ``exp_avg``), and another rate would be
    overwritten by the checkpoint's, training at 0.003 while config.json said 0.01. Each is
    refused saying what to set."""
    ckpt = _saved(tmp_path)
    _refused(tmp_path, r"holds the state of optimizer='adam' and this run has optimizer='sgd'"
             r".*set optimizer='adam' \(--optimizer adam\)", resume=str(ckpt), optimizer="sgd")
    _refused(tmp_path, r"trained at lr=0.003 and this run asks for lr=0.01.*set lr=0.003 "
             r"\(--lr 0.003\)", resume=str(ckpt), optimizer="adam", lr=0.01)
    ok = RunConfig("single", world_size=1, steps=8, resume=str(ckpt), model_options=GPT2)
    assert (ok.optimizer, ok.lr) == ("adam", 0.003) and problems(ok) == []


def test_a_checkpoint_that_predates_the_recorded_optimizer_is_judged_by_its_hparams(tmp_path):
    """A manifest without ``optimizer`` and ``lr`` (written before dlab recorded them) is
    judged on load by the optimizer's own hyper-parameters: ``_saved``'s Adam ran at torch's
    default rate, 0.001."""
    ckpt = _saved(tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for key in ("optimizer", "lr", "digest"):
        manifest.pop(key)
    manifest["digest"] = checkpoint.digest(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    settings = checkpoint_load.Reader(ckpt).settings()
    assert settings == {"optimizer": "adam", "lr": 0.001}
    cfg = RunConfig("single", world_size=1, steps=8, resume=str(ckpt), optimizer="sgd",
                    model_options=GPT2)
    assert problems(cfg) == []  # nothing to judge before start: the worker judges on load
    found = checkpoint_load.settings_problems(cfg, settings, ckpt)
    assert len(found) == 2 and "optimizer='sgd'" in found[0] and "lr=0.001" in found[1]


def test_an_edited_manifest_is_refused_naming_it(tmp_path):
    ckpt = _saved(tmp_path, step=4)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["step"] = 2  # believed, it would replay steps 2-3 on weights already past them
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    _refused(tmp_path, r"manifest\.json: its digest does not match", resume=str(ckpt))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"manifest\.json: its digest"):
        checkpoint_load.Reader(ckpt)


def test_a_missing_file_is_refused_naming_it(tmp_path):
    ckpt = _saved(tmp_path)
    (ckpt / "rank0.pt").unlink()
    _refused(tmp_path, r"rank0\.pt is listed in the manifest but missing", resume=str(ckpt))


class _HalfShard:
    """A sharded writer whose piece covers only the first half of its tensor: what a checkpoint
    with one rank's file left out of the manifest holds."""

    replicated = True

    def checkpoint_state(self):
        full = torch.arange(1000, dtype=torch.float32)
        return {"params": {"w": checkpoint.piece(full[:500], start=0, shape=full.shape)},
                "optim": {}, "hparams": []}


def test_a_missing_piece_is_refused_not_read_as_uninitialised_memory(tmp_path):
    root = tmp_path / "checkpoints"
    checkpoint.Checkpointer(root, 0, 1).save(_HalfShard(), 3)
    reader = checkpoint_load.Reader(checkpoint.latest(root))
    with pytest.raises(checkpoint.CorruptCheckpoint,
                       match=r"params w: the pieces cover 500 of 1000 elements"):
        reader.tensor("params", "w")
