"""Impossible configs are refused before any process starts, with a message saying what to change."""
from __future__ import annotations

import time

import pytest
from helpers import TINY_GPT

import dlab
from dlab import parallel
from dlab.core.config import RunConfig
from dlab.worker.validate import problems, validate

# The first strategy lookup imports every strategy module (seconds on a loaded 2-core machine);
# done here, so the time bound below measures the check, not the imports.
parallel.names()


@pytest.mark.parametrize("kwargs, says", [
    ({"world_size": 0}, "world_size must be a whole number >= 1"),
    ({"strategy": "dpp"}, "Did you mean 'ddp'|there is no strategy 'dpp'"),
    ({"strategy": "single", "world_size": 2}, r"runs at world_size \[1\], not 2"),
    ({"batch_size": 6, "world_size": 4}, "does not split evenly over 4"),
    ({"backend": "nccl"}, "needs CUDA GPUs and this machine has none"),
    ({"device": "cuda"}, "no CUDA GPU"),
    ({"model_options": {"d_model": 30, "n_head": 4}}, "d_model=30 does not divide into n_head=4"),
    ({"model_options": {"layers": 2}}, "unknown option"),
    ({"model": "resnet"}, "model='resnet' is not one of"),
    ({"steps": 0}, "steps must be a whole number >= 1"),
    ({"fault": {"rank": 5, "step": 1, "kind": "raise"}}, "fault rank 5 is not a rank"),
    ({"fault": {"rank": 0, "step": 1, "kind": "explode"}}, "fault kind must be one of"),
])
def test_impossible_configs_are_refused_before_start(kwargs, says, tmp_path):
    args = {"strategy": "torch-ddp", "world_size": 2, **TINY_GPT, **kwargs}
    strategy, world = args.pop("strategy"), args.pop("world_size")
    start = time.monotonic()
    with pytest.raises(dlab.ConfigError, match=says):
        dlab.launch(strategy, world, runs_dir=tmp_path / "runs", **args)
    assert time.monotonic() - start < 2, "checking a config must not start anything"
    assert not (tmp_path / "runs").exists(), "a refused run must not leave a run directory"


def test_unknown_config_key_names_the_known_ones(tmp_path):
    with pytest.raises(dlab.ConfigError, match="unknown config key.*'stesp'.*known keys"):
        dlab.launch("torch-ddp", 2, stesp=3, runs_dir=tmp_path)


def test_every_problem_is_listed_at_once():
    found = problems(RunConfig("torch-ddp", world_size=4, batch_size=6, steps=0))
    assert len(found) == 1 and "steps" in found[0]  # basics first, strategy checks after
    found = problems(RunConfig("torch-ddp", world_size=4, batch_size=6))
    assert any("batch_size=6" in p for p in found)


def test_auto_backend_is_gloo_without_gpus():
    cfg = RunConfig("torch-ddp", world_size=2)
    assert cfg.resolved_backend() == "gloo" and cfg.resolved_device() == "cpu"


def test_a_system_without_posix_sessions_is_refused_before_start(monkeypatch):
    """What needs Linux (process sessions and signals) is refused with a message saying so."""
    import os

    from dlab.core.config import ConfigError, RunConfig
    monkeypatch.setattr(os, "name", "nt")
    with pytest.raises(ConfigError, match="WSL"):
        validate(RunConfig(strategy="single", world_size=1))


def test_shm_all_reduce_says_it_needs_dev_shm(monkeypatch):
    import os

    from dlab.comm.algorithms import shm
    real = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: False if p == "/dev/shm" else real(p))
    with pytest.raises(RuntimeError, match="/dev/shm.*ring"):
        shm._check_one_host()
