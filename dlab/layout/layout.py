"""An N-D layout: how many ranks each dimension takes, in which order, and what it must divide.

``Layout`` reads the ``nd`` strategy's options into degrees - ``pp`` pipeline stages, ``dp``
data-parallel replicas (with ZeRO stage ``zero`` over them), ``cp`` context-parallel ranks per
sequence, ``tp`` tensor-parallel ranks per layer, ``ep`` expert-parallel ranks folded onto the
data ranks - and checks them against the model and the batch before any process starts.

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
"""
from __future__ import annotations

from dataclasses import dataclass

from dlab.layout import tokens as cp_layout
from dlab.layout import schedules
from dlab.parallel.tensor.strategy import model_split_problems

#: the mesh's dimensions, outermost first (tp varies fastest)
MESH_ORDER = ("pp", "dp", "cp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int
    cp: int
    ep: int
    zero: int
    schedule: str
    microbatches: int
    virtual_stages: int
    sequence_parallel: bool

    @classmethod
    def from_config(cls, config) -> Layout:
        """Degrees from the options; ``dp`` defaults to what the others leave of the world
        (0 when they do not divide it: ``problems`` says so)."""
        o = config.options
        pp, tp, cp = o.get("pp", 1), o.get("tp", 1), o.get("cp", 1)
        rest = pp * tp * cp
        dp = o.get("dp", config.world_size // rest if config.world_size % rest == 0 else 0)
        schedule = o.get("schedule", "1f1b")
        return cls(dp=dp, pp=pp, tp=tp, cp=cp, ep=o.get("ep", 1), zero=o.get("zero", 0),
                   schedule=schedule, microbatches=o.get("microbatches", 4 if pp > 1 else 1),
                   virtual_stages=o.get("virtual_stages", 2 if schedule in ("interleaved", "zbv") else 1),
                   sequence_parallel=bool(o.get("sequence_parallel", False)))

    @property
    def dims(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def describe(self) -> str:
        parts = [f"{d}={n}" for d, n in self.dims.items() if n > 1]
        if self.ep > 1:
            parts.append(f"ep={self.ep} (folded)")
        if self.zero:
            parts.append(f"zero={self.zero}")
        return " x ".join(parts) or "one rank"

    def schedule_problem(self) -> str | None:
        try:
            schedules.build(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        except ValueError as e:
            return str(e)
        return None

    def n_stages(self) -> int:
        return schedules.build(self.schedule, self.pp, self.microbatches, self.virtual_stages).n_stages

    def problems(self, config) -> list[str]:
        """Everything that would stop this layout, each saying what to change."""
        out = []
        product = self.dp * self.pp * self.cp * self.tp
        if self.dp == 0:  # dp left out, and the others do not divide the world
            rest = self.pp * self.cp * self.tp
            return [f"pp x cp x tp = {self.pp} x {self.cp} x {self.tp} = {rest} ranks does not "
                    f"divide world_size={config.world_size}; pick degrees whose product divides "
                    f"it (dp takes the rest) or run on a multiple of {rest} ranks"]
        if product != config.world_size:
            shown = " x ".join(f"{d}={n}" for d, n in self.dims.items())
            return [f"the layout {shown} takes {product} ranks but world_size={config.world_size}; "
                    f"pick degrees whose product is {config.world_size} (leave dp out and it "
                    f"takes what pp x tp x cp leave, when they divide the world)"]
        if self.zero > 3:
            out.append(f"zero={self.zero}: ZeRO has stages 0 (plain data parallelism) to 3 "
                       f"(parameters sharded too); pick one of those")
        if config.model not in ("gpt", "moe"):
            return out + [f"nd composes the GPT's dimensions; use model='gpt' or 'moe' "
                          f"(got {config.model!r})"]
        mc = config.model_config()
        out += model_split_problems(mc, self.tp)
        pieces = cp_layout.chunks(config.options.get("layout", "zigzag"), self.cp) if self.cp > 1 else 1
        if mc.seq_len % pieces:
            out.append(f"model option seq_len={mc.seq_len} does not cut into {pieces} equal chunks "
                       f"for cp={self.cp} ({config.options.get('layout', 'zigzag')} layout); use a "
                       f"multiple of {pieces}")
        elif self.sequence_parallel and self.tp > 1 and (mc.seq_len // self.cp) % self.tp:
            out.append(f"sequence parallelism splits each rank's {mc.seq_len // self.cp} tokens "
                       f"over tp={self.tp}; use a seq_len that cp x tp = {self.cp * self.tp} divides "
                       f"(x2 for zigzag), or sequence_parallel=False")
        if self.ep > 1:
            if config.model != "moe":
                out.append(f"ep={self.ep} splits the experts of a mixture of experts; use "
                           f"model='moe' or ep=1")
            elif mc.n_expert % self.ep:
                out.append(f"model option n_expert={mc.n_expert} does not split over ep={self.ep}; "
                           f"use a multiple of {self.ep}")
            if (self.dp * self.cp) % self.ep:
                out.append(f"ep={self.ep} folds onto the dp x cp = {self.dp * self.cp} data ranks of a "
                           f"stage and must divide them; pick ep among the divisors of "
                           f"{self.dp * self.cp}")
        if config.model == "moe" and self.tp > 1 and not self.sequence_parallel:
            out.append("with tp > 1 the MoE layers need sequence_parallel=True (as Megatron-Core "
                       "requires): each tensor-parallel rank then routes its own slice of the "
                       "tokens instead of all of them routing the same ones")
        if self.tp > 1 and self.schedule in ("zb-h1", "zbv"):
            out.append(f"{self.schedule} splits the backward of nn.Linear layers, and the "
                       f"tensor-parallel layers are not split here: use tp=1, or gpipe, 1f1b or "
                       f"interleaved with tp")
        if config.batch_size % (self.dp * self.microbatches):
            out.append(f"batch_size={config.batch_size} must split into dp={self.dp} replicas of "
                       f"microbatches={self.microbatches} equal micro-batches: use a multiple of "
                       f"{self.dp * self.microbatches}")
        problem = self.schedule_problem()
        if problem:
            return out + [problem]
        if mc.n_layer < self.n_stages():
            out.append(f"{self.schedule} on pp={self.pp} has {self.n_stages()} stages but the model "
                       f"has n_layer={mc.n_layer} blocks; use n_layer >= {self.n_stages()} or a "
                       f"smaller pp")
        return out
