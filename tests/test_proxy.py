"""The capstone's proxy (``dlab.analysis.proxy``): a planned layout's kinds of parallelism at
degree 2 within the ranks given, and the audit that holds its run to ``single`` and to
``dlab.theory.nd`` on every rank, and says so when it does not."""
from __future__ import annotations

import pytest

import dlab
from dlab.analysis.proxy import against_estimate, parity, proxy_options
from dlab.plan import PlanLayout

CFG = {"model": "gpt", "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32},
       "batch_size": 4, "steps": 2, "optimizer": "sgd", "save_final": True}


@pytest.mark.parametrize("layout, ranks, want", [
    (PlanLayout(dp=16, cp=2, tp=2, zero=1, sequence_parallel=True), 4,
     {"tp": 2, "cp": 2, "zero": 1, "sequence_parallel": True}),
    (PlanLayout(dp=8, tp=8, pp=4, zero=3, sequence_parallel=True, schedule="interleaved",
                virtual_stages=2), 4, {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "1f1b"}),
    (PlanLayout(dp=64, zero=2), 4, {"dp": 4, "zero": 2}),
    (PlanLayout(dp=32, tp=2), 8, {"tp": 2, "dp": 4}),
    (PlanLayout(dp=8, pp=8, schedule="gpipe"), 4, {"pp": 2, "dp": 2, "schedule": "gpipe"}),
])
def test_the_proxy_keeps_each_kind_of_parallelism_at_degree_two(layout, ranks, want):
    assert proxy_options(layout, ranks) == want


def test_a_proxy_needs_a_power_of_two_ranks():
    with pytest.raises(ValueError, match="power of two ranks, at least 2"):
        proxy_options(PlanLayout(dp=4), 3)


def _proxy_run(runs_dir):
    return dlab.launch("nd", 2, runs_dir=runs_dir, wait=True,
                       options=proxy_options(PlanLayout(dp=8, tp=8, sequence_parallel=True), 2),
                       **CFG)


def test_the_audit_passes_a_faithful_run(runs_dir, reference):
    run = _proxy_run(runs_dir)
    rows = parity(run, reference(**CFG))
    assert [r["rank"] for r in rows] == [0, 1] and all(r["ok"] and r["same_as_rank0"] for r in rows)
    audit = against_estimate(run)
    assert all(r["state_ok"] and r["sent_ok"] and r["activations_ok"] for r in audit), audit
    assert all(r["sent"] > 0 for r in audit)


@pytest.mark.slow
def test_the_audit_fails_a_run_that_trained_otherwise(runs_dir, reference):
    other = reference(**{**CFG, "lr": 1e-3})  # the default is 3e-3: another training
    assert not any(r["ok"] for r in parity(_proxy_run(runs_dir), other))
