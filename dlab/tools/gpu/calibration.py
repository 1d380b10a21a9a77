"""``plan calibrate`` as a session step: the device measures the kernels the planner prices
(``dlab.tools.device_profile``) into ``profile.json``, the cluster profile ``python -m dlab plan
--cluster`` reads.

Its collectives are timed only over two or more GPUs: on one GPU two ranks would share it over
Gloo through host memory, which says nothing of a GPU link (the collectives step measures that
case apart). A profile measured on one GPU therefore has no link of its own, and
``device_profile`` writes a placeholder (1 GB/s, one GPU a node) that would price every
collective of a plan at scale on it. So where one GPU of a known generation measured the
kernels, the profile takes its links and GPUs per node from the preset of that generation (the
published nccl-tests figures, ``dlab.theory.plan.cluster``) and says so in its ``measured``
field: the kernels are this GPU's, the links the preset's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dlab.theory.plan import cluster as clusters
from dlab.tools import device_profile
from dlab.tools.gpu import child


def borrow_links(doc: dict, path: Path) -> dict:
    """``doc`` (a one-GPU profile) with its preset's links, rewritten at ``path``."""
    name = device_profile.preset_for(doc.get("measured", {}).get("device", ""))
    if not name:
        return doc
    preset = clusters.PRESETS[name]
    doc["links"] = {level: {"latency": getattr(preset, level).alpha,
                            "busbw": getattr(preset, level).bandwidth} for level in ("intra", "inter")}
    doc["gpus_per_node"] = preset.gpus_per_node
    doc["measured"]["links"] = (f"not measured (one GPU has no link): the {name} preset's, from "
                                f"published nccl-tests figures")
    # the placeholder's warning no longer holds: the links are the preset's, as measured says
    doc["flags"] = [f for f in doc.get("flags", []) if not f.startswith(device_profile.NO_LINK)]
    child.write_json(path, doc)
    return doc


def run(ctx):
    ranks = torch.cuda.device_count() if ctx.cuda and torch.cuda.device_count() >= 2 else 1
    quick = ctx.quick or not ctx.cuda
    path = Path(ctx.out) / "profile.json"
    doc = device_profile.profile(path, quick=quick, ranks=ranks, runs_dir=f"{ctx.runs_dir}/calibrate")
    if ctx.cuda and ranks == 1:
        doc = borrow_links(doc, path)
    clusters.load(path)  # what --cluster will read must load
    text = device_profile.describe(json.loads(path.read_text()))
    return ({"profile": "profile.json", "describe": text, "quick": quick, "ranks": ranks},
            text.splitlines()[0], ["profile.json"])
