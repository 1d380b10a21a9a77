"""Activation recomputation (``recompute`` = none | selective | full, ``recompute_every``):

- it changes nothing but memory and FLOPs: every mode gives the same loss and gradients in one
  process (GPT and MoE GPT), and every strategy that runs the GPT trains like ``single`` without
  recomputation (pipeline-1f1b and ep by default, tp with sequence parallelism through nd's
  case in tests/test_nd_parity.py; tp, zero3, ddp and more under slow);
- ``ActivationMeter`` counts what it keeps, equal to the byte to the count derived from the code
  (``dlab.theory.activations``); full recompute keeps exactly the blocks' inputs;
- ``hardware_flops_per_token`` adds exactly the recomputed forwards, as ``FlopCounterMode``
  counts them; runs report HFU beside MFU, held to a count by hand from the module's shapes
  and the recomputation flags its blocks run with (not the formula ``train.py`` uses);
- a checkpoint loads under any recomputation setting.
"""
from __future__ import annotations

import pytest
import torch
from helpers import assert_same_training, losses
from torch.utils.flop_counter import FlopCounterMode

import dlab
from dlab import models
from dlab.core.config import RunConfig
from dlab.core.metrics import ActivationMeter
from dlab.runtime import checkpoint
from dlab.theory.activations import activation_bytes
from dlab.worker.validate import problems

MODES = [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]


def _forward_backward(name: str, opts: dict, idx, tgt):
    model = models.build(name, opts, 0)
    loss = model.criterion(model(idx), tgt)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("core", ["fused", "math"])
@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_every_mode_gives_the_same_loss_and_gradients(name, core):
    opts = {"n_layer": 3, "d_model": 32, "n_head": 4, "seq_len": 16, "attention_core": core}
    idx, tgt = torch.randint(0, 256, (2, 2, 16))
    want_loss, want = _forward_backward(name, opts, idx, tgt)
    for recompute, every in MODES[1:]:
        loss, grads = _forward_backward(
            name, {**opts, "recompute": recompute, "recompute_every": every}, idx, tgt)
        assert loss == pytest.approx(want_loss, abs=1e-6), (recompute, every)
        assert all(g is not None for g in grads.values()), (recompute, every)
        worst = max((grads[n] - want[n]).abs().max().item() for n in want)
        assert worst <= 1e-6, (recompute, every, worst)


def test_a_block_whose_input_needs_no_gradient_still_trains_its_parameters():
    """Reentrant checkpointing only differentiates towards inputs that require a gradient: with
    the embedding frozen, block 0's parameters must still get theirs."""
    idx, tgt = torch.randint(0, 256, (2, 2, 16))
    grads = []
    for recompute in ("none", "full"):
        model = models.build("gpt", {"seq_len": 16, "recompute": recompute}, 0)
        model.embed.requires_grad_(False)
        model.criterion(model(idx), tgt).backward()
        grads.append(model.blocks[0].attn.q.weight.grad)
    assert grads[1] is not None and torch.allclose(grads[0], grads[1], atol=1e-7)


SHAPES = [  # (model options, micro-batch)
    ({"n_layer": 3, "d_model": 32, "n_head": 4, "seq_len": 16}, 2),
    ({"n_layer": 2, "d_model": 48, "n_head": 3, "seq_len": 24, "d_ff": 80, "tied": False}, 3),
]


def _tokens(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets in storages of their own: the meter counts an index tensor's whole
    storage, and (2, b, s) unpacked would be one storage shared by both."""
    return torch.randint(0, 256, (b, s)), torch.randint(0, 256, (b, s))


def _measure(opts: dict, b: int, backward: bool = False) -> tuple[ActivationMeter, int, dict]:
    """Saved bytes at the end of a forward (and the meter, with the backward inside ``track()``
    when asked); the storages of every block's input."""
    model = models.build("gpt", opts, 0)
    idx, tgt = _tokens(b, opts["seq_len"])
    inputs = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda _m, args, i=i: inputs.__setitem__(i, args[0]))
    meter = ActivationMeter(model.parameters())
    with meter.track():
        loss = model.criterion(model(idx), tgt)
        forward = meter.peak
        if backward:
            loss.backward()
    return meter, forward, inputs


@pytest.mark.parametrize("opts,b", SHAPES, ids=["tied", "untied-d_ff80"])
@pytest.mark.parametrize("core", ["fused", "math"])
def test_the_meter_counts_what_the_formula_names(opts, b, core):
    cases = MODES if core == "fused" else MODES[:3]
    for recompute, every in cases:
        cfg = {**opts, "attention_core": core, "recompute": recompute, "recompute_every": every}
        meter, forward, _ = _measure(cfg, b, backward=True)
        want = activation_bytes(cfg, b)
        assert forward == want["total"], (recompute, every, forward, want["total"])
        # backward inside track(): the recomputed activations come back, one region at a time
        assert meter.peak == max(want["total"], want["backward_peak"]), (recompute, every)
        assert meter.current == 0


def test_full_recompute_keeps_exactly_the_block_inputs():
    """Measured: what full recompute keeps is the embedding's, the head's and the loss's saved
    tensors (measured on their own) and one input per block, nothing else."""
    opts, b = SHAPES[0]
    full = {**opts, "recompute": "full"}
    _, kept, inputs = _measure(full, b)
    model = models.build("gpt", full, 0)
    idx, tgt = _tokens(b, opts["seq_len"])
    outside = ActivationMeter(model.parameters())
    with outside.track():
        model.criterion(model.head(model.embed(idx)), tgt)
    assert len(inputs) == opts["n_layer"]
    assert kept == outside.peak + sum(x.untyped_storage().nbytes() for x in inputs.values())
    assert kept - outside.peak == opts["n_layer"] * 4 * b * opts["seq_len"] * opts["d_model"]


def test_selective_recompute_removes_the_attention_score_term():
    """The math core keeps the s x s softmax, 4 a s^2 b bytes a layer (the paper's 5 a s^2 b in
    fp16 with dropout), and selective recomputation removes exactly that; the fused core keeps
    only a log-sum-exp per row, a s b floats."""
    opts, b = SHAPES[0]
    a, s, n_layer = opts["n_head"], opts["seq_len"], opts["n_layer"]
    saved = {(core, r): _measure({**opts, "attention_core": core, "recompute": r}, b)[1]
             for core in ("fused", "math") for r in ("none", "selective")}
    assert saved["math", "none"] - saved["math", "selective"] == n_layer * 4 * a * s * s * b
    assert saved["fused", "none"] - saved["fused", "selective"] == n_layer * 4 * a * s * b
    assert saved["math", "selective"] == saved["fused", "selective"]


def _counted_flops(name: str, opts: dict, idx, tgt) -> int:
    model = models.build(name, opts, 0)
    with FlopCounterMode(display=False) as counter:
        model.criterion(model(idx), tgt).backward()
    return counter.get_total_flops()


def _vector_params(block, top_k: int | None = None) -> int:
    """1-D parameters of a block a token meets (norms, biases): FlopCounterMode counts matmuls
    only, while the 2-per-parameter convention of ``flops_per_token`` counts these too."""
    n = sum(p.numel() for name, p in block.named_parameters()
            if p.dim() == 1 and ".experts." not in f".{name}")
    if top_k is not None:
        n += top_k * sum(p.numel() for p in block.mlp.experts[0].parameters() if p.dim() == 1)
    return n


@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_hardware_flops_add_exactly_the_recomputed_forwards(name):
    """Counted by ``FlopCounterMode`` over forward + backward: recomputation adds what
    ``recompute_flops_per_token`` says, less the bias and norm FLOPs it does not count. The math
    core, because the counter does not see inside the CPU's fused attention kernel."""
    opts = {"n_layer": 3, "d_model": 32, "n_head": 4, "seq_len": 16, "attention_core": "math"}
    b = 2
    idx, tgt = torch.randint(0, 256, (2, b, opts["seq_len"]))
    tokens = b * opts["seq_len"]
    base = _counted_flops(name, opts, idx, tgt)
    block = models.build(name, opts, 0).blocks[0]
    cfg = models.model_config(name, opts)
    assert cfg.hardware_flops_per_token() == cfg.flops_per_token()
    for recompute, every in MODES[1:]:
        extra = _counted_flops(name, {**opts, "recompute": recompute, "recompute_every": every},
                               idx, tgt) - base
        rc_cfg = models.model_config(name, {**opts, "recompute": recompute, "recompute_every": every})
        formula = rc_cfg.hardware_flops_per_token() - rc_cfg.flops_per_token()
        assert formula == rc_cfg.recompute_flops_per_token()
        if recompute == "selective":  # q k^T and P v: 2 s d each per token and layer
            assert extra == tokens * cfg.n_layer * 4 * opts["seq_len"] * opts["d_model"]
            assert extra == tokens * formula
        else:
            blocks = len(range(every - 1, cfg.n_layer, every))
            uncounted = 2 * blocks * _vector_params(block, cfg.top_k if name == "moe" else None)
            assert extra == tokens * (formula - uncounted), (every, extra, tokens * formula)


def test_hfu_formula_for_full_recompute_adds_one_forward_of_the_blocks():
    cfg = models.model_config("gpt", {"recompute": "full"})
    block_forward = 2 * cfg.block_params() + 4 * cfg.d_model * cfg.seq_len
    assert cfg.hardware_flops_per_token() == cfg.flops_per_token() + cfg.n_layer * block_forward
    assert cfg.hardware_flops_per_token("full", 2) == cfg.flops_per_token() + block_forward  # of 2
    assert cfg.hardware_flops_per_token("none") == cfg.flops_per_token()


# --- options and checkpoints --------------------------------------------------------------------

@pytest.mark.parametrize("options,says", [
    ({"recompute": "yes"}, "model option recompute must be one of 'none', 'selective', 'full'"),
    ({"recompute": "full", "recompute_every": 0}, "recompute_every must be at least 1"),
    ({"recompute": "selective", "recompute_every": 2}, "applies to recompute='full' only"),
    ({"recompute": "full", "recompute_every": 3}, "more than n_layer=2: no block would be"),
    ({"attention_core": "flash"}, "attention_core must be one of 'fused', 'math'"),
])
def test_bad_recompute_options_are_refused_saying_what_to_change(options, says):
    found = problems(RunConfig("single", world_size=1, model_options={"n_layer": 2, **options}))
    assert any(says in p for p in found), found


def _checkpoint(tmp_path, **model_options):
    cfg = RunConfig("single", world_size=1, model_options=model_options)
    model = models.build("gpt", cfg.model_options, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class Replica:
        replicated = True

        def checkpoint_state(self):
            return checkpoint.replica_state(model, optimizer)

    root = tmp_path / "run" / "checkpoints"
    checkpoint.Checkpointer(root, 0, 1, meta=checkpoint.run_meta(cfg)).save(Replica(), 2)
    return checkpoint.latest(root)


def test_a_checkpoint_loads_under_any_recompute_setting(tmp_path):
    saved = _checkpoint(tmp_path / "a", recompute="none")
    for opts in ({"recompute": "full", "recompute_every": 2}, {"recompute": "selective"},
                 {"attention_core": "math"}):
        cfg = RunConfig("single", world_size=1, steps=4, resume=str(saved), model_options=opts)
        assert problems(cfg) == [], (opts, problems(cfg))
    saved = _checkpoint(tmp_path / "b", recompute="full")
    assert problems(RunConfig("single", world_size=1, steps=4, resume=str(saved))) == []
    # a difference in the parameters is still refused
    found = problems(RunConfig("single", world_size=1, steps=4, resume=str(saved),
                         model_options={"n_layer": 1}))
    assert any("checkpoint has n_layer=2, this run n_layer=1" in p for p in found), found


# --- every strategy that runs the GPT, against single without recomputation ---------------------

# The configs of test_tensor_parity and test_expert_parity, so a session shares their references.
GPT = {"model": "gpt", "batch_size": 8, "steps": 3, "optimizer": "sgd",
       "model_options": {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 32}}
MOE = {"model": "moe", "batch_size": 8, "steps": 4, "optimizer": "sgd",
       "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32, "n_expert": 4,
                         "top_k": 1}}
TP_SP = {"tp": 2, "sequence_parallel": True}
slow = pytest.mark.slow

CASES = [  # (strategy, options, base config, recompute, recompute_every)
    ("pipeline-1f1b", {}, GPT, "full", 1),
    ("ep", {}, MOE, "full", 1),
    # slow where another default case runs the same path: nd's ZeRO-3 x TP+SP full recompute
    # (tests/test_nd_parity.py) trains the tensor-parallel GPT recomputed, as tp does
    pytest.param("tp", TP_SP, GPT, "full", 1, marks=slow),
    pytest.param("tp", TP_SP, GPT, "selective", 1, marks=slow),
    pytest.param("zero3", {}, GPT, "full", 1, marks=slow),
    pytest.param("ddp", {"bucket_cap_mb": 0.05}, GPT, "full", 1, marks=slow),
    pytest.param("tp", {"tp": 2}, GPT, "full", 2, marks=slow),
    pytest.param("zero3", {}, GPT, "selective", 1, marks=slow),
    pytest.param("pipeline-1f1b", {}, GPT, "selective", 1, marks=slow),
    pytest.param("pipeline-zb-h1", {}, GPT, "full", 1, marks=slow),
    pytest.param("ddp", {"bucket_cap_mb": 0.05}, GPT, "selective", 1, marks=slow),
    pytest.param("ep", {}, MOE, "selective", 1, marks=slow),
    pytest.param("cp", {}, GPT, "full", 1, marks=slow),
    pytest.param("cp", {}, GPT, "selective", 1, marks=slow),
    pytest.param("cp", {}, GPT, "none", 1, marks=slow),
    pytest.param("torch-fsdp2", {}, GPT, "full", 1, marks=slow),
    pytest.param("torch-tp", TP_SP, GPT, "full", 1, marks=slow),
]


def _hand_counted_flops(name: str, opts: dict) -> tuple[int, int]:
    """(the model's training FLOPs per token, the recomputed forwards' FLOPs per token), counted
    from the built module's parameter shapes and the recomputation flags its blocks run with,
    apart from ``GPTConfig``'s formulas (which ``train.py`` uses for MFU and HFU). PaLM's
    convention (Chowdhery et al. 2022, app. B): 2 FLOPs per parameter a token is multiplied by
    forward and 4 backward (every parameter but the position table; a MoE block's top_k
    experts of n_expert), and 4 d T a layer forward for attention's scores and weighted sum."""
    model = models.build(name, opts, 0)
    d, t, top_k = opts["d_model"], opts["seq_len"], opts.get("top_k", 1)
    attention = 4 * d * t

    def per_token(module) -> int:
        own = sum(p.numel() for n, p in module.named_parameters() if ".experts." not in f".{n}")
        experts = getattr(getattr(module, "mlp", None), "experts", None)
        return own + (top_k * sum(p.numel() for p in experts[0].parameters()) if experts else 0)

    outside = sum(p.numel() for n, p in model.named_parameters()
                  if not n.startswith("blocks.") and n != "embed.pos.weight")
    weights = outside + sum(per_token(b) for b in model.blocks)
    model_flops = 6 * weights + 3 * attention * len(model.blocks)
    recomputed = sum(2 * per_token(b) + attention for b in model.blocks if b.recompute)
    recomputed += sum(attention for b in model.blocks if b.attn.recompute)
    return model_flops, recomputed


def _id(case) -> str:
    strategy, options, base, recompute, every = case
    return f"{strategy}{options or ''}-{base['model']}-{recompute}{every if every > 1 else ''}"


@pytest.mark.parametrize("strategy,options,base,recompute,every", CASES,
                         ids=[_id(c.values if hasattr(c, "values") else c) for c in CASES])
def test_strategy_with_recompute_trains_like_single(strategy, options, base, recompute, every,
                                                    runs_dir, reference):
    world_size = 2
    config = {**base, "model_options": {**base["model_options"], "recompute": recompute,
                                        "recompute_every": every}}
    run = dlab.launch(strategy, world_size, runs_dir=runs_dir, wait=True, save_final=True,
                      options=options, **config)
    assert_same_training(run, reference(**base))
    cfg = models.model_config(base["model"], config["model_options"])
    model_flops, recomputed = _hand_counted_flops(base["model"], config["model_options"])
    for r in range(world_size):
        assert losses(run, r) == losses(run, 0)
        for m in run.metrics(r):
            assert m["hfu"] == pytest.approx((1 + recomputed / model_flops) * m["mfu"], rel=1e-12)
    if strategy in ("tp", "cp"):  # the tensor-, sequence- and context-parallel shares, exactly
        tp, sp = options.get("tp", 1), options.get("sequence_parallel", False)
        cp = world_size if strategy == "cp" else 1
        b = base["batch_size"] // (world_size // tp // cp)
        want = activation_bytes(cfg, b, tp=tp, sp=sp, cp=cp)["total"]
        assert all(m["memory"]["activations"] == want for r in range(world_size)
                   for m in run.metrics(r))
    if strategy == "ep":  # the all-to-alls ran again in backward, on both ranks alike
        per_layer = {"none": 6, "selective": 6, "full": 10}[recompute]  # 4 forward + 2 backward
        for r in range(world_size):
            calls = [m["comm_by_op"]["all_to_all"]["calls"] for m in run.metrics(r)]
            assert calls == [cfg.n_layer * per_layer] * len(calls), (r, calls)
    if recompute != "none":
        assert "HFU" in str(run.summary())
