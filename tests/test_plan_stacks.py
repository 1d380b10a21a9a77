"""What a stack's own choices cost in the planner's step, each against a count written here from
the collectives' and the memory's own prices: the pipeline transfer split over the
tensor-parallel ranks (Megatron-LM 2021-22, DeepSpeed's pipeline engine), DeepSpeed's
BF16_Optimizer adding every micro-batch's gradients into fp32 ones by a pass of its own,
async tensor parallelism hiding each collective it decomposes behind that collective's GEMMs,
and llm-foundry's Triton FlashAttention."""
from __future__ import annotations

import dataclasses

import pytest

from dlab.plan import PlanLayout, clusters, models, plan, stacks
from dlab.theory.plan import collectives
from dlab.theory.plan.cluster import TRITON_FA
from dlab.theory.plan.memory import rank_params
from dlab.theory.plan.predict import sustained
from dlab.theory.plan.time import HP_GRAD_PASS, Knobs, compute

A100 = clusters.preset("a100-80gb")
GPT175 = models.preset("gpt3-175b")


def _pipeline(sequence_parallel: bool):
    """tp 8 x pp 4 on DGX A100s: each stage a node, its pipeline neighbour in the next, 16
    micro-batches of one sequence of 2,048."""
    return PlanLayout(tp=8, pp=4, micro_batch=1, sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("name", ["megatron-lm-2021", "megatron-deepspeed"])
def test_a_stack_that_splits_the_boundary_sends_a_tth_and_gathers_what_it_receives(name):
    """Narayanan et al. 2021, sec. 4.1: each of the t ranks sends its 1/t of the b s h activation
    (and of its gradient) over its own NIC, and the receiving stage all-gathers the slices over
    NVLink. Per micro-batch a middle stage sends two tensors and receives two; it waits for
    ``pp_transfers`` of the p2p hops (2 paired, 4 where each send and receive blocks alone) and
    for the two gathers; nothing hides them in these stacks. Under sequence parallelism the
    boundary is split already and nothing is gathered."""
    stack = stacks.preset(name)
    whole = dataclasses.replace(stack, pp_scatter=False)
    m, t = 16, 8
    act = 2 * 1 * 2048 * GPT175.d_model
    split, sent_whole = (plan(GPT175, A100, _pipeline(False), m, 2048, s) for s in (stack, whole))
    gather = collectives.collective_time(A100, "all_gather", act, t)
    waits = 2 * m * stack.pp_transfers / 2

    def hop(nbytes):  # to the next node: the stage's ranks are 8 apart
        return collectives.collective_time(A100, "p2p", nbytes, 2, t)

    assert split.time["pp_comm"] == pytest.approx(waits * hop(act / t) + 2 * m * gather, rel=1e-9)
    assert sent_whole.time["pp_comm"] == pytest.approx(waits * hop(act), rel=1e-9)
    assert split.sent["pp"] == pytest.approx(2 * m * (act / t + (t - 1) / t * act), rel=1e-9)
    assert sent_whole.sent["pp"] == pytest.approx(2 * m * act, rel=1e-9)
    sp = [plan(GPT175, A100, _pipeline(True), m, 2048, s) for s in (stack, whole)]
    assert sp[0].time["pp_comm"] == pytest.approx(sp[1].time["pp_comm"], rel=1e-12)
    assert sp[0].sent["pp"] == pytest.approx(2 * m * act / t, rel=1e-9)


def test_the_bf16_optimizer_adds_each_micro_batchs_gradients_into_fp32_by_a_pass_of_its_own():
    """DeepSpeed's BF16_Optimizer (bf16 with ZeRO stage 0, BigScience's BLOOM) runs
    ``hp_grad.add_(lp.grad.to(fp32))`` over every parameter after each micro-batch's backward:
    18 bytes a parameter read and written at the memory's streaming rate, in each micro-batch's
    compute (and so in the bubble, which scales it), and holds the bf16 gradients beside the fp32
    ones. With 16-bit gradients there is no fp32 copy to add into, and a stack that accumulates
    in the GEMMs (Megatron-LM's) pays nothing."""
    lay = PlanLayout(dp=4, tp=8, pp=4, zero=1, micro_batch=1, recompute="full",
                     precision="bf16-fp32-grads")
    m = 16
    ds = stacks.preset("megatron-deepspeed")
    fused = dataclasses.replace(ds, hp_grad_pass=False)
    with_pass, without = (plan(GPT175, A100, lay, 4 * m, 2048, s) for s in (ds, fused))
    params = sum(rank_params(GPT175, lay, 0))  # the first and the last stage hold as many layers
    per_micro = HP_GRAD_PASS * params / (A100.hbm * A100.kernels.hbm)
    assert HP_GRAD_PASS == 2 + 4 + 3 * 4
    assert with_pass.time["compute"] - without.time["compute"] == pytest.approx(m * per_micro, rel=1e-6)
    assert with_pass.time["bubble"] > without.time["bubble"]
    # and it keeps the bf16 gradients autograd wrote beside the fp32 ones: 2 + 4 bytes a parameter
    assert with_pass.memory["gradients"] - without.memory["gradients"] == pytest.approx(2 * params)
    assert without.memory["gradients"] == pytest.approx(4 * params)
    bf16 = dataclasses.replace(lay, precision="bf16")
    assert plan(GPT175, A100, bf16, 4 * m, 2048, ds).time["compute"] == pytest.approx(
        plan(GPT175, A100, bf16, 4 * m, 2048, fused).time["compute"], rel=1e-12)


@pytest.mark.parametrize("micro_batch", [1, 8])
def test_async_tensor_parallelism_hides_each_collective_it_decomposes_behind_its_own_gemms(micro_batch):
    """Llama 3 8B over tp 8 in one DGX H100, sequence parallel, one micro-batch. PyTorch's
    micro-pipelining runs forward's all-gathers with the GEMMs they feed (QKV; the MLP's gate and
    up) and its reduce-scatters with the GEMMs that feed them (the output projection; the MLP's
    last), and backward's all-gathers of those two outputs' gradients with their input-gradient
    GEMMs: each hides what its GEMMs cover (min(collective, GEMMs)) and no more, and backward's
    reduce-scatters of summed input gradients block. Against the same stack with nothing
    hidden, the difference is the hidden seconds, which the interference charges a share of.
    Without sequence parallelism there is nothing to decompose (all-reduces)."""
    h100, spec = clusters.preset("h100-sxm"), models.preset("llama3-8b")
    lay = PlanLayout(tp=8, sequence_parallel=True, micro_batch=micro_batch, precision="bf16")
    fused = stacks.preset("torchtitan-asynctp")
    blocking = dataclasses.replace(fused, tp_async=0.0)
    gemm = compute(spec, h100, lay, fused, 8192, 0, Knobs(sustained=sustained(h100)))["gemms"]
    act = 2 * micro_batch * 8192 * spec.d_model
    ag, rs = (collectives.collective_time(h100, op, act, 8) for op in ("all_gather", "reduce_scatter"))
    pairs = [(ag, gemm["qkv"]), (ag, gemm["mlp gate"] + gemm["mlp up"]), (rs, gemm["projection"]),
             (rs, gemm["mlp out"]), (ag, gemm["projection input grad"]),
             (ag, gemm["mlp out input grad"])]
    assert any(c > w for c, w in pairs) and any(c < w for c, w in pairs)  # both regimes priced
    hidden = spec.n_layer * sum(min(c, w) for c, w in pairs)
    a, b = (plan(spec, h100, lay, micro_batch, 8192, s) for s in (fused, blocking))
    assert b.time["tp_comm"] - a.time["tp_comm"] == pytest.approx(hidden, rel=1e-9)
    assert a.time["interference"] - b.time["interference"] == pytest.approx(0.1 * hidden, rel=1e-9)
    plain = dataclasses.replace(lay, sequence_parallel=False)
    assert plan(spec, h100, plain, micro_batch, 8192, fused).time["tp_comm"] == pytest.approx(
        plan(spec, h100, plain, micro_batch, 8192, blocking).time["tp_comm"], rel=1e-12)


@pytest.mark.parametrize("cluster", ["a100-80gb", "h100-sxm"])
def test_mosaicmls_triton_flashattention_runs_at_flashattention_2s_rate_over_its_factor(cluster):
    """llm-foundry's ``attn_impl: triton`` (``pytorch-fsdp1-triton``) differs from FSDP1 with
    FlashAttention-2 in its attention kernel alone: the attention core's forward and backward
    take ``TRITON_FA`` times FlashAttention-2's seconds (less a launch each), every other
    operation the same."""
    gpu, spec = clusters.preset(cluster), models.preset("llama3-8b")
    lay = PlanLayout(dp=8, zero=3, micro_batch=1, precision="bf16")
    knobs = Knobs(sustained=sustained(gpu))
    ops = {name: compute(spec, gpu, lay, stacks.preset(name), 8192, 0, knobs)
           for name in ("pytorch-fsdp1", "pytorch-fsdp1-triton")}
    fa2, triton = ops["pytorch-fsdp1"], ops["pytorch-fsdp1-triton"]
    launch = gpu.kernels.launch
    for key in ("attention_forward", "attention_backward"):
        assert triton[key] - launch == pytest.approx(TRITON_FA * (fa2[key] - launch), rel=1e-9)
    assert triton["gemms"] == fa2["gemms"]
    assert triton["layer_forward"] - triton["attention_forward"] == pytest.approx(
        fa2["layer_forward"] - fa2["attention_forward"], rel=1e-12)
