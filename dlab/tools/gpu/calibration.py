"""``plan calibrate`` as a session step: the device measures the kernels the planner prices
(``dlab.tools.device_profile``) into ``profile.json``, the cluster profile ``python -m dlab plan
--cluster`` reads. Its collectives are timed only over two or more GPUs: on one GPU two ranks
would share it over Gloo through host memory, which says nothing of a GPU link (the
collectives step measures that case apart)."""
from __future__ import annotations

import torch

from dlab.tools import device_profile


def run(ctx):
    ranks = torch.cuda.device_count() if ctx.cuda and torch.cuda.device_count() >= 2 else 1
    quick = ctx.quick or not ctx.cuda
    doc = device_profile.profile(f"{ctx.out}/profile.json", quick=quick, ranks=ranks,
                                 runs_dir=f"{ctx.runs_dir}/calibrate")
    text = device_profile.describe(doc)
    return ({"profile": "profile.json", "describe": text, "quick": quick, "ranks": ranks},
            text.splitlines()[0], ["profile.json"])
