"""A layout to plan: the degrees of every dimension and the choices that go with them.

The mesh is ``nd``'s (``dlab.layout``, whose rules the layouts here are held to): pp x dp x cp
x tp, tp fastest. Ranks fill
nodes in order, so a dimension's group spans ``stride x degree`` consecutive ranks, its stride
the product of the degrees inside it: tp spans tp ranks, cp tp x cp, the data ranks (dp x cp,
over which gradients are reduced and ZeRO shards) tp x cp x dp, and a pipeline neighbour is
tp x cp x dp ranks away (inside a node only if the whole pipeline is). ``Cluster.link`` turns
a span into the link it runs on. Expert parallelism folds onto the data ranks (ep of them next
to each other, stride tp).

A ``PlanLayout`` is the ``Layout`` of ``nd`` (the same degrees, names and rules) plus how a step
runs at scale: ``micro_batch`` is the sequences one micro-batch carries on a rank, so a global
batch B makes m = B / (dp x micro_batch) micro-batches per step (``for_batch``); recomputation,
precision, the attention kernel, and hybrid sharding (``zero_group``). What overlaps with what is
the software stack's (``dlab.theory.plan.stacks``), not the layout's.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from dlab.core.precision import PRECISIONS
from dlab.layout import Layout, shape

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "math")


@dataclass(frozen=True)
class PlanLayout(Layout):
    """``dlab.layout.Layout`` (its degrees, schedule, names and rules: ``nd``'s) and how a step
    runs at scale. ``microbatches`` follows from the global batch (``for_batch``)."""

    #: sequences one micro-batch carries on a rank: m = B / (dp x micro_batch)
    micro_batch: int = 1
    recompute: str = "none"
    #: full recomputation of one layer in every this many (torchtitan's "selective layer"
    #: checkpointing, every second layer by default; 1: every layer)
    recompute_every: int = 1
    #: "bf16": the ZeRO paper's mixed precision (2 + 2 + 12 bytes per parameter);
    #: "bf16-fp32-grads": Megatron's (fp32 gradient buffer: 2 + 4 + 12); "fp32": 4 + 4 + 8
    precision: str = "bf16"
    #: "flash" (FlashAttention: no s x s matrix kept) or "math" (the softmax kept, as in 2022)
    attention: str = "flash"
    #: hybrid sharding (FSDP's HYBRID_SHARD, HSDP): ZeRO shards over groups of this many data
    #: ranks and the groups' shards are all-reduced; 0: over all dp x cp data ranks
    zero_group: int = 0
    #: under full recomputation, each layer's saved input is cut over the tp ranks (Megatron's
    #: --distribute-saved-activations, metaseq's --distribute-checkpointed-activations)
    distribute_saved: bool = False

    def for_batch(self, global_batch: int) -> PlanLayout:
        """This layout with the micro-batches a global batch of ``global_batch`` sequences makes."""
        return _for_batch(self, global_batch)

    def span(self, dim: str) -> int:
        """Consecutive ranks one group of ``dim`` covers (module docstring)."""
        t, c, d = self.tp, self.cp, self.dp
        return {"tp": t, "cp": t * c, "data": t * c * d, "ep": t * self.ep,
                "pp": t * c * d * self.pp}[dim]

    def describe(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("pp", "dp", "cp", "tp") if getattr(self, k) > 1]
        extra = [f"ep{self.ep}"] if self.ep > 1 else []
        extra += [f"zero{self.zero}"] if self.zero else []
        extra += [f"shard{self.zero_group}"] if self.zero and self.zero_group else []
        extra += ["sp"] if self.sequence_parallel and self.tp > 1 else []
        if self.pp > 1:
            v = self.virtual_stages
            extra.append(self.schedule + (f" v{v}" if v > 1 else ""))
        every = f"/{self.recompute_every}" if self.recompute_every > 1 else ""
        extra += [f"mb{self.micro_batch}"] + ([self.recompute + every] if self.recompute != "none" else [])
        extra += ["saved/tp"] if self.distribute_saved else []
        return " ".join([" x ".join(parts) or "single", *extra])

    def asdict(self) -> dict:
        return asdict(self)

    def nd_options(self, global_batch: int) -> dict:
        """The ``nd`` strategy's options that run this layout (recomputation is a model option)."""
        out = {k: getattr(self, k) for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1}
        if self.zero:
            out["zero"] = self.zero
        if self.sequence_parallel and self.tp > 1:
            out["sequence_parallel"] = True
        if self.pp > 1:
            out.update(schedule=self.schedule,
                       microbatches=self.for_batch(global_batch).microbatches)
            if self.virtual_stages > 1:
                out["virtual_stages"] = self.virtual_stages
        return out

    def problems(self, spec, global_batch: int, seq_len: int) -> list[str]:
        """What stops this layout for this model and batch, each saying what to change: the
        planner's own fields here, every rule of the degrees in ``Layout.problems`` (the ones
        ``nd`` and ``pipeline-*`` are held to; the lab's own code's rules apply to the lab's GPT
        only: real models pad their vocabulary and split any MLP)."""
        return list(_problems(self, spec, global_batch, seq_len))

    def _problems(self, spec, global_batch: int, seq_len: int) -> list[str]:
        bad = [f"{k}={getattr(self, k)!r} must be a whole number >= 1"
               for k in ("dp", "micro_batch", "recompute_every")
               if not _whole(getattr(self, k)) or getattr(self, k) < 1]
        if bad:
            return bad
        out = []
        for field, value, choices in (("recompute", self.recompute, RECOMPUTE),
                                      ("precision", self.precision, PRECISIONS),
                                      ("attention", self.attention, ATTENTION)):
            if value not in choices:
                out.append(f"{field}={value!r}; choose one of {', '.join(choices)}")
        if self.recompute_every > 1 and (self.recompute != "full" or spec.gpt is not None):
            out.append(f"recompute_every={self.recompute_every} recomputes some layers whole: it "
                       f"needs recompute='full' and a model other than the lab's GPT (whose nd "
                       f"recomputes every layer or none); use recompute_every=1")
        if self.distribute_saved and (self.recompute != "full" or spec.gpt is not None):
            out.append("distribute_saved cuts each recomputed layer's saved input over the tp ranks: "
                       "it needs recompute='full' and a model other than the lab's GPT; use "
                       "distribute_saved=False")
        n = self.dp * self.cp
        if not _whole(self.zero_group) or self.zero_group < 0 or (self.zero_group and n % self.zero_group):
            out.append(f"zero_group={self.zero_group!r} must be 0 (shard over all {n} data ranks) "
                       f"or a divisor of dp x cp = {n}")
        if global_batch % (self.dp * self.micro_batch):
            return out + [f"global batch {global_batch} does not split into dp={self.dp} x "
                          f"micro_batch={self.micro_batch}; pick a multiple of "
                          f"{self.dp * self.micro_batch}"]
        lay = self.for_batch(global_batch)
        if spec.gpt is not None and self.pp == 1 and lay.microbatches > 1:
            out.append(f"dlab's nd accumulates micro-batches only under a pipeline; with pp=1 use "
                       f"micro_batch = batch / dp = {global_batch // self.dp}")
        return out + Layout.problems(lay, shape(spec, seq_len), lay.dp * lay.microbatches,
                                     lab=spec.gpt is not None)


@functools.lru_cache(maxsize=65536)
def _for_batch(lay: PlanLayout, global_batch: int) -> PlanLayout:
    return replace(lay, microbatches=max(global_batch // (lay.dp * lay.micro_batch), 1))


@functools.lru_cache(maxsize=65536)
def _problems(lay: PlanLayout, spec, global_batch: int, seq_len: int) -> tuple[str, ...]:
    """``PlanLayout.problems``, remembered: a search asks once, ``plan`` again."""
    return tuple(lay._problems(spec, global_batch, seq_len))


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
