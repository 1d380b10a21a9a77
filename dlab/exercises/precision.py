"""Notebook 01's checked exercise: one mixed-precision optimizer step (Micikevicius et al. 2018,
sec. 3): unscale the fp16 gradient in fp32, skip the step where it holds an inf or a NaN,
update the fp32 master with SGD, and cast the compute copy from it.

``mixed_precision_step(master, grad16, scale, lr) -> (master, weight16, applied)``. Checked
over two runs of several steps against the direct computation:

- "small updates": weights near 1, updates of 1e-4 and less, below half an fp16 step at 1.0
  (2^-11 = 4.9e-4): they round away in fp16 and survive only in the fp32 master; one step's
  gradient overflowed (inf) and must be skipped;
- "tiny gradients": true gradients of 1e-8 to 4e-8, below fp16's smallest subnormal (6e-8):
  scaled by 2^20 they are fine in fp16, but divided by the scale in fp16 they become 0.
"""
from __future__ import annotations

import torch

from dlab.exercises.registry import exercise, first_difference

#: name: (the master at the start, the true gradient, the scale, lr, steps, steps whose
#: gradient overflowed)
RUNS = {
    "small updates": ([1.0, -1.0, 2.0, 0.5], [1e-3, 2e-3, -1e-3, 5e-4], 2.0 ** 10, 0.1, 6, {3}),
    "tiny gradients": ([0.0, 0.0, 0.0, 0.0], [2e-8, -3e-8, 1e-8, 4e-8], 2.0 ** 20, 1.0, 3, set()),
}


def _gradient(true, scale, overflowed: bool) -> torch.Tensor:
    """The fp16 gradient the backward of the scaled loss gives (inf where it overflowed)."""
    g = (torch.tensor(true) * scale).half()
    if overflowed:
        g[1] = float("inf")
    return g


def run_mixed_precision_step(fn):
    out = {}
    for name, (start, true, scale, lr, steps, bad) in RUNS.items():
        master, seen = torch.tensor(start), []
        for t in range(steps):
            grad16 = _gradient(true, scale, t in bad)
            master, weight16, applied = fn(master.clone(), grad16.clone(), scale, lr)
            seen.append((master.clone(), weight16.clone(), bool(applied)))
        out[name] = seen
    return out


@exercise(name="mixed_precision_step", notebook="01_one_device",
          task="mixed_precision_step(master, grad16, scale, lr): unscale the fp16 gradient in "
               "fp32, skip the step (applied=False) if it holds inf or NaN, else update the fp32 "
               "master with SGD; return (master, the fp16 compute copy, applied)",
          run=run_mixed_precision_step)
def judge_mixed_precision_step(answer):
    for name, (start, true, scale, lr, _, bad) in RUNS.items():
        master = torch.tensor(start)
        for t, (got_master, got16, got_applied) in enumerate(answer[name]):
            before = master
            if t not in bad:
                master = master - lr * (_gradient(true, scale, False).float() / scale)
            where = f"{name}, step {t}"
            if got_applied != (t not in bad):
                return (f"{where}: applied should be {t not in bad}"
                        + ("; the gradient holds an inf: skip the step" if t in bad else ""))
            if got_master.dtype != torch.float32 or got16.dtype != torch.float16:
                return (f"{where}: the master must be fp32 and the compute copy fp16 (got "
                        f"{got_master.dtype} and {got16.dtype})")
            wrong = first_difference(got_master, master, f"{where}, the master", atol=1e-12)
            if wrong:
                if t not in bad and torch.equal(got_master, before.half().float()):
                    wrong += ("; the update is smaller than half an fp16 step of the weight and "
                              "rounded away: add it to the fp32 master, not to the fp16 weight")
                elif torch.equal(got_master, before - lr * (_gradient(true, scale, False) / scale).float()):
                    wrong += ("; divided by the scale in fp16 the gradient falls below fp16's "
                              "smallest subnormal (6e-8) and becomes 0: cast to fp32 first")
                return wrong
            wrong = first_difference(got16.float(), master.half().float(),
                                     f"{where}, the fp16 copy (the master cast)", atol=0)
            if wrong:
                return wrong
    return None
