"""The dynamic loss scaler against a run of fp16 arithmetic worked by hand: a gradient that
underflows unscaled survives scaled, an overflow skips the step and halves the scale, and
clean steps grow it back."""
import pytest
import torch

from dlab.core.precision import LossScaler


def test_scaled_gradient_survives_fp16_where_the_unscaled_one_underflows():
    tiny = torch.tensor([1e-8])  # below fp16's smallest subnormal (6e-8)
    assert tiny.half().item() == 0.0
    scaler = LossScaler(init=2.0 ** 16)
    scaled = (tiny * scaler.scale).half().float()
    assert scaled.item() != 0.0
    flag = scaler.unscale([scaled])
    assert scaler.update(flag)
    assert scaled.item() == pytest.approx(1e-8, rel=1e-3)


def test_overflow_skips_the_step_halves_the_scale_and_clean_steps_double_it():
    scaler = LossScaler(init=8.0, factor=2.0, interval=3)
    grads = [torch.tensor([1.0, float("inf")]), None]
    assert not scaler.update(scaler.unscale(grads))
    assert (scaler.scale, scaler.skipped) == (4.0, 1)
    for _ in range(3):
        assert scaler.update(scaler.unscale([torch.tensor([4.0])]))
    assert scaler.scale == 8.0  # doubled after three clean steps, not before
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="factor > 1"):
        LossScaler(factor=1.0)
