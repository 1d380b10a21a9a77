"""The ``pipeline-*`` strategies: one class, seven schedules, ``nd``'s presets.

The parts are the lesson, in ``dlab.parallel.pipeline``: ``dlab.layout.schedules`` writes each
rank's action list, ``executor.py`` runs it (receives posted ahead, activations and gradients
crossing while the rank computes), ``split.py`` cuts the GPT into stages, ``weight_grad.py``
splits a backward for the zero-bubble schedules. The strategy that runs them is ``nd`` with a
pipeline and nothing else but, optionally, dp replicas and tp ranks per stage: the same mesh
(pp x dp x tp, tp fastest), the same tied pair, the same gradient reduction, so the same
degrees place the same ranks whichever name launched them. They live beside ``nd`` (not in
``dlab.parallel.pipeline``) so that the parts never import the strategy made of them.

``options``:

- ``microbatches`` (m, default 4; the naive pipeline runs 1): the data-parallel share of the
  global batch is cut into m equal micro-batches whose gradients accumulate.
- ``virtual_stages`` (v): stages per rank for ``pipeline-interleaved`` (default 2); the
  V-schedules (zbv, dualpipev) always have 2.
- ``dp`` (default 1): replicas of the whole pipeline.
- ``tp`` (default 1): tensor parallelism inside every stage (Megatron-LM's layout,
  ``dlab.parallel.tensor``): with dp and tp both above 1 this is 3D parallelism (Narayanan et
  al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters"). The ranks form
  ``nd``'s mesh pp x dp x tp with p = world_size / (d t): the t ranks of a stage are adjacent
  (TP is the chattiest: an all-reduce per layer), then the d replicas, then the p stages (a
  pipeline's neighbours are d t ranks apart; ``dlab.layout.layout`` says why that order). A
  stage's tensor-parallel ranks run the same schedule in lockstep; rank (pp=s, tp=r) sends its
  activations to (pp=s+1, tp=r), the whole activation (no sequence parallelism here), since
  every rank of a TP group holds the same block outputs. After the schedule each gradient is
  averaged over the d replicas.
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

For ZeRO over the replicas, context or expert parallelism, or sequence parallelism with tp,
use ``nd``, of which these are presets.

The tied embedding/head matrix lives on the first and on the last stage; its two gradients are
summed across those two ranks after the schedule, as Megatron-LM does (see ``split.py``), so
both copies take the same optimizer step. On the V-schedules both stages are on rank 0 and
autograd sums the two uses itself.
"""
from __future__ import annotations

from dlab.layout import PP, Layout
from dlab.parallel import register
from dlab.parallel.base import Option
from dlab.parallel.nd.strategy import ND, PIPELINE_OPTIONS


class Pipeline(ND):
    """Pipeline parallelism (override ``schedule`` in a subclass): ``nd`` with pp alone, and
    optionally dp replicas and tp ranks per stage."""
    schedule = ""

    @classmethod
    def check_options(cls) -> dict:
        return {}  # its defaults train like single; nd's composition is nd's to check
    OPTIONS = {
        **PIPELINE_OPTIONS,
        "dp": Option("int", "replicas of the whole pipeline", default=1, minimum=1),
        "tp": Option("int", "tensor parallelism inside every stage", default=1, minimum=1),
    }

    @classmethod
    def layout(cls, config) -> Layout:
        """pp takes what dp x tp leave of the world (0 when they do not divide it:
        ``model_problems`` says so before the layout is read)."""
        d, t = config.options.get("dp", 1), config.options.get("tp", 1)
        pp = config.world_size // (d * t) if config.world_size % (d * t) == 0 else 0
        return Layout.from_options({**config.options, PP: pp}, config.world_size,
                                   schedule=cls.schedule)

    @classmethod
    def model_problems(cls, config):
        if config.model != "gpt":
            return [f"{config.strategy} splits the GPT by layers; use model='gpt'"]
        d, t = config.options.get("dp", 1), config.options.get("tp", 1)
        if config.world_size % (d * t):
            what = f"dp={d}" if t == 1 else f"dp x tp = {d} x {t} = {d * t}"
            return [f"{what} does not divide world_size={config.world_size}: the ranks form "
                    f"pp x dp x tp; pick dp x tp among the divisors of {config.world_size}"]
        return []

    def memory(self):
        """``nd``'s, except ``comm_buffers``: the lesson's communication buffers are the
        receives posted ahead (``recv_peak``, what ``theory.pipeline.recv_buffer_bytes``
        gives); ``nd`` counts its data reduction's buffers at once with them."""
        mem = super().memory()
        mem["comm_buffers"] = mem["recv_peak"]
        return mem


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


@register("pipeline-zb-h1")
class PipelineZBH1(Pipeline):
    """ZB-H1: backward split into input and weight gradients, W fills the drain (Qi et al. 2023)."""
    schedule = "zb-h1"


@register("pipeline-zbv")
class PipelineZBV(Pipeline):
    """ZB-V: two stages per rank in a V, split backward (Qi et al. 2024)."""
    schedule = "zbv"


@register("pipeline-dualpipev")
class PipelineDualPipeV(Pipeline):
    """DualPipeV: DeepSeek's DualPipe folded in a V, F and B of two micro-batches paired."""
    schedule = "dualpipev"
