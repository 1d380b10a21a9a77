"""Memory by category, counted from tensors held, equals the arithmetic for a known model."""
from __future__ import annotations

import torch
from torch import nn

from dlab.core.metrics import ActivationMeter, StoragePeak, model_state_memory, storage_bytes
from dlab.models import GPTConfig, MLPConfig, build


def test_adam_model_state_is_exactly_params_grads_and_two_moments():
    cfg = MLPConfig(d_in=32, d_hidden=64, d_out=8, n_layer=2)
    model = build("mlp", cfg.to_dict(), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    p = cfg.n_params()  # (32*64+64) + (64*64+64) + (64*8+8) = 2112 + 4160 + 520
    assert p == 6792 == sum(t.numel() for t in model.parameters())
    n_tensors = len(list(model.parameters()))
    mem = model_state_memory(model.parameters(), opt)
    assert mem["parameters"] == 4 * p
    assert mem["gradients"] == 4 * p
    # Adam keeps exp_avg and exp_avg_sq (fp32, 8 bytes per parameter) and a scalar step per tensor.
    assert mem["optimizer"] == 8 * p + 4 * n_tensors


def test_a_tied_weight_is_counted_once():
    tied = build("gpt", {"tied": True}, seed=0)
    untied = build("gpt", {"tied": False}, seed=0)
    assert storage_bytes(tied.parameters()) == 4 * GPTConfig(tied=True).n_params()
    assert storage_bytes(untied.parameters()) == 4 * GPTConfig(tied=False).n_params()
    extra = storage_bytes(untied.parameters()) - storage_bytes(tied.parameters())
    assert extra == 4 * 256 * 64  # the separate head matrix


def test_views_share_a_storage():
    base = torch.zeros(100)
    assert storage_bytes([base, base[:10], base.view(10, 10)]) == 400


def test_activation_meter_counts_saved_inputs_and_releases_them():
    layer = nn.Linear(16, 16)
    meter = ActivationMeter(layer.parameters())
    x = torch.randn(8, 16, requires_grad=True)
    with meter.track():
        y = torch.relu(layer(x))  # saves x for the weight grad, relu's output for its own
    assert meter.peak == 8 * 16 * 4 * 2
    y.sum().backward()
    del y
    assert meter.current == 0 and meter.peak == 8 * 16 * 4 * 2


def test_storage_peak_sees_buffers_allocated_and_freed_during_backward():
    """A buffer that lives only inside backward (allocated in a gradient hook, freed before the
    block ends) still shows in the peak: the storages are read after every operator."""
    held: list[torch.Tensor] = []
    a = torch.randn(100, requires_grad=True)

    def hook(grad):
        held.append(torch.zeros(5000))  # 20000 bytes, for the operators that follow
        return grad * 2

    peak = StoragePeak(lambda: held)
    with peak.track():
        held.append(torch.zeros(1000))  # 4000 bytes
        y = (a * 3).sum()
        y.register_hook(hook)
        y.backward()
        held.clear()
    assert peak.peak == 24000
    assert storage_bytes(held) == 0
