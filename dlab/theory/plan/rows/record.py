"""What a published row is: its ``Source`` (the paper or page it comes from) and the
``Published`` configuration, with how the source counts FLOPs and states its figure
(``dlab.theory.plan.published``'s module docstring), and the planner's prediction of it."""
from __future__ import annotations

from dataclasses import dataclass, field

from dlab.theory.plan import clusters
from dlab.theory.plan.predict import plan
from dlab.theory.plan.time import Knobs


@dataclass(frozen=True)
class Source:
    key: str
    #: the paper or page, the table, the date
    cite: str
    short: str


@dataclass(frozen=True)
class Published:
    source: Source
    model: object
    cluster: str
    layout: object
    global_batch: int
    seq_len: int
    metric: str  # "tflops_per_gpu", "mfu", "iteration_s" or "tokens_per_s_per_gpu"
    value: float
    stack: str
    convention: str = "model"  # how the source counts FLOPs (module docstring)
    assumed: str = ""
    #: the peak the source divides by for MFU
    peak: float = 0.0
    extra: dict = field(default_factory=dict)
    #: other readings of what the source leaves open (layout fields to replace), whose
    #: predictions widen the row's range
    alternatives: tuple = ()

    @property
    def gpus(self) -> int:
        return self.layout.world

    def flops_per_step(self) -> float:
        m, b, s = self.model, self.global_batch, self.seq_len
        if self.convention == "megatron":
            layers, h, v = m.n_layer, m.d_model, m.vocab
            return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        per_token = m.flops_per_token(s)
        if self.convention == "6N":
            per_token += 6 * m.embedding_params()
        return per_token * b * s

    def predicted(self, step_s: float) -> float:
        """The source's metric from a predicted step time."""
        if self.metric == "iteration_s":
            return step_s
        if self.metric == "tokens_per_s_per_gpu":
            return self.global_batch * self.seq_len / step_s / self.gpus
        tflops = self.flops_per_step() / step_s / self.gpus
        if self.metric == "mfu":
            return tflops / self.peak
        return tflops / 1e12

    def throughput_error(self, step_s: float) -> float:
        """Predicted over published throughput, less 1: positive where the plan is optimistic."""
        pred = self.predicted(step_s)
        return (self.value / pred if self.metric == "iteration_s" else pred / self.value) - 1

    @property
    def generation(self) -> str:
        return clusters.preset(self.cluster).generation

    def plan(self, knobs: Knobs | None = None, layout=None):
        return plan(self.model, clusters.preset(self.cluster), layout or self.layout,
                    self.global_batch, self.seq_len, self.stack, knobs)
