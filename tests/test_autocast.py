"""PyTorch's own mixed precision beside notebook 01's hand-rolled one
(``dlab.runtime.mixed_precision.AutocastTrainer``, ``op_dtypes``) and the CPU allocator's record
of a block (``dlab.core.metrics.AllocatorPeak``):

- under CPU autocast the parameters and their gradients stay fp32, and a bf16 run follows the
  fp32 run's losses, closer than the hand-rolled bf16 run (which rounds every tensor);
- fp16 autocast without a scaler loses every small gradient (the 16-bit activation gradients
  underflow before the cast back to fp32); ``torch.amp.GradScaler("cpu")`` skips an overflowed
  step, halves its scale, and trains;
- ``GradScaler`` and ``LossScaler`` take the same decisions on the same gradients;
- the model state is 16 bytes a parameter, split 4 + 4 + 8 (no master beside fp32 weights);
- ``op_dtypes`` sees autocast's casts, matmuls in bf16 and the loss in fp32;
- ``AllocatorPeak`` gives the peak and the bytes still held of a block of known allocations,
  leaves out what the block frees of older memory, and writes nothing to stderr; over the GPT's
  forward and loss, its peak is the saved tensors plus the logits, b s V fp32 values, which the
  loss reads and no saved-tensor count holds.
"""
from __future__ import annotations

import pytest
import torch

from dlab.core.metrics import ActivationMeter, AllocatorPeak
from dlab.core.precision import LossScaler
from dlab.models.data import TokenData
from dlab.models.gpt import GPT, GPTConfig
from dlab.runtime.mixed_precision import AutocastTrainer, MixedPrecisionTrainer, op_dtypes

CFG = GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4)
DATA = TokenData(8, CFG.seq_len, 0)


def test_parameters_and_gradients_stay_fp32_and_bf16_follows_fp32_closer_than_hand_rolled():
    runs = {"fp32": MixedPrecisionTrainer(CFG, "fp32", lr=3e-3),
            "hand": MixedPrecisionTrainer(CFG, "bf16", lr=3e-3),
            "autocast": AutocastTrainer(CFG, "bf16", lr=3e-3)}
    losses = {name: [t.step([DATA.global_batch(s)])["loss"] for s in range(6)]
              for name, t in runs.items()}
    assert losses["fp32"][-1] < losses["fp32"][0] - 0.3
    gap = {name: max(abs(a - b) for a, b in zip(losses["fp32"], losses[name]))
           for name in ("hand", "autocast")}
    assert 0 < gap["autocast"] < gap["hand"] < 0.05, gap
    t = runs["autocast"]
    assert all(p.dtype == torch.float32 for p in t.params)
    assert all(g.dtype == torch.float32 for g in t.gradients())


def test_fp16_underflows_without_a_scaler_and_trains_with_gradscaler():
    start = [p.detach().clone() for p in AutocastTrainer(CFG, "fp16").params]
    plain = AutocastTrainer(CFG, "fp16", loss_weight=2.0 ** -20)
    for s in range(2):
        out = plain.step([DATA.global_batch(s)])
        assert out["zero_grads"] == 1.0 and out["applied"]
    assert all(torch.equal(a, b) for a, b in zip(start, plain.params))  # Adam on zeros: no move

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)
    scaled = AutocastTrainer(CFG, "fp16", scaler=scaler, loss_weight=2.0 ** -20)
    first = scaled.step([DATA.global_batch(0)])
    assert not first["applied"] and first["scale"] == 2.0 ** 39  # overflow: skipped, halved
    assert all(torch.equal(a, b) for a, b in zip(start, scaled.params))
    results = [scaled.step([DATA.global_batch(s)]) for s in range(1, 12)]
    assert results[-1]["applied"] and results[-1]["zero_grads"] < 0.01
    assert results[-1]["loss"] < first["loss"] - 0.1


def test_gradscaler_and_loss_scaler_take_the_same_decisions():
    """The same gradients (an overflow at steps 0, 1 and 5) through both: the same skips and
    the same scale after every step (halved on a skip, doubled after 3 clean steps)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    ours = LossScaler(2.0 ** 10, interval=3)
    for step in range(10):
        value = float("inf") if step in (0, 1, 5) else 1.0
        p.grad = torch_scaler.scale(torch.tensor([1.0, value, 2.0]))
        before = torch_scaler.get_scale()
        torch_scaler.unscale_(opt)
        torch_scaler.step(opt)
        torch_scaler.update()
        applied = ours.update(ours.unscale([torch.tensor([1.0, value, 2.0]) * ours.scale]))
        assert (torch_scaler.get_scale() >= before) == applied
        assert torch_scaler.get_scale() == ours.scale, step
    assert ours.skipped == 3


def test_model_state_is_sixteen_bytes_split_four_four_eight():
    t = AutocastTrainer(CFG, "bf16")
    t.step([DATA.global_batch(0)])
    n, tensors = CFG.n_params(), len(t.params)
    assert t.memory() == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * tensors}
    hand = MixedPrecisionTrainer(CFG, "bf16")
    hand.step([DATA.global_batch(0)])
    assert sum(hand.memory().values()) == sum(t.memory().values())


@pytest.mark.parametrize("kwargs, says", [
    ({"precision": "fp32"}, "computes in 'bf16' or 'fp16'"),
    ({"precision": "bf16-fp32-grads"}, "computes in 'bf16' or 'fp16'"),
    ({"optimizer": "lamb"}, "optimizer must be 'adam' or 'sgd'"),
    ({"loss_weight": 0}, "loss_weight must be positive")])
def test_bad_input_says_what_to_change(kwargs, says):
    with pytest.raises(ValueError, match=says):
        AutocastTrainer(CFG, **kwargs)


def test_op_dtypes_sees_the_casts_the_bf16_matmuls_and_the_fp32_loss():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = DATA.global_batch(0)

    def forward():
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            GPT.criterion(model(x), y)

    ops = op_dtypes(forward)
    assert ops[("addmm", "bfloat16", "bfloat16")] == 6 * CFG.n_layer  # q, k, v, proj, fc, proj
    assert ops[("mm", "bfloat16", "bfloat16")] == 1  # the tied head
    assert ops[("_to_copy", "bfloat16", "float32")] == 1  # the logits, up for the loss
    assert ops[("_log_softmax", "float32", "float32")] == 1
    assert ops[("native_layer_norm", "float32", "float32")] == 2 * CFG.n_layer + 1
    assert not any(op in ("view", "t", "transpose", "detach") for op, _, _ in ops)


def test_allocator_peak_of_known_allocations_and_silence_on_stderr(capfd):
    meter = AllocatorPeak()
    with meter.track():
        a = torch.empty(1000)  # 4,000 bytes
        b = torch.empty(500)  # 2,000: 6,000 held, the peak
        del a
        c = torch.empty(250)  # 1,000: 3,000 held
    assert (meter.peak, meter.held, meter.allocations) == (6000, 3000, 3)
    assert b.numel() + c.numel() == 750
    out, err = capfd.readouterr()
    assert err == ""


def test_allocator_peak_leaves_out_what_an_older_block_frees():
    first = AllocatorPeak()
    with first.track():
        old = torch.empty(2000)  # 8,000 bytes, seen allocated by this window's profiler
    second = AllocatorPeak()
    with second.track():
        del old  # freed inside the second window: not subtracted from its own figures
        new = torch.empty(100)
    assert (first.peak, first.held) == (8000, 8000)
    assert (second.peak, second.held, second.freed_before) == (400, 400, 8000)
    assert new.numel() == 100


def test_the_allocators_peak_over_the_loss_is_the_saved_tensors_plus_the_logits():
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = (t.contiguous() for t in DATA.global_batch(0))
    saved, allocator = ActivationMeter(model.parameters()), AllocatorPeak()
    with allocator.track(), saved.track():
        loss = GPT.criterion(model(x), y)
    inputs = x.nbytes + y.nbytes  # saved (the meter counts them), allocated before the block
    assert allocator.held == saved.peak - inputs + loss.nbytes
    assert allocator.peak - allocator.held == 8 * CFG.seq_len * CFG.vocab_size * 4
