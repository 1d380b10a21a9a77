"""The planner against the papers' own figures and formulas, and its search against brute force.

The ZeRO paper's model-state figures and Korthikanti et al.'s activation formulas are closed
forms written in the papers; ``dlab.theory.plan.memory`` counts per category and tensor by tensor, so
their agreement checks the count, not a formula against itself. Parameter counts are the
published sizes of the presets.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from dlab.plan import PlanError, PlanLayout, clusters, models, plan
from dlab.theory.comm import AlphaBeta
from dlab.theory.plan.memory import (
    activations,
    layer_activation_terms,
    layer_bytes,
    model_state,
    rank_params,
    state_bytes,
)
from dlab.theory.plan.search import layouts, pareto, search

GB = 1e9


@pytest.mark.parametrize("stage,paper_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, paper_gb):
    """Rajbhandari et al. 2020, fig. 1: Psi = 7.5B, N_d = 64, K = 12, as the paper rounds."""
    total = sum(state_bytes(7.5e9, 64, stage, "bf16").values()) / GB
    assert round(total, 1 if paper_gb < 100 else 0) == paper_gb


def test_model_state_of_a_layout_is_the_papers_accounting_of_its_parameters():
    spec = models.preset("gpt3-175b")
    lay = PlanLayout(dp=64, zero=1)
    psi = spec.n_params()
    got = model_state(spec, lay, 0)
    assert got["parameters"] == pytest.approx(2 * psi)
    assert got["gradients"] == pytest.approx(2 * psi)
    assert got["optimizer"] == pytest.approx(12 * psi / 64)


@pytest.mark.parametrize("name,published", [
    ("gpt3-175b", 175e9), ("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9),
    ("llama3-405b", 405.9e9), ("mixtral-8x7b", 46.7e9)])
def test_presets_have_their_published_sizes(name, published):
    assert models.preset(name).n_params() == pytest.approx(published, rel=0.01)


def test_mixtral_activates_its_published_parameters_per_token():
    spec = models.preset("mixtral-8x7b")
    active = spec.n_layer * spec.active_layer_params() + 2 * spec.embedding_params()
    assert active == pytest.approx(12.9e9, rel=0.01)  # Jiang et al. 2024: 12.9B active


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
# GPT-3 175B at s = 2048, b = 1, t = 8 (their table 3), 16-bit activations with dropout
S, B, T = 2048, 1, 8
GPT3 = models.preset("gpt3-175b")
H, A = GPT3.d_model, GPT3.n_head
SBH = S * B * H


@pytest.mark.parametrize("tp,sp,recompute,formula", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),                       # eq. 1
    (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),        # eq. 2
    (T, True, "none", SBH / T * (34 + 5 * A * S / H)),                    # eq. 4
    (T, True, "selective", 34 * SBH / T),                                 # sec. 5
    (T, False, "full", 2 * SBH),                                          # sec. 4.3
    (T, True, "full", 2 * SBH / T),
])
def test_korthikanti_activations_per_layer(tp, sp, recompute, formula):
    lay = PlanLayout(tp=tp, sequence_parallel=sp, recompute=recompute, attention="math")
    assert layer_bytes(GPT3, lay, B, S)[0] == pytest.approx(formula, rel=1e-12)


def test_korthikanti_first_pipeline_stage_holds_L_layers_worth():
    """Sec. 4.2.3: 1F1B's first stage keeps p micro-batches of its L / p layers, sbhL/t (34 +
    5as/h) with tensor and sequence parallelism, plus the embedding's dropout mask (sbh/t each)."""
    p = 8
    lay = PlanLayout(tp=T, pp=p, sequence_parallel=True, micro_batch=B, attention="math")
    got = activations(GPT3, lay, global_batch=64, seq_len=S, pp_rank=0)
    assert got - p * SBH / T == pytest.approx(SBH * GPT3.n_layer / T * (34 + 5 * A * S / H), rel=1e-12)


def test_flash_attention_keeps_no_s_squared_term_and_gqa_shrinks_k_v():
    spec = models.preset("llama3-70b")
    flash = layer_activation_terms(spec, PlanLayout(), 1, 8192)
    assert "softmax" not in flash and flash["log-sum-exp"] == 4 * spec.n_head * 8192
    assert flash["k, v"] == pytest.approx(flash["q"] * 2 * spec.n_kv_head / spec.n_head)
    # 8 KV heads over tp 16: each rank keeps one head's K and V whole (replicated), not half
    wide = layer_activation_terms(spec, PlanLayout(tp=16), 1, 8192)
    assert wide["k, v"] == pytest.approx(2 * 2 * 8192 * spec.kv_width / spec.n_kv_head)


LLAMA70, H100 = models.preset("llama3-70b"), clusters.preset("h100-sxm")


def test_data_parallelism_divides_compute_and_tp_across_nodes_costs_more():
    one = plan(LLAMA70, H100, PlanLayout(dp=8, tp=8, pp=4, zero=1, sequence_parallel=True), 256, 4096)
    two = plan(LLAMA70, H100, PlanLayout(dp=16, tp=8, pp=4, zero=1, sequence_parallel=True), 256, 4096)
    assert two.time["compute"] == pytest.approx(one.time["compute"] / 2)
    inside = plan(LLAMA70, H100, PlanLayout(dp=2, tp=8, pp=8, zero=1, sequence_parallel=True), 64, 4096)
    across = plan(LLAMA70, H100, PlanLayout(dp=1, tp=16, pp=8, zero=1, sequence_parallel=True), 64, 4096)
    assert across.time["tp_comm"] > 5 * inside.time["tp_comm"]


def test_bubble_is_the_schedules_idle_share_when_nothing_else_costs():
    fast = dataclasses.replace(H100, intra=AlphaBeta.link(1e30, 0.0), inter=AlphaBeta.link(1e30, 0.0),
                               hbm=1e30)
    lay = PlanLayout(tp=8, pp=4, sequence_parallel=True)
    p = plan(LLAMA70, fast, lay, 16, 4096)  # 16 micro-batches
    assert p.time["bubble"] / p.step_s == pytest.approx(3 / (16 + 3), rel=1e-3)


def test_recomputation_trades_time_for_memory():
    base = PlanLayout(dp=8, tp=8, pp=2, zero=1, sequence_parallel=True)
    runs = {rc: plan(LLAMA70, H100, dataclasses.replace(base, recompute=rc), 128, 8192)
            for rc in ("none", "selective", "full")}
    assert runs["full"].memory["activations"] < runs["selective"].memory["activations"] \
        <= runs["none"].memory["activations"]
    assert runs["full"].step_s > runs["selective"].step_s >= runs["none"].step_s
    assert runs["full"].hfu > runs["full"].mfu
    assert runs["none"].hfu == runs["none"].mfu


def test_selective_recomputation_runs_a_math_cores_softmax_and_dropout_again():
    # the scores' element-wise work is what a math core adds to the forward, and what selective
    # recomputation (Korthikanti et al. 2022, sec. 5) runs again in backward
    gpt = models.preset("gpt3-175b")
    lay = PlanLayout(tp=8, pp=8, sequence_parallel=True, recompute="selective")
    runs = {a: plan(gpt, clusters.preset("a100-80gb"), dataclasses.replace(lay, attention=a), 64, 2048)
            for a in ("flash", "math")}
    added = runs["math"].time["compute"] - runs["flash"].time["compute"]
    assert added > 0
    # compute is forward + backward (3 forwards' worth of element-wise work); recompute one more
    recomputed = runs["math"].time["recompute"] - runs["flash"].time["recompute"]
    assert recomputed == pytest.approx(added / 3, rel=1e-9)


def test_a_reduction_after_backward_shows_whole():
    lay = PlanLayout(dp=32, tp=8, recompute="full")
    overlapped = plan(LLAMA70, H100, lay, 256, 4096)
    after = plan(LLAMA70, H100, dataclasses.replace(lay, grad_overlap=False), 256, 4096)
    # overlapped, the last micro-batch's backward hides part of it
    assert 0 < overlapped.time["data_comm"] < after.time["data_comm"]
    # unhidden: the ring's bytes over the inter-node link, plus its 2 (n-1) steps of latency
    link = H100.inter
    assert after.time["data_comm"] == pytest.approx(
        overlapped.sent["data"] / link.bandwidth + 2 * 31 * link.alpha, rel=1e-6)


def test_without_grad_overlap_only_the_reduction_shows_and_zero3_gathers_still_hide():
    lay = PlanLayout(dp=32, tp=8, zero=3, recompute="full")
    overlapped = plan(LLAMA70, H100, lay, 256, 4096)
    after = plan(LLAMA70, H100, dataclasses.replace(lay, grad_overlap=False), 256, 4096)
    # every micro-batch's reduce-scatter now shows whole; the gathers are charged as before
    m, psi = 8, sum(rank_params(LLAMA70, lay, 0))
    reduce = 31 / 32 * 2 * psi / H100.inter.bandwidth + 31 * H100.inter.alpha
    overlapped_reduce = m * max(0.0, reduce - overlapped.time["compute"] / m * 2 / 3
                                - overlapped.time["recompute"] / m)
    assert after.time["data_comm"] - overlapped.time["data_comm"] == pytest.approx(
        m * reduce - overlapped_reduce, rel=1e-6)


def test_bad_layouts_are_refused_with_what_to_change():
    with pytest.raises(PlanError, match="must divide the model.s 64 heads"):
        plan(LLAMA70, H100, PlanLayout(tp=3), 8, 4096)
    with pytest.raises(PlanError, match="pick a multiple of 16"):
        plan(LLAMA70, H100, PlanLayout(dp=16), 24, 4096)
    with pytest.raises(PlanError, match="splits the experts of a mixture of experts"):
        plan(LLAMA70, H100, PlanLayout(dp=2, ep=2), 8, 4096)


def test_search_covers_the_space_ranks_what_fits_and_its_front_is_undominated():
    spec = models.preset("llama3-8b")
    preds = search(spec, H100, 64, 256, 4096)
    assert len(preds) == len(layouts(spec, 64, 256, 4096)) > 500
    assert all(p.layout.world == 64 for p in preds)
    fit = [p for p in preds if p.fits]
    assert [p.step_s for p in fit] == sorted(p.step_s for p in fit)
    assert preds[:len(fit)] == fit
    front = pareto(fit)
    for p in fit:  # brute force: every layout is matched or beaten by a front point
        assert any(q.memory["total"] <= p.memory["total"] and q.step_s <= p.step_s for q in front)
    for q in front:
        assert not any(p.memory["total"] < q.memory["total"] and p.step_s < q.step_s for p in fit)


def test_70b_on_1024_h100s_ranks_a_layout_a_practitioner_recognises():
    """TP inside a node, the model cut over pipeline stages or ZeRO across nodes."""
    preds = search(LLAMA70, H100, 1024, 1024, 8192)
    top = preds[0].layout
    assert preds[0].fits and 1 < top.tp <= H100.gpus_per_node
    assert top.pp > 1 or top.zero >= 1
    assert 0.3 < preds[0].mfu < 0.7


def test_cli_ranks_and_refuses_bad_input(capsys):
    from dlab.cli.main import main
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--batch", "64", "--seq", "2048",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts in" in out and "MFU" in out
    assert main(["plan", "--model", "gpt5"]) == 2
    assert "unknown model preset 'gpt5'" in capsys.readouterr().err
    assert main(["plan", "--layout", "tp=8,pq=2"]) == 2
    assert "key one of" in capsys.readouterr().err
    assert main(["plan", "--layout", "tp=8,pp=4", "--gpus", "48"]) == 2
    assert "does not divide --gpus 48" in capsys.readouterr().err
    assert main(["plan", "--layout", "tp=8,grad_overlap=maybe"]) == 2
    assert "write grad_overlap=1 or grad_overlap=0" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--layout",
                 "tp=8,grad_overlap=off,sequence_parallel=on"]) == 0
    out = capsys.readouterr().out
    assert "tp8 sp" in out and "not overlapped with backward" in out


def test_cli_prints_the_published_rows_beside_their_predictions(capsys, tmp_path):
    from dlab.cli.main import main
    from dlab.plan import published
    out_file = tmp_path / "published.json"
    assert main(["plan", "--published", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    rows = published.check()
    assert f"mean absolute error: {published.mean_abs_error(rows):.1%} over {len(rows)}" in out
    assert all(r["model"] in out for r in rows)
    assert len(json.loads(out_file.read_text())) == len(rows)
