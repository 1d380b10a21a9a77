"""Notebook 01's one-device step (``dlab.runtime.mixed_precision``) and its timing
(``dlab.runtime.benchmark``):

- memory by category equals the ZeRO paper's bytes per parameter (the table of
  ``dlab.core.precision``) times the parameter count from the shapes, plus Adam's step counter
  (one 4-byte scalar per tensor), for every precision and both optimizers;
- k micro-batches accumulate to the gradient of one batch: the same weights as one step on the
  whole batch (fp32, SGD);
- fp16 without loss scaling loses every small gradient to underflow and does not move; with a
  scale too large the first steps overflow and are skipped, the scale halves, and it trains;
- the fp32 master moves where a 16-bit weight would not: the compute copy is the master cast;
- a bf16 run follows the fp32 run's losses;
- ``benchmark`` throws the warm-up away and reports the median; ``utilization`` by hand.
"""
from __future__ import annotations

import pytest
import torch

from dlab.core.precision import PRECISIONS, LossScaler
from dlab.models.data import TokenData
from dlab.models.gpt import GPTConfig
from dlab.runtime.benchmark import benchmark, utilization
from dlab.runtime.mixed_precision import MixedPrecisionTrainer

CFG = GPTConfig(seq_len=16, n_layer=2, d_model=32, n_head=4)
DATA = TokenData(8, CFG.seq_len, 0)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_memory_is_the_bytes_per_parameter_times_the_parameters(precision, optimizer):
    trainer = MixedPrecisionTrainer(CFG, precision, optimizer)
    trainer.step([DATA.global_batch(0)])
    n, tensors = CFG.n_params(), len(list(trainer.model.parameters()))
    w, g, adam = PRECISIONS[precision].bytes
    mixed = precision != "fp32"
    # SGD keeps nothing but the fp32 master (4 bytes) in mixed precision, nothing in fp32
    k = adam * n + 4 * tensors if optimizer == "adam" else (4 * n if mixed else 0)
    assert trainer.memory() == {"parameters": w * n, "gradients": g * n, "optimizer": k}


def test_accumulated_micro_batches_give_the_whole_batch_step():
    x, y = DATA.global_batch(0)
    whole = MixedPrecisionTrainer(CFG, "fp32", "sgd", lr=0.1)
    parts = MixedPrecisionTrainer(CFG, "fp32", "sgd", lr=0.1)
    for _ in range(2):
        whole.step([(x, y)])
        parts.step([(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    for a, b in zip(whole.params, parts.params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fp16_underflows_without_loss_scaling_and_trains_with_it():
    start = [p.detach().clone() for p in MixedPrecisionTrainer(CFG, "fp16").params]
    plain = MixedPrecisionTrainer(CFG, "fp16", loss_weight=2.0 ** -20)
    for s in range(3):
        out = plain.step([DATA.global_batch(s)])
        assert out["zero_grads"] == 1.0 and out["applied"]
    assert all(torch.equal(a, b) for a, b in zip(start, plain.params))  # nothing moved

    scaler = LossScaler(2.0 ** 40, interval=1000)
    scaled = MixedPrecisionTrainer(CFG, "fp16", scaler=scaler, loss_weight=2.0 ** -20)
    first = scaled.step([DATA.global_batch(0)])
    assert not first["applied"] and scaler.scale == 2.0 ** 39  # overflow: skipped, halved
    results = [scaled.step([DATA.global_batch(s)]) for s in range(1, 12)]
    assert results[-1]["applied"] and results[-1]["zero_grads"] < 0.01
    assert results[-1]["loss"] < first["loss"] - 0.1


def test_the_master_is_fp32_and_the_compute_copy_is_it_cast():
    trainer = MixedPrecisionTrainer(CFG, "fp16", scaler=LossScaler())
    trainer.step([DATA.global_batch(0)])
    for m, p in zip(trainer.master, trainer.params):
        assert m.dtype == torch.float32 and p.dtype == torch.float16
        assert torch.equal(m.half(), p)
    # an update far below half an fp16 step of the weight: the master keeps it
    assert any(not torch.equal(m, p.float()) for m, p in zip(trainer.master, trainer.params))


def test_bf16_follows_the_fp32_losses():
    runs = {name: MixedPrecisionTrainer(CFG, name, lr=3e-3) for name in ("fp32", "bf16")}
    losses = {name: [t.step([DATA.global_batch(s)])["loss"] for s in range(6)]
              for name, t in runs.items()}
    assert losses["fp32"][-1] < losses["fp32"][0] - 0.3
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) < 0.05


@pytest.mark.parametrize("kwargs, says", [
    ({"precision": "fp8"}, "precision must be one of 'fp32'"),
    ({"optimizer": "lamb"}, "optimizer must be 'adam' or 'sgd'"),
    ({"loss_weight": 0}, "loss_weight must be positive")])
def test_bad_input_says_what_to_change(kwargs, says):
    with pytest.raises(ValueError, match=says):
        MixedPrecisionTrainer(CFG, **kwargs)


def test_benchmark_discards_the_warm_up_and_takes_the_median():
    calls = []
    report = benchmark(lambda: calls.append(1), warmup=3, repeats=5)
    assert len(calls) == 8 and len(report["times"]) == 5
    assert report["min"] <= report["median"] <= report["max"]
    with pytest.raises(ValueError, match="repeats >= 1"):
        benchmark(lambda: None, repeats=0)


def test_utilization_by_hand():
    # 6e9 FLOPs per token, 1000 tokens in 2 s: 3e12 FLOP/s of 2 devices at 3e12: half
    assert utilization(6e9, 1000, 2.0, 3e12, world_size=2) == pytest.approx(0.5)
