"""The ``nd`` strategy: every dimension on one mesh - pipeline stages, data parallelism with ZeRO
stage 0-3, context parallelism, tensor parallelism with or without sequence parallelism, and
expert parallelism folded onto the data ranks.

``dlab.launch("nd", 8, options={"dp": 2, "zero": 3, "pp": 2, "tp": 2})``. Options: ``pp``,
``dp`` (default: what the others leave), ``cp``, ``tp``, ``ep`` (degrees); ``zero`` (0-3 over
the dp x cp data ranks); ``schedule`` (gpipe, 1f1b - default -, interleaved, zb-h1, zbv, dualpipev),
``microbatches`` (default 4 with pp > 1, else 1), ``virtual_stages``; ``sequence_parallel``;
``attention`` (ring, allgather, ulysses or usp, with ``ulysses`` its group size) and ``layout``
(zigzag or contiguous) for cp; ``precision`` (``dlab.core.precision.PRECISIONS``: fp32, bf16,
bf16-fp32-grads, fp16 with dynamic loss scaling; ``dlab.parallel.mixed``);
``reduce_scatter`` (backend or ring), ``recv_ahead`` and ``balance`` (deal blocks out to stages by
parameter count, default, or by measured time). The layout, its order and its rules:
``dlab.layout``; the ``pipeline-*`` strategies are this one with pp alone (and dp, tp).

One step, on every rank, is built from the single-dimension strategies' parts:

1. the model: the GPT built from the seed (``Strategy.build_model``), cut into this rank's
   tensor-parallel shard (``TensorParallelGPT``), its MoE layers' experts cut to this rank's
   E/ep with the all-to-all dispatch (``ExpertParallelCombine``), every attention core
   replaced by the ring (all-gather, Ulysses, USP) over the cp group (``context.attention``); the
   blocks dealt out to pipeline stages by parameter count or measured time (``StageModule``,
   ``dlab.layout.stages.partition``);
2. the data: this replica's rows of the global batch (by dp coordinate), this cp rank's
   tokens of each sequence (``context.layout.positions``), cut into m micro-batches;
3. the schedule: ``pipeline.Executor`` runs this pipeline rank's action list (with pp = 1, a
   one-stage schedule: m forward/backward pairs, i.e. gradient accumulation);
4. the gradient reductions, each over its own group: the tied embedding/head matrix over the
   first and last stage; under sequence parallelism the replicated parameters over tp; every
   dense parameter over the dp x cp data ranks with ZeRO (``sharding.DataSharding``); an
   expert's over the data ranks holding the same expert;
5. the optimizer step (on the owned chunks for ZeRO >= 1) and, for stages 1-2, the all-gather
   of the updated replica. In mixed precision the optimizer steps the fp32 masters (its own
   parameters, so its state dict holds them) and the compute copies are refreshed from them
   first; under fp16 the step is skipped on every rank together when any gradient overflowed.

Each rank's loss is the mean over its tokens / m; the data ranks hold equally many tokens, so
averaging the summed gradients over them gives the gradient of the global mean loss, which is
what makes every layout train like ``single`` (tests/test_nd_parity.py).

``comm_buffers``: the most bytes the rank's transient buffers hold at once in the step, counted
by one ``Transient`` the executor (posted receives) and the shardings (``sharding``'s list)
share; ``recv_peak``, ``gathered_peak``, ``reduce_peak`` and ``master_grad_peak`` are each
part's own peak, all derived in ``dlab.theory.nd_buffers``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dlab.comm.instrumented import reduce_scatter_option
from dlab.core.metrics import ActivationMeter, Transient, optimizer_tensors, storage_bytes
from dlab.core.precision import LossScaler
from dlab.layout import CP, DP, PP, SCHEDULES, TP, Layout, ranks, tokens
from dlab.layout.stages import partition
from dlab.models.data import make_data, shard
from dlab.parallel import register
from dlab.parallel.base import REDUCE_SCATTER, Option, Strategy
from dlab.parallel.context.core import ATTENTION, ULYSSES
from dlab.parallel.grads import reduce_gradients
from dlab.parallel.mesh import Mesh
from dlab.parallel.mixed import PRECISION, precision_of, scaled_step
from dlab.parallel.nd import compose
from dlab.parallel.nd import state as nd_state
from dlab.parallel.pipeline.executor import Executor
from dlab.parallel.pipeline.split import param_costs, time_costs
from dlab.parallel.pipeline.weight_grad import WeightGradStore, split_linears
from dlab.parallel.tensor.model import TensorParallelGPT, gather_shards
from dlab.parallel.zero.sharded import UnitActivationMeter
from dlab.theory import nd as nd_theory

#: the pipeline's options, ``nd``'s and ``pipeline-*``'s alike
PIPELINE_OPTIONS = {
    "microbatches": Option("int", "micro-batches per step (default 4 with pp > 1, else 1; the "
                           "naive pipeline 1)", minimum=1),
    "virtual_stages": Option("int", "stages per rank for the interleaved schedules (default 2)",
                             minimum=1),
    "balance": Option("choice", "deal blocks out to stages by parameter count or by measured "
                      "time", default="params", choices=("params", "time")),
    "recv_ahead": Option("int", "pipeline receives kept posted ahead (default 2v on Gloo, 0 on "
                         "NCCL)", minimum=0),
}

_D = Layout()  # the layout's defaults, declared once as its fields

OPTIONS = {
    "dp": Option("int", "data-parallel replicas (default: world / (pp tp cp))", minimum=1),
    "pp": Option("int", "pipeline stages (ranks per pipeline)", default=_D.pp, minimum=1),
    "tp": Option("int", "tensor-parallel ranks per layer", default=_D.tp, minimum=1),
    "cp": Option("int", "context-parallel ranks per sequence", default=_D.cp, minimum=1),
    "ep": Option("int", "expert-parallel ranks, folded onto the dp x cp data ranks (model='moe')",
                 default=_D.ep, minimum=1),
    "zero": Option("int", "ZeRO stage over the dp x cp data ranks (0-3)", default=_D.zero, minimum=0),
    "schedule": Option("choice", "the pipeline schedule", default=_D.schedule,
                       choices=tuple(s for s in SCHEDULES if s != "naive")),
    "sequence_parallel": Option("bool", "split the sequence over tp outside the tensor-parallel "
                                "regions (Korthikanti et al.)", default=_D.sequence_parallel),
    "attention": Option("choice", "context-parallel attention", default=_D.cp_attention,
                        choices=tuple(ATTENTION)),
    "ulysses": ULYSSES,
    "layout": Option("choice", "how cp cuts a sequence", default=_D.cp_layout, choices=tokens.LAYOUTS),
    "precision": PRECISION,
    **PIPELINE_OPTIONS,
    **REDUCE_SCATTER,
}


@register("nd")
class ND(Strategy):
    """Every dimension on one mesh: PP x DP (ZeRO 0-3) x CP x TP (+SP), EP folded onto DP x CP."""

    @classmethod
    def check_options(cls) -> dict:
        return {"pp": 2, "zero": 1}  # a composition: two stages, ZeRO-1 over what dp is left

    OPTIONS = OPTIONS

    @classmethod
    def layout(cls, config) -> Layout:
        return Layout.from_options(config.options, config.world_size)

    @classmethod
    def model_problems(cls, config):
        if config.model not in ("gpt", "moe"):
            return [f"{config.strategy} composes the GPT's dimensions; use model='gpt' or "
                    f"'moe' (got {config.model!r})"]
        return []

    @classmethod
    def problems(cls, config):
        out = super().problems(config)
        if cls.recv_ahead(config) > 0 and config.resolved_backend() == "nccl":
            out.append(f"recv_ahead={cls.recv_ahead(config)} can deadlock on NCCL (a posted receive "
                       f"holds the stream a send to the same peer needs); use recv_ahead=0 with "
                       f"NCCL, or backend='gloo'")
        return out

    @classmethod
    def recv_ahead(cls, config) -> int:
        """Receives kept posted ahead: 2v on Gloo (about one per stream a rank receives on),
        none on NCCL (``dlab.parallel.pipeline.executor``)."""
        if "recv_ahead" in config.options:
            return config.options["recv_ahead"]
        return 0 if config.resolved_backend() == "nccl" else 2 * cls.layout(config).virtual_stages

    # --- its theory ---------------------------------------------------------------------
    @classmethod
    def predicted_state(cls, config, rank):
        """``dlab.theory.nd.model_state`` of this rank's pipeline stage(s)."""
        lay = cls.layout(config)
        pp_rank = ranks.coords(lay.dims, rank)[PP]
        state = nd_theory.model_state(config.model_config(), lay, pp_rank, config.optimizer,
                                      config.options.get("precision", "fp32"))
        return {k: state[k] for k in ("parameters", "gradients", "optimizer")}

    @classmethod
    def pipeline(cls, config):
        lay = cls.layout(config)
        if lay.pp == 1:
            return None
        return lay.pipeline(), ranks.groups(lay.dims, (PP,))

    # --- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        ctx, cfg = self.ctx, self.ctx.config
        self.lay = lay = self.layout(cfg)
        self.mesh = mesh = Mesh.of(lay, device_type=ctx.device.type)
        self.pp_rank = mesh.rank(PP)
        self.data_comm = mesh.subgroup(compose.DATA)
        for comm in (*mesh.comms.values(), self.data_comm):
            comm.reduce_scatter_algorithm = reduce_scatter_option(cfg)
        self.sched = lay.pipeline()
        full = self.build_model()
        self.state_keys = list(full.state_dict())  # the single model's names, for checkpoints
        blocks, first, last = self._block_costs(full)  # the whole model's: every tp rank cuts alike
        self.ranges = partition(blocks, self.sched.n_stages, first, last)
        # the composition (dlab.parallel.nd.compose), each step on what the one before made
        model = compose.tensor_parallel(full, mesh, lay, ctx.device)
        self.combines, self.expert_comm, self.expert_data_comm = compose.expert_parallel(
            model, mesh, lay, getattr(cfg.model_config(), "n_expert", None))
        self.positions, self.context_comms = compose.context_parallel(
            model, mesh, lay, cfg.model_config().seq_len, ctx.device)
        self.stages = compose.stages(model, self.sched, self.ranges, self.pp_rank, self.positions)
        self.tied_comm = compose.tied_pair(model, mesh, self.sched)
        self.prec = precision_of(cfg)
        self.transient = Transient()  # one count of every transient buffer: one comm_buffers peak
        self.shardings = compose.data_sharding(self.stages, lay, self.data_comm, self.expert_data_comm,
                                               ctx.device, ctx.timeline, self.transient, self.prec)
        self.dense = self.shardings[0]
        self.params = [p for s in self.shardings for p in s.params]
        mine = {id(p) for p in self.params}  # this rank's stages' replicated parameters only
        self.sp_params = [p for p in (model.sequence_parallel_params() if lay.tp > 1 else [])
                          if id(p) in mine]
        self._training_parts()

    def _training_parts(self) -> None:
        """What runs the schedule over the composed stages: the optimizer over the shardings'
        (master) parameters, the activation meter, the zero-bubble schedules' weight-gradient
        store, the executor, and fp16's loss scaler."""
        ctx, cfg, lay, prec = self.ctx, self.ctx.config, self.lay, self.prec
        self.rows_seen = (0, 0)
        self.optimizer = self.build_optimizer([p for s in self.shardings for p in s.optimizer_params()])
        self.meter = (UnitActivationMeter([u for s in self.shardings for u in s.units])
                      if lay.zero == 3 else ActivationMeter(self.params))
        self.store = WeightGradStore(self.meter) if self.sched.split_backward else None
        if self.store is not None:
            for st in self.stages.values():
                split_linears(st, self.store)
        self.executor = Executor(self.sched, self.pp_rank, self.stages, self.mesh.comm(PP),
                                 ctx.timeline, self.meter, self.store, ctx.device, self.transient,
                                 recv_ahead=self.recv_ahead(cfg))
        self.executor.act_dtype = prec.compute
        self.scaler = LossScaler() if prec.loss_scaled else None
        if prec.mixed:
            for st in self.stages.values():
                st.criterion = self._mixed_criterion(st.criterion)
        mc = cfg.model_config()
        tokens_per_rank = mc.seq_len // lay.cp // (lay.tp if lay.sequence_parallel else 1)
        self.act_shape = (cfg.batch_size // (lay.dp * lay.microbatches), tokens_per_rank, mc.d_model)

    def _mixed_criterion(self, criterion):
        """The loss in fp32 from the compute-dtype logits (softmax over a vocabulary is where
        bf16's 8 bits hurt most), times the loss scale under fp16 (undone in ``step``'s log)."""
        def loss(logits, y):
            out = criterion(logits.float(), y)
            return out * self.scaler.scale if self.scaler is not None else out
        return loss

    def _block_costs(self, model) -> tuple[list[float], float, float]:
        """Each block's load (and the embedding's and head's), by parameter count or, with
        ``balance="time"``, by forward+backward time measured on rank 0 and broadcast."""
        cfg = self.ctx.config
        if cfg.options.get("balance", "params") != "time":
            return param_costs(model)
        costs = [None]
        if self.ctx.rank == 0:
            rows = cfg.batch_size // (self.lay.dp * self.lay.microbatches)
            x, y = (t[:rows].to(self.ctx.device) for t in make_data(cfg).global_batch(0))
            costs = [time_costs(model, (x, y))]
        dist.broadcast_object_list(costs, src=0)
        return costs[0]

    # --- a step ---------------------------------------------------------------------------
    def step(self, batch):
        lay, tl = self.lay, self.ctx.timeline
        x, y = shard(batch, self.mesh.rank(DP), lay.dp)
        if self.positions is not None:
            cols = self.positions.cpu()
            x, y = x[:, cols], y[:, cols]
        x, y = x.to(self.ctx.device), y.to(self.ctx.device)
        self.transient.reset_peak()
        for s in self.shardings:
            s.begin_step(self.optimizer)
        self.meter.reset_peak()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss = self.executor.run(list(x.chunk(lay.microbatches)), list(y.chunk(lay.microbatches)),
                                 self.act_shape)
        for s in self.shardings:
            s.fold()
        if self.tied_comm is not None:
            with tl.span("all_reduce", what="tied"):
                self.tied_comm.all_reduce(self.dense.grad(self.stages_param("embed.tok.weight")))
        if self.sp_params:
            with tl.span("all_reduce", what="sequence_parallel"):
                reduce_gradients(self.sp_params, self.mesh.comm(TP), divide_by=1,
                                 transient=self.transient)
        for s in self.shardings:
            s.reduce()
            s.hand_grads()
        if scaled_step(self.scaler, [g for s in self.shardings for g in s.master_grads()]):
            with tl.span("optimizer"):
                self.optimizer.step()
        for s in self.shardings:
            s.after_step()
        # Logging: the last stage's ranks know their data ranks' losses; one raw all-reduce.
        t = torch.zeros(1, device=self.ctx.device)
        if loss is not None:
            t += loss.float().reshape(1) / (lay.dp * lay.cp * lay.tp * scale)
        dist.all_reduce(t)
        return t.item()

    def stages_param(self, name: str):
        for st in self.stages.values():
            named = st.named_full_parameters()
            if name in named:
                return named[name]
        raise KeyError(name)

    # --- reporting ------------------------------------------------------------------------
    def step_extras(self):
        """``expert_rows``: the rows this rank's routing sent to and received from other expert-
        parallel ranks in the step (``estimate.nd.expert_bytes`` predicts the all-to-all bytes
        from them), and ``calls``: per block, per forward of its MoE layer, the assignments the
        rank routed and the rows its experts received (``estimate.nd.activations``)."""
        if self.expert_comm is None:
            return {}
        sent = sum(c.rows_sent for c in self.combines)
        received = sum(c.rows_received for c in self.combines)
        step = {"sent": sent - self.rows_seen[0], "received": received - self.rows_seen[1],
                "calls": [c.calls for c in self.combines]}
        self.rows_seen = (sent, received)
        for c in self.combines:
            c.calls = []
        return {"expert_rows": step}

    def memory(self):
        mem = {"parameters": 0, "gradients": 0,
               "optimizer": storage_bytes(optimizer_tensors(self.optimizer))}
        for s in self.shardings:
            for k, v in s.memory().items():
                mem[k] += v
        mem["activations"] = self.meter.peak
        # every transient buffer at once (dlab.theory.nd_buffers), then its parts on their own
        mem["comm_buffers"] = self.transient.peak
        mem["recv_peak"] = self.executor.posted_peak
        for key, kind in (("gathered_peak", "unit"), ("reduce_peak", "reduce"),
                          ("master_grad_peak", "master_grad")):
            mem[key] = self.transient.kind_peak.get(kind, 0)
        return mem

    def full_state_dict(self):
        mine = {}
        for s in self.shardings:
            mine.update(s.full_params())
        tp = self.mesh.group(TP)
        mine = {k: gather_shards(t, TensorParallelGPT.shard_dim(k) if self.lay.tp > 1 else None,
                                 tp).cpu().clone() for k, t in mine.items()}
        groups = [self.mesh.group(PP)] + ([self.expert_comm.group] if self.expert_comm else [])
        for group in groups:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            mine = {k: v for part in gathered for k, v in part.items()}
        return {k: mine[k] for k in self.state_keys}

    # --- checkpoints: the logical tensors' pieces (dlab.parallel.nd.state) --------------------
    def checkpoint_state(self):
        return nd_state.checkpoint_state(self)

    def load_checkpoint_state(self, reader):
        nd_state.load_checkpoint_state(self, reader)

    def comms(self):
        extra = [self.data_comm, self.tied_comm, self.expert_comm, self.expert_data_comm]
        return list(self.mesh.comms.values()) + [c for c in extra if c is not None] + [
            c for c in self.context_comms if c is not self.mesh.comm(CP)]

    def comms_by_dim(self):
        """Named as ``estimate.nd.step_bytes`` names its terms (the mesh's own dp group carries
        nothing: the data reduction runs over the dp x cp ranks)."""
        named = {"tensor": self.mesh.comm(TP), "context": self.context_comms or self.mesh.comm(CP),
                 "pipeline": self.mesh.comm(PP), "tied": self.tied_comm, "data": self.data_comm,
                 "expert": self.expert_comm, "expert_data": self.expert_data_comm}
        return {k: c for k, c in named.items() if c is not None}

