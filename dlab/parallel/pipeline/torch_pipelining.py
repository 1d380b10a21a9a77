"""PyTorch's own pipeline (``torch.distributed.pipelining``) on dlab's GPT, stage split and
batches: the peer that ``bench pipeline`` times dlab's schedules against and notebook 06 trains
beside dlab's, a rank program for ``dlab.spawn``."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import schedules as torch_schedules

from dlab import models
from dlab.core.config import RunConfig
from dlab.layout import schedules
from dlab.layout.stages import partition
from dlab.models.data import make_data
from dlab.parallel.pipeline.split import StageModule, param_costs

#: dlab's schedules that PyTorch also has, by PyTorch's class name
PEERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
         "interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
         "dualpipev": "ScheduleDualPipeV"}


def stages_per_rank(name: str) -> int:
    return 2 if name in ("interleaved", *schedules.V_SHAPED) else 1


def torch_run(name: str, p: int, m: int, model_options: dict, steps: int,
              batch_size: int | None = None, optimizer: str = "adam", lr: float = 1e-4) -> dict:
    """On each rank: PyTorch's schedule on the same GPT, the same stage split and the same data
    (dlab's ``global_batch``, ``batch_size`` sequences, default m), one optimizer step per
    iteration (SGD as dlab's: momentum 0.9), the tied matrix's gradient summed between its two
    holders as dlab does. Returns the step times, the step losses (mean over the micro-batches,
    on the rank holding the last stage; None elsewhere) and the bytes this rank sent point to
    point, counted where every transfer of ``torch.distributed.pipelining`` is posted
    (``schedules._batch_p2p``): its p2p bypasses dlab's counting ``Comm``."""
    rank = dist.get_rank()
    v = stages_per_rank(name)
    n = p * v
    model = models.build("gpt", model_options, 0)
    blocks, first, last = param_costs(model)
    ranges = partition(blocks, n, first, last)
    if name in schedules.V_SHAPED:
        mine = [rank, 2 * p - 1 - rank]
    else:
        mine = [rank + k * p for k in range(v)]
    mods = {s: StageModule(model, ranges[s], s == 0, s == n - 1) for s in mine}
    stages = [pipelining.PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    params = list({id(t): t for mod in mods.values()
                   for t in mod.named_full_parameters().values()}.values())
    opt = (torch.optim.Adam(params, lr=lr) if optimizer == "adam"
           else torch.optim.SGD(params, lr=lr, momentum=0.9))
    cls = getattr(pipelining, PEERS[name])
    # scale_grads=False, and the 1/m applied below to every parameter: PyTorch divides the
    # gradients of ``stage.submod.parameters()`` only, and the last stage's head uses the tied
    # matrix without registering it, so its gradient there would stay m times too large
    sched = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=models.GPT.criterion,
                scale_grads=False)
    data = make_data(RunConfig(strategy="single", batch_size=batch_size or m,
                               model_options=model_options))
    holds_first, holds_last = 0 in mine, n - 1 in mine
    tied = model.embed.tok.weight
    tied_group = dist.new_group([0, p - 1]) if name not in schedules.V_SHAPED else None
    sent = [0]
    batch_p2p = torch_schedules._batch_p2p

    def counted(ops, desc=None):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                       if op.op is dist.isend)
        return batch_p2p(ops, desc)

    torch_schedules._batch_p2p = counted
    out = {"step_s": [], "losses": [], "sent_bytes": []}
    try:
        for step in range(steps):
            x, y = data.global_batch(step)
            dist.barrier()
            start, sent[0] = time.perf_counter(), 0
            opt.zero_grad()
            losses: list = []
            kwargs = {"target": y, "losses": losses} if holds_last else {}
            if holds_first:
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)
            for t in params:
                if t.grad is not None:
                    t.grad.div_(m)
            if tied_group is not None and (holds_first or holds_last):
                if tied.grad is None:
                    tied.grad = torch.zeros_like(tied)
                dist.all_reduce(tied.grad, group=tied_group)
            opt.step()
            out["step_s"].append(time.perf_counter() - start)
            out["losses"].append(float(torch.stack(losses).mean()) if holds_last else None)
            out["sent_bytes"].append(sent[0])
    finally:
        torch_schedules._batch_p2p = batch_p2p
    return out
