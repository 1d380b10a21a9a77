"""Assertions parity tests share."""
from __future__ import annotations

import torch

# A small GPT that trains in well under a second per step on one CPU core.
TINY_GPT = {"model": "gpt", "batch_size": 8, "steps": 4,
            "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}}


def losses(run, rank: int = 0) -> list[float]:
    return [m["loss"] for m in run.metrics(rank)]


def final_state(run) -> dict[str, torch.Tensor]:
    return torch.load(run.path / "final_state.pt", weights_only=True)


def assert_same_training(run, ref, loss_tol: float = 1e-5, param_tol: float = 1e-5) -> None:
    """Same losses step by step and same final parameters as the reference, to tolerance
    (absolute, fp32: the strategies sum the same numbers in another order)."""
    got, want = losses(run), losses(ref)
    assert len(got) == len(want) and got, (got, want)
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= loss_tol, f"losses differ by {worst:.2e} > {loss_tol:.0e}: {got} vs {want}"
    mine, theirs = final_state(run), final_state(ref)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        diff = (mine[name] - theirs[name]).abs().max().item()
        assert diff <= param_tol, f"parameter {name} differs by {diff:.2e} > {param_tol:.0e}"
