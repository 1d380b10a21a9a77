"""``python -m dlab bench nd``: one GPT laid out every way 4 and 8 ranks allow, each figure
beside ``dlab.theory.nd``, and dp x ZeRO-3 x tp beside PyTorch's own FSDP2 + TP.

Layouts: every (pp, dp, cp, tp) whose product is the world size and that the model divides
(``Layout.problems`` refuses the rest: tp must divide the 4 heads, pp at most the 4 blocks, the
sequence must cut into 2 cp chunks per rank, the batch into dp x micro-batches), each with
ZeRO-1 over its data ranks when it has more than one, sequence parallelism whenever tp > 1 (as
Megatron-Core runs TP today), the 1F1B schedule with 4 micro-batches when pp > 1, and Adam (the
default optimizer). Per layout, the fullest rank's measured figures
beside the model's for that rank:

- ``state_MB``: parameters + gradients + optimizer state (``estimate.nd.model_state``);
- ``sent_MB``: the busiest rank's bytes sent per step, ring model of the ops it ran
  (``estimate.nd.step_bytes``); ``wire_MB``: what Gloo wrote for them, measured
  (``dlab.comm.wire``: Gloo's reduce-scatter writes a whole all-reduce);
- ``act_MB``: the activation peak (``estimate.nd.activations``);
- ``step_s``: the slowest rank's median step time.

The peer rows: dp 2 x ZeRO-3 x tp 2 with sequence parallelism, without recomputation and with
``recompute`` full and selective, in fp32 and in bf16, against ``torch-tp`` with ``fsdp=True``
(``fully_shard`` over the dp dimension of a DTensor TP mesh) running the same model options in
the same precision (``nd``'s ``precision`` option; the peer's is FSDP2's
``MixedPrecisionPolicy``); both sides recompute with ``torch.utils.checkpoint`` through the GPT's
own ``recompute`` option, so those rows compare the parallelism around it. Each pair of runs
gives two rows, their ``dlab`` / ``peer`` / ``ratio`` from the same two runs: ``metric``
``step_s`` (the slowest rank's median step time) and ``state_MB`` (the fullest rank's
parameters + gradients + optimizer state, measured). With Adam both sides hold 16 bytes per
parameter in either precision, divided differently: ``nd`` in bf16 the ZeRO paper's 2 + 2 + 12
(bf16 weights and gradients, fp32 masters and moments), FSDP2 4 + 4 + 8 (fp32 shards, the bf16
weights only while a block is gathered). The precision is in each row and, where not fp32, in
its ``layout`` label.

On 2 CPU cores 8 ranks share two cores: step times there measure the layouts' overheads and
bytes, not speed-ups. ``--quick``: the peer rows without recomputation (fp32 and bf16) and three
4-rank layouts.
"""
from __future__ import annotations

import itertools
import math
import tempfile

from dlab.analysis.steps import step_time
from dlab.bench import compared
from dlab.core.config import RunConfig
from dlab.layout import MESH_ORDER, Layout, ranks
from dlab.procs.launch import launch
from dlab.theory import nd
from dlab.worker.validate import problems

MODEL = {"n_layer": 4, "d_model": 128, "n_head": 4, "seq_len": 128}
BATCH = 8
PEER_LAYOUT = {"dp": 2, "zero": 3, "tp": 2, "sequence_parallel": True}
PEER = {"tp": 2, "sequence_parallel": True, "fsdp": True}  # torch-tp's options for that layout
PRECISIONS = ("fp32", "bf16")
STATE = ("parameters", "gradients", "optimizer")
RECOMPUTE = [{}, {"recompute": "full"}, {"recompute": "selective"}]
QUICK = [{"dp": 4, "zero": 1}, {"pp": 2, "tp": 2, "sequence_parallel": True},
         {"dp": 2, "zero": 1, "cp": 2}]
MB = 1e6


def layouts(world: int) -> list[dict]:
    """Every (pp, dp, cp, tp) of ``world`` ranks as ``nd`` options, in mesh order."""
    out = []
    for degrees in itertools.product(*[[d for d in range(1, world + 1) if world % d == 0]] * 4):
        if math.prod(degrees) != world:
            continue
        opts = {k: d for k, d in zip(MESH_ORDER, degrees) if d > 1}
        if opts.get("dp", 1) * opts.get("cp", 1) > 1:
            opts["zero"] = 1
        if opts.get("tp", 1) > 1:
            opts["sequence_parallel"] = True
        out.append(opts)
    return out


def runnable(world: int, options: dict, model_options: dict = MODEL) -> bool:
    """Whether ``nd`` takes this layout for the bench's model (``Layout.problems``)."""
    cfg = RunConfig.from_dict({"strategy": "nd", "world_size": world, "batch_size": BATCH,
                               "options": options, "model_options": model_options})
    return not problems(cfg)


def label(options: dict) -> str:
    dims = " x ".join(f"{k}{options[k]}" for k in MESH_ORDER if options.get(k, 1) > 1)
    extra = [f"zero{options['zero']}"] if options.get("zero") else []
    extra += ["sp"] if options.get("sequence_parallel") else []
    extra += [options["precision"]] if options.get("precision", "fp32") != "fp32" else []
    return " ".join([dims or "single"] + extra)


def measure(run) -> dict:
    """The fullest rank's figures beside the estimate for that rank (the last step's). The
    model state and the activations have their estimates in every precision; the bytes sent only
    in fp32 (``estimate.nd.step_bytes`` takes no precision), so in a mixed precision run its
    ``_model_MB`` is None rather than an fp32 figure beside a bf16 one."""
    cfg = RunConfig.from_dict(run.config)
    lay, mc = Layout.from_options(cfg.options, cfg.world_size), cfg.model_config()
    precision = cfg.options.get("precision", "fp32")
    per_rank = []
    for r in range(run.world_size):
        m = run.metrics(r)[-1]
        pp_rank = ranks.coords(lay.dims, r)["pp"]
        state = nd.model_state(mc, lay, pp_rank, cfg.optimizer, precision)
        per_rank.append({
            "state_MB": sum(m["memory"][k] for k in state) / MB,
            "state_model_MB": sum(state.values()) / MB,
            "sent_MB": m["comm"]["sent_bytes"] / MB,
            "sent_model_MB": nd.step_bytes(mc, lay, cfg.batch_size, pp_rank)["total"] / MB,
            "wire_MB": None if m["comm"]["wire_bytes"] is None else m["comm"]["wire_bytes"] / MB,
            "act_MB": m["memory"]["activations"] / MB,
            "act_model_MB": nd.activations(mc, lay, cfg.batch_size, pp_rank, precision)["peak"] / MB})
    out = {}
    for key in ("state", "sent", "act"):
        top = max(per_rank, key=lambda row: row[f"{key}_MB"])
        out[f"{key}_MB"], out[f"{key}_model_MB"] = top[f"{key}_MB"], top[f"{key}_model_MB"]
    if precision != "fp32":
        out["sent_model_MB"] = None
    wire = [row["wire_MB"] for row in per_rank]
    out["wire_MB"] = None if None in wire else max(wire)  # not measurable: NCCL, not Linux
    return out


def state_MB(run) -> float:
    """The fullest rank's measured model state (parameters + gradients + optimizer), MB."""
    return max(sum(run.metrics(r)[-1]["memory"][k] for k in STATE)
               for r in range(run.world_size)) / MB


def peer_rows(recompute: dict, precision: str, runs_dir: str, common: dict) -> list[dict]:
    """dp2 x ZeRO-3 x tp2 + SP against FSDP2 + TP in ``precision``: step time and model state,
    each as dlab / peer, from one run of each."""
    model, prec = {**MODEL, **recompute}, {"precision": precision}
    peer = launch("torch-tp", 4, runs_dir=runs_dir, wait=True, model_options=model,
                  options={**PEER, **prec}, **common)
    mine = launch("nd", 4, runs_dir=runs_dir, wait=True, model_options=model,
                  options={**PEER_LAYOUT, **prec}, **common)
    what = {"layout": label({**PEER_LAYOUT, **prec}), "ranks": 4,
            "recompute": recompute.get("recompute", "none"), "precision": precision,
            "peer_name": "torch-tp fsdp"}
    figures = measure(mine)
    return [compared(step_time(mine), step_time(peer), **what, metric="step_s",
                     step_s=step_time(mine), **figures),
            compared(figures["state_MB"], state_MB(peer), **what, metric="state_MB")]


def run(quick: bool = False) -> list[dict]:
    common = {"batch_size": BATCH, "steps": 3 if quick else 6}
    rows = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for recompute in RECOMPUTE[:1] if quick else RECOMPUTE:
            for precision in PRECISIONS:
                rows += peer_rows(recompute, precision, runs_dir, common)
        grid = [(4, o) for o in QUICK] if quick else [(w, o) for w in (4, 8) for o in layouts(w)]
        for world, options in grid:
            if not runnable(world, options):
                continue
            mine = launch("nd", world, runs_dir=runs_dir, wait=True, model_options=MODEL,
                          options=options, **common)
            rows.append({"layout": label(options), "ranks": world, "recompute": "none",
                         "precision": "fp32", "step_s": step_time(mine), **measure(mine)})
    return rows
