"""The ``pipeline-*`` strategies: one class, six schedules.

``options``:

- ``microbatches`` (m, default 4; the naive pipeline runs 1): the data-parallel share of the
  global batch is cut into m equal micro-batches whose gradients accumulate.
- ``virtual_stages`` (v): stages per rank for ``pipeline-interleaved`` (default 2); the
  V-schedule always has 2.
- ``dp`` (default 1): replicas of the whole pipeline.
- ``tp`` (default 1): tensor parallelism inside every stage (Megatron-LM's layout,
  ``dlab.parallel.tensor``): with dp and tp both above 1 this is 3D parallelism (Narayanan et
  al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters"). Ranks form a
  ``Mesh({"dp": d, "pp": p, "tp": t})`` with p = world_size / (d t): the t ranks of a stage are
  adjacent (TP is the chattiest: an all-reduce per layer), then the p stages of a pipeline,
  then the d replicas. A stage's tensor-parallel ranks run the same schedule in lockstep; rank
  (pp=s, tp=r) sends its activations to (pp=s+1, tp=r), the whole activation (no sequence
  parallelism here), since every rank of a TP group holds the same block outputs. After the
  schedule each gradient is averaged over the d replicas.
- ``balance``: ``"params"`` (default: blocks dealt out by parameter count) or ``"time"``
  (measured forward+backward time of each block on rank 0, broadcast to all).
- ``recv_ahead`` (k, default 2v on Gloo, 0 on NCCL): receives kept posted ahead of the action
  that waits for them, so activations and gradients cross while the rank computes; 0 posts each
  receive when the schedule reaches it (the naive way, kept to show the difference). A rank
  with v stages receives on 2v streams (activations into each stage, gradients from the next),
  whose messages land in another order than the list consumes them; 2v posted ahead keeps
  about one posted per stream, so whichever arrives next finds its buffer. ``python -m dlab
  bench pipeline`` sweeps k on 2 ranks at m = 16: 1F1B (2 streams) 0.166, 0.099, 0.092, 0.106
  at k = 0, 1, 2, 4 (formula 0.059); interleaved (4 streams) 0.143, 0.101, 0.093, 0.072
  (formula 0.030). Refused above 0 on NCCL (see ``executor.py``).

The tied embedding/head matrix lives on the first and on the last stage; its two gradients are
summed across those two ranks after the schedule, as Megatron-LM does (see ``split.py``), so
both copies take the same optimizer step. On the V-schedule both stages are on rank 0 and
autograd sums the two uses itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dlab.comm.instrumented import Comm
from dlab.models.data import shard
from dlab.core.metrics import ActivationMeter, model_state_memory
from dlab.parallel import register
from dlab.parallel.base import Option, Strategy
from dlab.parallel.mesh import Mesh
from dlab.layout import schedules
from dlab.parallel.pipeline.executor import Executor
from dlab.parallel.pipeline.split import StageModule, param_costs, partition, time_costs
from dlab.parallel.pipeline.weight_grad import WeightGradStore, split_linears
from dlab.parallel.tensor.model import TensorParallelGPT
from dlab.parallel.tensor.strategy import gather_shards, model_split_problems

OPTIONS = {
    "microbatches": Option("int", "micro-batches per step (m; default 4, the naive pipeline 1)",
                           minimum=1),
    "virtual_stages": Option("int", "stages per rank (v) for the interleaved schedules", minimum=1),
    "dp": Option("int", "replicas of the whole pipeline", default=1, minimum=1),
    "tp": Option("int", "tensor parallelism inside every stage", default=1, minimum=1),
    "balance": Option("choice", "deal blocks out by parameter count or by measured time",
                      default="params", choices=("params", "time")),
    "recv_ahead": Option("int", "receives kept posted ahead (default 2v on Gloo, 0 on NCCL)",
                         minimum=0),
}


class Pipeline(Strategy):
    """Pipeline parallelism (override ``schedule`` in a subclass)."""
    schedule = ""
    default_v = 1
    OPTIONS = OPTIONS

    # --- configuration --------------------------------------------------------------------
    @classmethod
    def recv_ahead(cls, config) -> int:
        if "recv_ahead" in config.options:
            return config.options["recv_ahead"]
        return 0 if config.resolved_backend() == "nccl" else 2 * cls.layout(config)[4]

    @classmethod
    def layout(cls, config) -> tuple[int, int, int, int, int]:
        """(p, d, t, m, v) from the config's options."""
        o = config.options
        d, t = o.get("dp", 1), o.get("tp", 1)
        m = o.get("microbatches", 1 if cls.schedule == "naive" else 4)
        v = o.get("virtual_stages", cls.default_v)
        whole = all(isinstance(k, int) and k > 0 for k in (d, t))
        return config.world_size // (d * t) if whole else 0, d, t, m, v

    @classmethod
    def problems(cls, config) -> list[str]:
        out = super().problems(config)
        if config.model != "gpt":
            return out + [f"{config.strategy} splits the GPT by layers; use model='gpt'"]
        p, d, t, m, v = cls.layout(config)
        if out:
            return out
        if config.world_size % (d * t):
            what = f"dp={d}" if t == 1 else f"dp x tp = {d} x {t} = {d * t}"
            return [f"{what} does not divide world_size={config.world_size}: the ranks form "
                    f"dp x pp x tp; pick dp x tp among the divisors of {config.world_size}"]
        if t > 1:
            out += model_split_problems(config.model_config(), t)
            if cls.schedule in ("zb-h1", "zbv"):
                out.append(f"{cls.schedule} splits the backward of nn.Linear layers, and the "
                           f"tensor-parallel layers are not split here: use tp=1, or gpipe, "
                           f"1f1b or interleaved with tp")
        if config.batch_size % (d * m):
            out.append(f"batch_size={config.batch_size} must split into dp={d} replicas of "
                       f"microbatches={m} equal micro-batches: use a multiple of {d * m}")
        k = cls.recv_ahead(config)
        if k > 0 and config.resolved_backend() == "nccl":
            out.append(f"recv_ahead={k} can deadlock on NCCL (a posted receive holds the stream a "
                       f"send to the same peer needs); use recv_ahead=0 with NCCL, or backend='gloo'")
        try:
            sched = schedules.build(cls.schedule, p, m, v)
        except ValueError as e:
            return out + [str(e)]
        n_layer = config.model_config().n_layer
        if n_layer < sched.n_stages:
            out.append(f"{cls.schedule} on {p} pipeline ranks has {sched.n_stages} stages but the "
                       f"GPT has n_layer={n_layer} blocks; use n_layer >= {sched.n_stages}")
        return out

    # --- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, ctx = self.ctx.config, self.ctx
        p, d, t, m, v = self.layout(cfg)
        self.p, self.d, self.t, self.m = p, d, t, m
        self.mesh = Mesh({"dp": d, "pp": p, "tp": t}, device_type=ctx.device.type)
        self.pp_rank, self.dp_rank = self.mesh.rank("pp"), self.mesh.rank("dp")
        self.sched = schedules.build(self.schedule, p, m, v)
        model = self.build_model()
        self.state_keys = list(model.state_dict())
        n = self.sched.n_stages
        if cfg.options.get("balance", "params") == "time":
            costs = [None]
            if ctx.rank == 0:
                x, y = (t[: cfg.batch_size // (d * m)] for t in _sample_batch(cfg))
                costs = [time_costs(model, (x.to(ctx.device), y.to(ctx.device)))]
            dist.broadcast_object_list(costs, src=0)
            blocks, first, last = costs[0]
        else:
            blocks, first, last = param_costs(model)
        self.ranges = partition(blocks, n, first, last)  # costs of the whole model: t divides each
        if t > 1:
            model = TensorParallelGPT(model, self.mesh.comm("tp")).to(ctx.device)
        self.stages = {s: StageModule(model, self.ranges[s], s == 0, s == n - 1)
                       for s in self.sched.stages_of(self.pp_rank)}
        self.named = {}
        for st in self.stages.values():
            self.named.update(st.named_full_parameters())
        params = list({id(t): t for t in self.named.values()}.values())
        self.params = params
        self.optimizer = self.build_optimizer(params)
        self.meter = ActivationMeter(params)
        self.store = WeightGradStore(self.meter) if self.sched.split_backward else None
        if self.store is not None:
            for st in self.stages.values():
                split_linears(st, self.store)
        self.tied_comm = self._tied_group(model)
        self.executor = Executor(self.sched, self.pp_rank, self.stages, self.mesh.comm("pp"),
                                 ctx.timeline, self.meter, self.store, ctx.device,
                                 recv_ahead=self.recv_ahead(cfg))
        mc = cfg.model_config()
        self.act_shape = (cfg.batch_size // (d * m), mc.seq_len, mc.d_model)

    def _tied_group(self, model) -> Comm | None:
        """The group of the two ranks holding (this shard of) the tied matrix, per replica and
        tensor-parallel rank (every rank creates every group: ``new_group`` is collective)."""
        if not model.cfg.tied:
            return None
        first, last = self.sched.stage_rank[0], self.sched.stage_rank[-1]
        if first == last:
            return None
        mine = None
        tp_rank = self.mesh.rank("tp")
        for r in range(self.d):
            for k in range(self.t):
                # the mesh is row-major over (dp, pp, tp)
                g = dist.new_group([(r * self.p + s) * self.t + k for s in (first, last)])
                if (r, k) == (self.dp_rank, tp_rank) and self.pp_rank in (first, last):
                    mine = Comm(g)
        return mine

    # --- a step ---------------------------------------------------------------------------
    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.dp_rank, self.d))
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        tl = self.ctx.timeline
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        loss = self.executor.run(list(xs), list(ys), self.act_shape)
        if self.tied_comm is not None:
            with tl.span("all_reduce", what="tied"):
                tied = self.named["embed.tok.weight"]
                self.tied_comm.all_reduce(tied.grad)
        if self.d > 1:
            with tl.span("all_reduce", what="dp"):
                grads = [p.grad for p in self.params]
                flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.d)
                self.mesh.comm("dp").all_reduce(flat)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset: offset + g.numel()].view_as(g))
                    offset += g.numel()
        with tl.span("optimizer"):
            self.optimizer.step()
        # Logging: the last stage's t ranks of each replica know its replica's loss; one raw
        # all-reduce (not the counting Comm) gives every rank the global mean.
        t = torch.zeros(1, device=self.ctx.device)
        if loss is not None:
            t += loss.reshape(1) / (self.d * self.t)
        dist.all_reduce(t)
        return t.item()

    # --- reporting ------------------------------------------------------------------------
    def memory(self):
        mem = model_state_memory(self.params, self.optimizer)
        mem["activations"] = self.meter.peak
        # receive buffers posted and not yet handed to a stage, counted from their storages
        # (once handed over they are that stage's saved input and count as activations)
        mem["comm_buffers"] = self.executor.posted_peak
        return mem

    def full_state_dict(self):
        # The same names, in the same order, on every rank of a stage's TP group.
        tp = self.mesh.group("tp")
        mine = {k: gather_shards(t, TensorParallelGPT.shard_dim(k), tp).cpu().clone()
                for k, t in self.named.items()}
        gathered = [None] * self.p
        dist.all_gather_object(gathered, mine, group=self.mesh.group("pp"))
        full = {}
        for part in gathered:
            full.update(part)
        return {k: full[k] for k in self.state_keys}

    def comms(self):
        return list(self.mesh.comms.values()) + ([self.tied_comm] if self.tied_comm else [])


def _sample_batch(cfg):
    from dlab.models.data import make_data
    return make_data(cfg).global_batch(0)


@register("pipeline-naive")
class PipelineNaive(Pipeline):
    """Pipeline without micro-batches: the batch walks down the stages, one rank busy at a time."""
    schedule = "naive"


@register("pipeline-gpipe")
class PipelineGPipe(Pipeline):
    """GPipe: all forwards, then all backwards (Huang et al. 2019)."""
    schedule = "gpipe"


@register("pipeline-1f1b")
class Pipeline1F1B(Pipeline):
    """1F1B: one forward, one backward; at most p micro-batches in flight (Narayanan et al. 2021)."""
    schedule = "1f1b"


@register("pipeline-interleaved")
class PipelineInterleaved(Pipeline):
    """Interleaved 1F1B: v stages per rank, the bubble divided by v (Narayanan et al. 2021)."""
    schedule = "interleaved"
    default_v = 2


@register("pipeline-zb-h1")
class PipelineZBH1(Pipeline):
    """ZB-H1: backward split into input and weight gradients, W fills the drain (Qi et al. 2023)."""
    schedule = "zb-h1"


@register("pipeline-zbv")
class PipelineZBV(Pipeline):
    """ZB-V: two stages per rank in a V, split backward (Qi et al. 2024)."""
    schedule = "zbv"
    default_v = 2
