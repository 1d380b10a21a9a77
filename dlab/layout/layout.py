"""A layout: how many ranks each dimension takes, in which order, and what it must divide.

``Layout`` holds the degrees - ``pp`` pipeline stages, ``dp`` data-parallel replicas (with ZeRO
stage ``zero`` over the data ranks), ``cp`` context-parallel ranks per sequence, ``tp``
tensor-parallel ranks per layer, ``ep`` expert-parallel ranks folded onto the data ranks - and
the choices that go with them (the pipeline schedule, micro-batches, virtual stages, sequence
parallelism, how cp cuts a sequence and attends across it). Its ``problems`` is the one place
the rules live: ``nd``, ``pipeline-*`` and the planner (``dlab.theory.plan``) all ask it, before
any process starts, and ``dlab.layout.ranks`` places the ranks of every layout the same way.

The mesh is ``pp x dp x cp x tp``, row-major, so tp varies fastest: the ranks of a
tensor-parallel group are adjacent, then those of a context-parallel ring, then the replicas,
then the stages. Adjacent ranks share a node (and its NVLink) on a real cluster, so the
dimension that talks most goes innermost: tp (two all-reduces or all-gather/reduce-scatter
pairs per layer, on the critical path), then cp (K/V blocks per layer, overlapped with
attention), then dp (one gradient reduction per step, or with ZeRO-3 one gather per layer,
overlapped), then pp (one activation per micro-batch at a stage boundary). It is
Megatron-Core's order (tp-cp-ep-dp-pp) and torchtitan's ([pp, dp, cp, tp]).

Data ranks: dp x cp. The cp ranks of a replica hold different tokens of the same sequences, so
a gradient is reduced over all dp x cp ranks of a stage (as Megatron and torchtitan do), and
ZeRO shards the optimizer state over those dp x cp ranks, not over dp alone.

Expert parallelism is *folded* (Megatron-Core's MoE "parallel folding", Liu et al. 2025): it
takes no ranks of its own. The ep experts' owners are ep consecutive data ranks of a stage (cp
fastest); each group of ep ranks exchanges its tokens by all-to-all, and the dp x cp / ep groups
holding the same experts reduce those experts' gradients among themselves.

Two kinds of rule, kept apart: what any implementation needs (the degrees multiply to the
world, tp divides the heads, the sequence cuts into cp's chunks, ...) and what the lab's own
code needs on top (``lab=True``: tp cuts the MLP and the vocabulary exactly, without Megatron's
vocabulary padding; the zero-bubble schedules' split backward is written for ``nn.Linear``, not
for the tensor-parallel layers; a MoE under tp routes each rank's own tokens only under sequence
parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from dlab.layout import schedules, tokens

#: the mesh's axes, named once (torchtitan names its mesh's dimensions once too): the same
#: strings are a ``Layout``'s degree fields and the options that set them
PP, DP, CP, TP, EP = "pp", "dp", "cp", "tp", "ep"
#: the mesh's dimensions, outermost first (tp varies fastest)
MESH_ORDER = (PP, DP, CP, TP)
#: the pipeline schedules a layout may run (``naive``: one micro-batch, one stage busy at a time)
SCHEDULES = tuple(schedules.SCHEDULES)
#: how context parallelism attends across its ranks (``dlab.parallel.context.attention``)
CP_ATTENTION = ("ring", "allgather", "ulysses", "usp")


@dataclass(frozen=True)
class Shape:
    """What of a model a layout must divide: the lab's ``GPTConfig`` / ``MoEConfig`` and the
    planner's ``Transformer`` both read as one (``shape``)."""
    n_layer: int
    n_head: int
    n_kv_head: int
    d_ff: int
    vocab: int
    seq_len: int
    n_expert: int = 1


def shape(model, seq_len: int | None = None) -> Shape:
    """The ``Shape`` of a lab model config (``vocab_size``, its own ``seq_len``) or a planner
    ``Transformer`` (``vocab``, ``n_kv_head``; the sequence given)."""
    return Shape(n_layer=model.n_layer, n_head=model.n_head,
                 n_kv_head=getattr(model, "n_kv_head", 0) or model.n_head, d_ff=model.d_ff,
                 vocab=getattr(model, "vocab_size", getattr(model, "vocab", 0)),
                 seq_len=seq_len if seq_len is not None else model.seq_len,
                 n_expert=getattr(model, "n_expert", 1))


@dataclass(frozen=True)
class Layout:
    #: data-parallel replicas (``nd``'s option defaults it to what the others leave)
    dp: int = 1
    #: pipeline stages (ranks per pipeline)
    pp: int = 1
    #: tensor-parallel ranks per layer
    tp: int = 1
    #: context-parallel ranks per sequence
    cp: int = 1
    #: expert-parallel ranks, folded onto the dp x cp data ranks
    ep: int = 1
    #: ZeRO stage over the data ranks: 0 (plain data parallelism) to 3
    zero: int = 0
    #: the pipeline schedule (``dlab.layout.schedules``), its micro-batches per step and stages
    #: per rank
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    #: the sequence split over tp outside the tensor-parallel regions (Korthikanti et al. 2022)
    sequence_parallel: bool = False
    #: how cp cuts a sequence (``dlab.layout.tokens``) and attends across its ranks
    cp_layout: str = "zigzag"
    cp_attention: str = "ring"
    #: Ulysses ranks per group under ``cp_attention="usp"`` (the ring runs across the groups)
    ulysses: int = 2

    @classmethod
    def from_options(cls, options: dict, world_size: int, **defaults) -> Layout:
        """The layout of a strategy's options (``nd``'s names: dp, pp, tp, cp, ep, zero,
        schedule, microbatches, virtual_stages, sequence_parallel, layout, attention, ulysses);
        ``defaults`` stand where an option is absent (a ``pipeline-*`` strategy fixes its
        schedule). ``dp`` defaults to what the others leave of the world (0 when they do not
        divide it: ``problems`` says so); ``microbatches`` to 4 under a pipeline (1 for the
        naive one) and 1 without; ``virtual_stages`` to 2 for the interleaved and V
        schedules."""
        o, d = {**defaults, **options}, cls()  # every default is a field's, declared above
        pp, tp, cp = o.get(PP, d.pp), o.get(TP, d.tp), o.get(CP, d.cp)
        rest = pp * tp * cp if all(_whole(k) and k > 0 for k in (pp, tp, cp)) else 0
        dp = o.get(DP, world_size // rest if rest and world_size % rest == 0 else 0)
        schedule = o.get("schedule", d.schedule)
        m = o.get("microbatches", 1 if pp == 1 or schedule == "naive" else 4)
        v = o.get("virtual_stages", 2 if schedule in ("interleaved", *schedules.V_SHAPED) else 1)
        return cls(dp=dp, pp=pp, tp=tp, cp=cp, ep=o.get(EP, d.ep), zero=o.get("zero", d.zero),
                   schedule=schedule, microbatches=m, virtual_stages=v,
                   sequence_parallel=bool(o.get("sequence_parallel", d.sequence_parallel)),
                   cp_layout=o.get("layout", d.cp_layout), cp_attention=o.get("attention", d.cp_attention),
                   ulysses=o.get("ulysses", d.ulysses))

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)

    # --- what it is ----------------------------------------------------------------------
    @property
    def dims(self) -> dict[str, int]:
        """The mesh's degrees, outermost first (``MESH_ORDER``)."""
        return {PP: self.pp, DP: self.dp, CP: self.cp, TP: self.tp}

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def data_ranks(self) -> int:
        """The ranks a gradient is reduced over and ZeRO shards over: dp x cp."""
        return self.dp * self.cp

    def describe(self) -> str:
        parts = [f"{d}={n}" for d, n in self.dims.items() if n > 1]
        if self.ep > 1:
            parts.append(f"ep={self.ep} (folded)")
        if self.zero:
            parts.append(f"zero={self.zero}")
        return " x ".join(parts) or "one rank"

    def pipeline(self) -> schedules.Schedule:
        """The schedule's action lists for this layout's pipeline ranks (a one-stage schedule
        with pp = 1: m forward/backward pairs, gradient accumulation)."""
        return schedules.build(self.schedule, self.pp, self.microbatches, self.virtual_stages)

    def n_stages(self) -> int:
        return schedules.n_stages(self.schedule, self.pp, self.virtual_stages)

    def head_split(self) -> int:
        """Over how many ranks attention splits the heads: cp for Ulysses, the Ulysses group
        for USP, none for the ring and the all-gather."""
        if self.cp == 1:
            return 1
        return {"ulysses": self.cp, "usp": self.ulysses}.get(self.cp_attention, 1)

    # --- the rules -----------------------------------------------------------------------
    def problems(self, model: Shape, batch_size: int, world_size: int | None = None,
                 lab: bool = True) -> list[str]:
        """Everything that stops this layout for ``model`` (a ``Shape``) and a global batch of
        ``batch_size`` sequences on ``world_size`` ranks (None: any number), each saying what to
        change. ``lab``: the lab's own code runs it (its rules on top; module docstring)."""
        bad = [f"{k}={getattr(self, k)!r} must be a whole number >= 1"
               for k in ("dp", "pp", "tp", "cp", "ep", "microbatches", "virtual_stages", "ulysses")
               if not _whole(getattr(self, k)) or getattr(self, k) < (0 if k == "dp" else 1)]
        if bad:
            return bad
        out = self._degree_problems(world_size)
        if out:
            return out
        if not (_whole(self.zero) and 0 <= self.zero <= 3):
            out.append(f"zero={self.zero!r}: ZeRO has stages 0 (plain data parallelism) to 3 "
                       f"(parameters sharded too); pick one of those")
        out += self._tensor_problems(model, lab)
        out += self._context_problems(model)
        out += self._expert_problems(model, lab)
        out += self.batch_problems(batch_size)
        out += self._pipeline_problems(model, lab)
        return out

    def batch_problems(self, batch_size: int) -> list[str]:
        """The global batch must split into dp replicas of m equal micro-batches."""
        if not batch_size % (self.dp * self.microbatches):
            return []
        if self.microbatches == 1:
            return [f"the global batch_size={batch_size} does not split evenly over {self.dp} "
                    f"data-parallel ranks; use a multiple of {self.dp}"]
        return [f"batch_size={batch_size} must split into dp={self.dp} replicas of "
                f"microbatches={self.microbatches} equal micro-batches: use a multiple of "
                f"{self.dp * self.microbatches}"]

    def _degree_problems(self, world_size: int | None) -> list[str]:
        if self.dp == 0:  # dp left out, and the others do not divide the world
            rest = self.pp * self.cp * self.tp
            named = [f"{d}={n}" for d, n in (("pp", self.pp), ("cp", self.cp), ("tp", self.tp))
                     if n > 1] or ["pp=1"]
            return [f"{' x '.join(named)} takes {rest} ranks, which does not divide "
                    f"world_size={world_size}: pick degrees whose product divides it (dp takes "
                    f"what they leave) or run on a multiple of {rest} ranks"]
        if world_size is not None and self.world != world_size:
            shown = " x ".join(f"{d}={n}" for d, n in self.dims.items())
            return [f"the layout {shown} takes {self.world} ranks but world_size={world_size}; "
                    f"pick degrees whose product is {world_size} (leave dp out and it takes what "
                    f"pp x cp x tp leave, when they divide the world)"]
        return []

    def _tensor_problems(self, model: Shape, lab: bool) -> list[str]:
        t, out = self.tp, []
        if model.n_head % t:
            out.append(f"tp={t} must divide the model's {model.n_head} heads (attention is split "
                       f"by heads): use a tp that divides n_head={model.n_head}")
        elif model.n_kv_head % t and t % model.n_kv_head:
            out.append(f"tp={t} must divide the {model.n_kv_head} key-value heads or be a "
                       f"multiple of them")
        if lab:  # the lab cuts the MLP and the vocabulary exactly, with no padding
            for field, value, why in (("d_ff", model.d_ff, "the MLP's hidden layer is split by columns"),
                                      ("vocab_size", model.vocab, "the embedding and output layer "
                                       "are split by vocabulary")):
                if value % t:
                    out.append(f"model option {field}={value} is not divisible by tp={t} ({why}); "
                               f"use a multiple of {t} or another tp")
        return out

    def _context_problems(self, model: Shape) -> list[str]:
        out = []
        if self.cp_layout not in tokens.LAYOUTS:
            return [f"layout={self.cp_layout!r}: cp cuts a sequence {' or '.join(tokens.LAYOUTS)}"]
        if self.cp_attention not in CP_ATTENTION:
            return [f"attention={self.cp_attention!r}: choose one of {', '.join(CP_ATTENTION)}"]
        pieces = tokens.chunks(self.cp_layout, self.cp) if self.cp > 1 else 1
        if model.seq_len % pieces:
            out.append(f"model option seq_len={model.seq_len} does not cut into {pieces} equal "
                       f"chunks for cp={self.cp} ({self.cp_layout} layout); use a multiple of "
                       f"{pieces}")
        elif self.sequence_parallel and self.tp > 1 and (model.seq_len // self.cp) % self.tp:
            each = f"each cp rank's {model.seq_len // self.cp}" if self.cp > 1 else f"the {model.seq_len}"
            need = (f"cp x tp = {self.cp * self.tp} divides (x2 for zigzag)" if self.cp > 1
                    else f"{self.tp} divides")
            out.append(f"sequence parallelism splits {each} tokens over tp={self.tp}; use a "
                       f"seq_len that {need}, or sequence_parallel=False")
        if self.cp > 1 and self.cp_attention == "usp" and self.cp % self.ulysses:
            out.append(f"option ulysses={self.ulysses} must divide cp={self.cp} (USP cuts the cp "
                       f"ranks into groups of that many; the ring runs across the groups)")
        elif (model.n_head // self.tp) % self.head_split():
            who = f"cp={self.cp}" if self.cp_attention == "ulysses" else f"ulysses={self.ulysses}"
            per_rank = f"n_head={model.n_head}" + (f" / tp={self.tp} = {model.n_head // self.tp}"
                                                   if self.tp > 1 else "")
            out.append(f"attention={self.cp_attention!r} splits the heads over "
                       f"{self.head_split()} ranks: {per_rank} is not a multiple of {who}; make "
                       f"it one (or use attention='ring')")
        return out

    def _expert_problems(self, model: Shape, lab: bool) -> list[str]:
        out = []
        if self.ep > 1 and model.n_expert <= 1:
            out.append(f"ep={self.ep} splits the experts of a mixture of experts; use a MoE model "
                       f"(model='moe') or ep=1")
        elif self.ep > 1 and model.n_expert % self.ep:
            out.append(f"model option n_expert={model.n_expert} does not split over ep={self.ep}; "
                       f"use a multiple of {self.ep}")
        if self.ep > 1 and self.data_ranks % self.ep:
            out.append(f"ep={self.ep} folds onto the dp x cp = {self.data_ranks} data ranks of a "
                       f"stage and must divide them; pick ep among the divisors of "
                       f"{self.data_ranks}")
        if lab and model.n_expert > 1 and self.tp > 1 and not self.sequence_parallel:
            out.append("with tp > 1 the MoE layers need sequence_parallel=True (as Megatron-Core "
                       "requires): each tensor-parallel rank then routes its own slice of the "
                       "tokens instead of all of them routing the same ones")
        return out

    def _pipeline_problems(self, model: Shape, lab: bool) -> list[str]:
        out = []
        found = schedules.problems(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        if found:
            return found
        if lab and self.tp > 1 and self.schedule in schedules.SPLIT_BACKWARD:
            out.append(f"{self.schedule} splits the backward of nn.Linear layers, and the "
                       f"tensor-parallel layers are not split here: use tp=1, or gpipe, 1f1b or "
                       f"interleaved with tp")
        n = self.n_stages()
        if model.n_layer < n:
            out.append(f"{self.schedule} on pp={self.pp} has {n} stages but the model has "
                       f"n_layer={model.n_layer} blocks; use n_layer >= {n} or a smaller pp")
        return out


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
