"""Issue 47: the planner's FLOPs and utilization are the runtime's; sharded data parallelism is
priced as each stack issues it; memory admits what ran; every published source carries the
score it had before anything was changed with it in view.

Each expected figure is counted here from the model's shapes or the cluster's published
constants (a ring's n-1 steps at 5 us across nodes, 192 GB/s for eight members a node, a host
operation at the dispatcher's 3.3 us and a kernel's 3 us launch), apart from the code it
checks.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from dlab.models.gpt import GPT, GPTConfig
from dlab.plan import PlanLayout, clusters, models, plan, published, stacks
from dlab.theory.plan import data_comm
from dlab.theory.plan import time as tm
from dlab.theory.plan.memory import buffers, layer_bytes, op_policy_kept, rank_params
from dlab.theory.plan.rows import ROWS
from dlab.theory.plan.sharding import Sharding
from dlab.theory.plan.spec import from_gpt, megatron_gpt

A100, H100 = clusters.preset("a100-80gb"), clusters.preset("h100-sxm")
LLAMA8 = models.preset("llama3-8b")
#: Llama 3 8B's shapes (Dubey et al. 2024, table 3)
H, KV, F, V, L = 4096, 1024, 14336, 128256, 32
LAYER = 2 * H * H + 2 * H * KV + 3 * H * F  # Q, O; K, V; gate, up, down
ALPHA, LAUNCH, BUSBW = 5e-6, 3e-6, 8 * 24e9  # across DGX A100 nodes; a launch; 8 HDR NICs
DISPATCH = 3.3e-6  # PyTorch's dispatcher, one operation (pytorch/pytorch#32194)
GPT3 = megatron_gpt("GPT-3 175B", 96, 12288, 96)
#: GPT-3 175B's four matrices a layer (QKV, projection, MLP in, MLP out), in forward order
BIG = (3 * 12288 * 12288, 12288 * 12288, 4 * 12288 * 12288, 4 * 12288 * 12288)


def _module_count(cfg: GPTConfig) -> int:
    """Parameters a token is multiplied by, counted on the module itself: all of them but the
    position table (an embedding lookup multiplies nothing)."""
    model = GPT(cfg)
    return sum(p.numel() for p in model.parameters()) - cfg.seq_len * cfg.d_model


@pytest.mark.parametrize("options", [{}, {"n_layer": 4, "seq_len": 128, "tied": False},
                                     {"n_layer": 3, "d_model": 96, "n_head": 3, "d_ff": 200}])
def test_the_planners_flops_per_token_are_the_runtimes_for_the_lab_gpt(options):
    """6 N + 12 L d T with N counted on the module (PaLM's convention, the MFU numerator): the
    runtime's count, the planner's, and the planner's MFU numerator agree to the FLOP."""
    cfg = GPTConfig(**options)
    want = 6 * _module_count(cfg) + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    assert cfg.flops_per_token() == want
    spec = from_gpt(cfg)
    assert spec.flops_per_token(cfg.seq_len) == want
    machine = dataclasses.replace(A100, name="lab GPT on an A100")
    p = plan(spec, machine, PlanLayout(dp=2, micro_batch=2), 4, cfg.seq_len)
    tokens = 4 * cfg.seq_len
    assert p.mfu * p.step_s * machine.peak * 2 / tokens == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("every", [1, 2, 4])
def test_hfu_follows_recompute_every(every):
    """Full recomputation of every k-th of Llama 3 8B's 32 layers repeats 32 // k layers'
    forward, 2 N_layer + 4 h s a token each, over 6 N + 12 L h s (N: the layers and the head):
    HFU / MFU - 1 is their ratio, and the step's recomputation is 1/k of every layer's."""
    s = 8192
    lay = PlanLayout(dp=8, zero=3, micro_batch=1, recompute="full", recompute_every=every)
    p = plan(LLAMA8, H100, lay, 8, s, "torchtitan-fsdp2")
    model = 6 * (L * LAYER + V * H) + 12 * L * H * s
    again = (L // every) * (2 * LAYER + 4 * H * s)
    assert p.hfu / p.mfu - 1 == pytest.approx(again / model, rel=1e-12)
    whole = plan(LLAMA8, H100, dataclasses.replace(lay, recompute_every=1), 8, s, "torchtitan-fsdp2")
    assert p.time["recompute"] == pytest.approx(whole.time["recompute"] / every, rel=1e-12)


def _stack(base: str, **sharding) -> stacks.Stack:
    return dataclasses.replace(stacks.preset(base), copies=False, sharding=Sharding(**sharding))


def test_a_zero3_step_whose_window_is_shorter_than_its_gathers_exposes_the_difference():
    """Llama 3 8B over 64 A100s at 256 tokens a rank: a layer's gather (its 2-byte weights, and
    its share of the embedding and head, over a 64-rank ring across nodes) outlasts the layer's
    forward and its backward, so each of the 31 prefetched gathers shows what its window leaves,
    the first whole, and every reduction (overlap share 0 here) whole."""
    stack = dataclasses.replace(_stack("pytorch-fsdp1", host_ops=0), grads=0.0, params=1.0)
    lay, k, s = PlanLayout(dp=64, zero=3, micro_batch=1), 64, 256
    p = plan(LLAMA8, A100, lay, 64, s, stack)
    per_layer = (L * LAYER + 2 * V * H) / L
    gather = (k - 1) * ALPHA + (k - 1) / k * 2 * per_layer / BUSBW
    comp = tm.compute(LLAMA8, A100, lay, stack, s, 0, p.inputs[4])
    f, b = comp["layer_forward"], comp["layer_backward"]
    assert gather > b > f  # the window is shorter than the transfer
    want = gather + (L - 1) * (gather - f) + (L - 1) * (gather - b) + L * gather  # 2-byte gradients
    assert p.time["data_comm"] == pytest.approx(want, rel=1e-9)
    long = plan(LLAMA8, A100, PlanLayout(dp=64, zero=3, micro_batch=8), 512, 8192, stack)
    assert long.time["data_comm"] == pytest.approx(gather + L * gather, rel=1e-9)  # the rest hides


def test_a_stack_that_gathers_per_tensor_pays_each_collectives_latency():
    """GPT-3 175B over 1,536 GPUs, DeepSpeed 2021's way (each tensor of 1e5 elements or more
    gathered alone, the host waiting for the device first, nothing hidden here) against one
    gather a layer: the same bytes, but each of a layer's four big matrices (QKV, projection,
    MLP in and out; its biases and norms stay gathered) pays a 1,535-step ring's latency and the
    host's work (6 operations, and for the list of one tensor per rank 2 views per rank) in
    each of the 96 forward and 95 backward gathers of a micro-batch; and a collective to or from
    such a list copies each rank's piece on the device, gather and reduction alike."""
    k = 1536
    lay = PlanLayout(dp=k, zero=3, micro_batch=1, recompute="full", attention="math")
    one = dict(reduce="block", persist=1e5, host_ops=6, rank_ops=2, blocking=True)

    def ds(**sharding):
        return dataclasses.replace(_stack("deepspeed-zero3-2021", **sharding), params=0.0)

    per_tensor = plan(GPT3, A100, lay, k, 2048, ds(gather="tensor", **one))
    per_layer = plan(GPT3, A100, lay, k, 2048, ds(gather="block", **one))
    each = (k - 1) * ALPHA + (DISPATCH + LAUNCH) * 6 + DISPATCH * 2 * k
    assert per_tensor.time["data_comm"] - per_layer.time["data_comm"] == pytest.approx(
        (96 + 95) * (4 - 1) * each, rel=1e-9)
    assert per_tensor.sent["data"] == pytest.approx(per_layer.sent["data"], rel=1e-12)
    copied = plan(GPT3, A100, lay, k, 2048, ds(gather="tensor", rank_kernels=1, **one))
    # each rank's piece copied: a launch on the host and a kernel on the device, per gather;
    # per reduction a kernel on the device (copied into the flat buffer), which shows here as
    # the 96 layers' reductions share the gathers' unhidden window or come last (their host
    # launches hide behind backward)
    assert copied.time["data_comm"] - per_tensor.time["data_comm"] == pytest.approx(
        (96 + 95) * 4 * 2 * k * LAUNCH + 96 * k * LAUNCH, rel=1e-9)


def test_module_hooks_gather_again_for_a_recomputed_forward_and_keep_what_is_reused_soon():
    """DeepSpeed's hooks fire inside the checkpointed forward: under full recomputation each of
    GPT-3 175B's 96 layers gathers its four matrices a third time, and backward then gathers
    again those whose next use lies 1e9 elements or more of other gathered weights away: the
    layer's later matrices twice (their recomputed forward, their backward), so QKV, the
    projection and the MLP's first matrix, not the MLP's second (nothing in between). Without
    recomputation in its hooks, backward gathers all four in 95 layers. Counted in bytes sent."""
    k = 768
    lay = PlanLayout(dp=k, zero=3, micro_batch=2, recompute="full", attention="math")
    base = dict(gather="tensor", reduce="tensor", persist=1e5, blocking=True)
    hooks = plan(GPT3, A100, lay, 2 * k, 2048, _stack("deepspeed-zero3-2021", recompute_gathers=True,
                                                      reuse=1e9, **base))
    plain = plan(GPT3, A100, lay, 2 * k, 2048, _stack("deepspeed-zero3-2021", **base))
    later = [sum(BIG[i + 1:]) for i in range(4)]
    assert [2 * r >= 1e9 for r in later] == [True, True, True, False]
    extra = 96 * sum(BIG) + 96 * sum(BIG[:3]) - 95 * sum(BIG)
    # the planner's units: a layer's tensors carry the embedding and head's share (psi / L)
    scale = rank_params(GPT3, lay, 0)[0] / 96 / sum(n for _, n in GPT3.layer_tensors(1))
    assert hooks.sent["data"] - plain.sent["data"] == pytest.approx(
        (k - 1) / k * 2 * extra * scale, rel=1e-9)
    small = megatron_gpt("GPT 6.7B", 32, 4096, 32)  # a layer's weights well under 1e9 elements
    kept = plan(small, A100, lay, 2 * k, 2048, _stack("deepspeed-zero3-2021", recompute_gathers=True,
                                                      reuse=1e9, **base))
    never = plan(small, A100, lay, 2 * k, 2048, _stack("deepspeed-zero3-2021", recompute_gathers=True,
                                                       **base))  # reuse unbounded: all kept
    assert kept.sent["data"] == pytest.approx(never.sent["data"], rel=1e-12)


def test_a_module_as_large_as_the_live_limit_prefetches_nothing():
    """DeepSpeed prefetches the next module's weights only while fewer than 1e9 elements are
    gathered: MT-NLG 530B's QKV (1.26e9), MLP in and MLP out (1.68e9 each) hold more, so the
    projection (after QKV), MLP out (after MLP in) and the next layer's QKV (after MLP out) wait
    whole; GPT-3 175B's matrices are all smaller and every gather is prefetched."""
    w = 20480
    big530 = [(3 * w * w, 1), (w * w, 1), (4 * w * w, 1), (4 * w * w, 1)]
    assert data_comm.prefetched(big530, 1e9) == [False, False, True, False]
    assert data_comm.prefetched([(n, 1) for n in BIG], 1e9) == [True] * 4
    mtnlg = megatron_gpt("MT-NLG 530B", 105, w, 128)
    lay = PlanLayout(dp=1120, zero=3, micro_batch=2, recompute="full", attention="math")
    base = dict(gather="tensor", reduce="tensor", persist=1e5, blocking=True)
    limited = plan(mtnlg, A100, lay, 2240, 2048, _stack("deepspeed-zero3-2021", live=1e9, **base))
    free = plan(mtnlg, A100, lay, 2240, 2048, _stack("deepspeed-zero3-2021", **base))
    assert limited.time["data_comm"] > free.time["data_comm"]
    assert limited.sent["data"] == pytest.approx(free.sent["data"], rel=1e-12)


def test_the_tensors_kept_gathered_are_gathered_again_after_each_step_a_copy_per_rank():
    """DeepSpeed 2021 partitions every parameter after backward and gathers the kept ones (under
    1e5 elements: GPT-3 175B's two norms' weights and biases and its four biases, 8 a layer)
    again after the step, copying each one's piece out of each of the 1,536 ranks' (3 views and
    a copy: 4 trips through the dispatcher and a launch), all exposed."""
    k = 1536
    lay = PlanLayout(dp=k, zero=3, micro_batch=1, recompute="full", attention="math")
    base = dict(gather="tensor", reduce="tensor", persist=1e5, blocking=True)
    after = plan(GPT3, A100, lay, k, 2048, _stack("deepspeed-zero3-2021", step_rank_ops=4, **base))
    before = plan(GPT3, A100, lay, k, 2048, _stack("deepspeed-zero3-2021", **base))
    assert after.time["data_comm"] - before.time["data_comm"] == pytest.approx(
        8 * 96 * k * (4 * DISPATCH + LAUNCH), rel=1e-9)


def test_sharding_alone_stops_paying_at_a_fixed_batch():
    """GPT-3 175B at a fixed batch of 1,536 under DeepSpeed 2021's ZeRO-3: doubling the GPUs
    from 768 to 1,536 halves each GPU's compute but not the gathers (the same bytes a rank, a
    longer ring), so the step shrinks by far less than half; under Megatron's 3D layout of the
    same GPUs it nearly halves."""
    def step(stack, **layout):
        lay = PlanLayout(recompute="full", attention="math", **layout)
        return plan(GPT3, A100, lay, 1536, 2048, stack).step_s

    zero3 = [step("deepspeed-zero3-2021", dp=n, zero=3, micro_batch=1536 // n) for n in (768, 1536)]
    ptdp = [step("megatron-lm-2021", dp=n // 96, tp=8, pp=12, schedule="interleaved",
                 virtual_stages=2) for n in (768, 1536)]
    assert zero3[1] > 0.7 * zero3[0]
    assert ptdp[1] < 0.6 * ptdp[0]


def test_memory_follows_what_the_stack_keeps():
    """What ran fits because the terms are the stack's: OPT-175B's recomputed layers keep their
    input cut over the 8 tp ranks (--distribute-checkpointed-activations), 8 x 2048 x 12288 x 2
    bytes x 7/8 fewer in each of 95 layers (the layer being recomputed holds all of its
    activations either way); DeepSpeed gathers the largest submodule (the MLP's
    first matrix, 4h x h) and a 5e7-element prefetch bucket, not two layers, and stages two
    5e8-element gradient buckets; torchtitan's op policy keeps a layer's input, Q and V, the
    attention output, the MLP's first matmul and its output."""
    opt = next(r for r in ROWS if r.source.key == "opt")
    cut = opt.plan()
    whole = opt.plan(layout=dataclasses.replace(opt.layout, distribute_saved=False))
    assert whole.memory["activations"] - cut.memory["activations"] == pytest.approx(
        95 * 8 * 2048 * 12288 * 2 * 7 / 8, rel=1e-9)
    assert cut.fits and not whole.fits
    gpt3, lay = megatron_gpt("GPT-3 175B", 96, 12288, 96), PlanLayout(dp=64, zero=3)
    ds = buffers(gpt3, lay, 2048, stacks.preset("deepspeed-zero3"))
    assert ds == pytest.approx(2 * (4 * 12288 * 12288 + 4 * 12288 + 5e7) + 2 * 2 * 5e8)
    fsdp = buffers(gpt3, lay, 2048, stacks.preset("pytorch-fsdp1"))
    assert fsdp == pytest.approx(2 * 2 * gpt3.layer_params())
    s, b = 8192, 2
    kept = 2 * s * b * (H + H + KV + H + F + H) + 4 * 32 * s * b
    assert op_policy_kept(LLAMA8, PlanLayout(recompute="selective"), b, s) == kept
    titan = stacks.preset("torchtitan-fsdp2")
    assert layer_bytes(LLAMA8, PlanLayout(recompute="selective"), b, s, titan)[0] == kept


def test_every_published_source_carries_its_first_score_and_the_commit_it_was_scored_at():
    """Every source of the rows has a record: rows, mean absolute and signed error, share
    inside, a 40-hex commit, and whether it was blind; the sources added after the planner was
    built (at or after 153af77) were scored blind, at a commit whose rows already held them
    (``dlab/theory/plan/rows.py`` until the rows were split by source into ``rows/``)."""
    blind = published.blind_scores()
    sources = {r.source.key: r.source for r in ROWS}
    assert set(blind) == set(sources)
    for key, b in blind.items():
        assert len(b["commit"]) == 40 and int(b["commit"], 16) >= 0, key
        assert b["rows"] == sum(r.source.key == key for r in ROWS), key
        assert {"mean_abs", "signed", "inside", "blind"} <= set(b)
    assert {k for k, b in blind.items() if b["blind"]} >= {"bigscience", "mt-nlg", "opt"}
    root = Path(published.__file__).resolve().parents[3]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: the commits cannot be read")
    for key, b in blind.items():
        if b["blind"]:
            where = ["dlab/theory/plan/rows.py", "dlab/theory/plan/rows/"]
            found = subprocess.run(["git", "-C", str(root), "grep", "-l", "-F", f'Source("{key}"',
                                    b["commit"], "--", *where], capture_output=True, text=True)
            assert found.returncode == 0 and found.stdout.strip(), key


def test_a_blind_score_is_written_once(tmp_path):
    row = {"key": "x", "source": "X", "generation": "A100", "sustained": 0.8}
    results = [{**row, "throughput_error": 0.1, "inside": True},
               {**row, "throughput_error": -0.3, "inside": False}]
    path = tmp_path / "blind.json"
    got = published.record_blind(results, ["x"], "a" * 40, path=path)
    assert got["x"] == {"commit": "a" * 40, "rows": 2, "mean_abs": 0.2, "signed": -0.1, "inside": 0.5,
                        "blind": True, "note": ""}
    with pytest.raises(ValueError, match="already recorded"):
        published.record_blind(results, ["x"], "b" * 40, path=path)
    assert json.loads(path.read_text())["sources"]["x"]["commit"] == "a" * 40
