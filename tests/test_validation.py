"""One validation path: every config field, every model option and every option of every
registered strategy is checked for kind and range before any process starts, and refused with
``ConfigError`` naming it and saying what to use. The walk takes the fields and options from
where they are declared (``config.FIELDS``, the model configs, ``Strategy.OPTIONS``), so a new
one is walked too."""
from __future__ import annotations

import math
import time

import pytest
from helpers import TINY_GPT, processes_of

import dlab
from dlab import models, parallel
from dlab.cli.main import main
from dlab.core.config import FIELDS

BAD_BY_KIND = {
    "int": ["x", 1.5, True, None],
    "number": ["x", math.nan, math.inf, None, True],
    "bool": ["maybe", 1, None],
    "str": [3, None, ["a"]],
    "dict": ["x", [1]],
    "choice": ["nonsense", 3, None, ["a"]],
}


def bad_values(option) -> list:
    out = [v for v in BAD_BY_KIND[option.kind] if not (v is None and option.none_ok)]
    if option.minimum is not None:
        out.append(option.minimum if option.above else option.minimum - 1)
    return out


def _refused(tmp_path, says: str, **config) -> None:
    runs = tmp_path / "runs"
    args = {"strategy": "torch-ddp", "world_size": 2, **TINY_GPT, **config}
    start = time.monotonic()
    with pytest.raises(dlab.ConfigError) as info:
        dlab.launch(runs_dir=runs, **args)
    assert says in str(info.value), str(info.value)
    assert time.monotonic() - start < 2 and not runs.exists() and not processes_of(tmp_path)


FIELD_CASES = [(name, value) for name, option in FIELDS.items() for value in bad_values(option)]


@pytest.mark.parametrize("name, value", FIELD_CASES, ids=[f"{n}={v!r}" for n, v in FIELD_CASES])
def test_every_config_field_is_checked_before_start(name, value, tmp_path):
    _refused(tmp_path, f"{name}", **{name: value})


MODEL_CASES = [(model, field, value) for model, (cls, _) in models.MODELS.items()
               for field, f in cls.__dataclass_fields__.items()
               for value in (["x", 1.5] if f.type in ("int", int)
                             else ["x", math.nan] if f.type in ("float", float) else ["yes", 1])]


@pytest.mark.parametrize("model, field, value", MODEL_CASES,
                         ids=[f"{m}.{f}={v!r}" for m, f, v in MODEL_CASES])
def test_every_model_option_is_checked_before_start(model, field, value, tmp_path):
    _refused(tmp_path, f"model option {field} must be", model=model, model_options={field: value})


def test_model_option_ranges_are_checked_before_start(tmp_path):
    _refused(tmp_path, "n_layer must be at least 1", model_options={"n_layer": 0})
    _refused(tmp_path, "vocab_size=10 is smaller than the data's 256", model_options={"vocab_size": 10})


OPTION_CASES = [(strategy, key, value) for strategy in parallel.names()
                for key, option in parallel.get(strategy).OPTIONS.items()
                for value in bad_values(option)]


@pytest.mark.parametrize("strategy, key, value", OPTION_CASES,
                         ids=[f"{s}:{k}={v!r}" for s, k, v in OPTION_CASES])
def test_every_strategy_option_is_checked_before_start(strategy, key, value, tmp_path):
    _refused(tmp_path, f"option {key}", strategy=strategy, options={key: value})


@pytest.mark.parametrize("strategy", parallel.names())
def test_every_strategy_refuses_an_unknown_option(strategy, tmp_path):
    _refused(tmp_path, f"unknown option(s) ['no_such_option'] for strategy {strategy!r}",
             strategy=strategy, options={"no_such_option": 1})


def test_a_misspelt_option_gets_a_suggestion(tmp_path):
    _refused(tmp_path, "did you mean 'bucket_cap_mb' for 'bucket_cpa_mb'?", options={"bucket_cpa_mb": 1})


def test_the_examples_of_the_issue(tmp_path):
    _refused(tmp_path, "option bucket_cap_mb must be a positive finite number", options={"bucket_cap_mb": -1})
    _refused(tmp_path, "option sequence_parallel must be True or False", strategy="tp",
             options={"sequence_parallel": "maybe"})
    _refused(tmp_path, "checkpoint_every must be a whole number >= 0", checkpoint_every=1.5)
    _refused(tmp_path, "lr must be a positive finite number", lr=-0.1)
    _refused(tmp_path, "timeout_s must be a positive finite number", timeout_s=math.nan)
    _refused(tmp_path, "model option n_layer must be a whole number", model_options={"n_layer": 1.5})
    _refused(tmp_path, "name 'a/b' cannot be part of a directory name", name="a/b")
    _refused(tmp_path, "fault takes the keys rank, step and kind", fault={"rank": 0, "step": 1,
                                                                         "kind": "hang", "when": 2})
    _refused(tmp_path, "timeout (the run's wall deadline", timeout=math.inf)


@pytest.mark.parametrize("flags, says", [
    (["--name", "a/b"], "cannot be part of a directory name"),
    (["--runs-dir", "/proc/version/runs"], "cannot be created"),
    (["--json", "/nonexistent-dir/summary.json"], "the directory /nonexistent-dir does not exist"),
    (["--deadline", "nan"], "wall deadline"),
    (["--timeout", "inf"], "timeout_s must be a positive finite number"),
    (["--lr", "-1"], "lr must be a positive finite number"),
])
def test_cli_refuses_unusable_paths_and_values_before_start(flags, says, tmp_path, capsys):
    start = time.monotonic()
    code = main(["run", "single", "-n", "1", "--runs-dir", str(tmp_path / "runs"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err
    assert time.monotonic() - start < 5 and not processes_of(tmp_path)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_runs_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "runs").write_text("")
    with pytest.raises(dlab.ConfigError, match="is a file, not a directory"):
        dlab.launch("single", 1, runs_dir=tmp_path / "runs", **TINY_GPT)


def test_strategies_lists_every_declared_option(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    for strategy in parallel.names():
        for key, option in parallel.get(strategy).OPTIONS.items():
            assert f"option {key}: {option.describe()}; {option.help}" in out
