"""Assertions parity tests share, and ``processes_of``, which finds a run's processes (tests
import it from here, never from ``conftest``: tests/browser has a conftest of its own).

Parity runs use plain SGD (``optimizer="sgd"``: momentum 0.9, no normalisation): its update is
proportional to the gradient, so a gradient off by a constant factor (a missing or doubled /N)
moves the parameters by about that factor times a step. Adam divides the gradient by its own
root mean square and hides such a factor almost entirely (2e-6 in the loss after 3 steps).
"""
from __future__ import annotations

import psutil
import torch

# A small GPT that trains in well under a second per step on one CPU core.
# the tour: its exercises are open ones (its checked one, shard_rows, taught little: #38)
WITHOUT_A_CHECKED_EXERCISE = {"00_start_here"}

TINY_GPT = {"model": "gpt", "batch_size": 8, "steps": 4, "optimizer": "sgd",
            "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}}


def losses(run, rank: int = 0) -> list[float]:
    return [m["loss"] for m in run.metrics(rank)]


def final_state(run, rank: int = 0) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s final parameters at full size (every rank writes its own)."""
    name = "final_state.pt" if rank == 0 else f"final_state_rank{rank}.pt"
    return torch.load(run.path / name, weights_only=True)


def max_param_diff(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert mine.keys() == theirs.keys(), (sorted(mine), sorted(theirs))
    return max(((mine[k] - theirs[k]).abs().max().item(), k) for k in theirs)


def assert_ranks_agree(run) -> None:
    """Every rank's full final parameters equal rank 0's bit for bit: replicas must take the
    same steps on the same numbers, and a sharded strategy gathers the same full tensors on
    every rank. (Losses cannot show a rank that went its own way: they are all-reduced.)"""
    first = final_state(run, 0)
    for r in range(1, run.world_size):
        other = final_state(run, r)
        assert other.keys() == first.keys(), r
        bad = [k for k in first if not torch.equal(other[k], first[k])]
        assert not bad, (f"rank {r}'s final {bad[:3]} differ from rank 0's "
                         f"(max {max_param_diff(other, first)})")


def assert_same_training(run, ref, loss_tol: float = 1e-5, param_tol: float = 1e-5) -> None:
    """Same losses step by step and same final parameters as the reference, to tolerance
    (absolute, fp32: the strategies sum the same numbers in another order), on every rank."""
    got, want = losses(run), losses(ref)
    assert len(got) == len(want) and got, (got, want)
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= loss_tol, f"losses differ by {worst:.2e} > {loss_tol:.0e}: {got} vs {want}"
    diff, name = max_param_diff(final_state(run), final_state(ref))
    assert diff <= param_tol, f"parameter {name} differs by {diff:.2e} > {param_tol:.0e}"
    assert_ranks_agree(run)


def assert_same_checkpoint(a, b) -> None:
    """Two ``dlab.runtime.checkpoint_load.Reader``s hold the same: every parameter and every
    optimizer moment, assembled whole, bit for bit, and the same loss scaler state."""
    names = {n for s in a.states.values() for n in s["params"]}
    assert names == {n for s in b.states.values() for n in s["params"]}
    for name in sorted(names):
        assert torch.equal(a.tensor("params", name), b.tensor("params", name)), name
        assert a.keys(name) == b.keys(name), name
        for key in sorted(a.keys(name)):
            got, want = a.tensor("optim", name, key), b.tensor("optim", name, key)
            assert torch.equal(got, want), (
                f"{name}/{key} differs by up to {(got - want).abs().max().item():.3g}")
    assert a.scaler() == b.scaler()


def processes_of(path) -> list[psutil.Process]:
    """Live processes whose command line names ``path`` (a run directory or its parent): the
    torchrun agent and every rank, orphans included."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(path) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            continue
    return out
