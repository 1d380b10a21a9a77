"""The dynamic loss scaler against a run of fp16 arithmetic worked by hand: a gradient that
underflows unscaled survives scaled, an overflow skips the step and halves the scale, and
clean steps grow it back; a run whose scaler skipped every step, or whose loss ends NaN, ends
failed with its skipped steps in its metrics and summary."""
import math

import pytest
import torch
from helpers import TINY_GPT

import dlab
from dlab.core.precision import LossScaler
from dlab.worker.train import learned_nothing


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


@pytest.mark.parametrize("last_loss,taken,skipped,says", [
    (float("nan"), 5, 4, "its last loss is nan"),
    (float("inf"), 3, 0, "its last loss is inf"),
    (2.5, 3, 3, "skipped every one of its 3 steps"),
    (2.5, 5, 4, None),  # it overflowed often, but it ends on a finite loss: it trained
    (float("nan"), 0, 0, None),  # a restart after the last checkpoint takes no step
])
def test_the_rule_a_run_that_learned_nothing_fails_by(last_loss, taken, skipped, says):
    why = learned_nothing(last_loss, taken, skipped)
    assert why == says if says is None else says in why


def test_a_run_that_learns_nothing_ends_failed_with_its_skipped_steps_shown(runs_dir):
    """fp16 at a rate that sends the weights past fp16's range: the loss is NaN from step 1 and
    every later step is skipped. The run ends failed (the CLI then exits 1), every step's record
    says whether it was skipped and at what scale, and the summary says how many were."""
    with pytest.raises(dlab.RunFailed, match="learned nothing: its last loss is nan"):
        dlab.launch("single", 1, runs_dir=runs_dir, wait=True, options={"precision": "fp16"},
                    **{**TINY_GPT, "lr": 1e4, "steps": 4})
    (path,) = runs_dir.iterdir()
    run = dlab.attach(path)
    assert run.state == "failed"
    records = run.metrics(0)
    assert [m["skipped"] for m in records] == [False, True, True, True]
    assert [m["loss_scale"] for m in records] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 14]
    assert math.isnan(records[-1]["loss"])
    notes = "\n".join(run.summary().notes())
    assert "3 of 4 steps skipped by the loss scaler" in notes
    assert "the loss was not finite at 3 of 4 steps" in notes
