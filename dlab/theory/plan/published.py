"""Published at-scale results, each beside the planner's prediction of the same configuration.

Every row is a configuration a paper trained and measured, with the figure as the paper states
it and the FLOPs convention it used, so the prediction is converted into the paper's own metric
(a predicted step time T gives the paper's FLOPs per step / T / N). Nothing here is fitted to
these rows: the cluster presets' constants are set from hardware figures (``dlab.theory.plan.cluster``)
and the same for every row. Where a paper leaves a detail out, the row says what was assumed.

Conventions:

- ``megatron``: Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs per
  iteration, which counts full activation recomputation (4 passes, not 3); their "achieved
  TFLOP/s per GPU" is that over the iteration time and N GPUs.
- ``model``: 6 N + 12 l h s per token (``Transformer.flops_per_token``), MFU over the bf16 peak
  (Llama 3; PaLM's convention).
- ``iteration_s``: the step time itself.

What the rows show (``check``; ``python -m dlab plan --published`` and notebook 11 print the
table): a mean absolute throughput error of 9.5 % over 21 configurations from three papers,
from 8 to 16,384 GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dlab.theory.plan import clusters, models
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.predict import plan

NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
             "Clusters Using Megatron-LM (SC'21), table 1")
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer "
               "Models (MLSys'23), table 4")
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, table 4"


@dataclass(frozen=True)
class Published:
    source: str
    model: models.Transformer
    cluster: str
    layout: PlanLayout
    global_batch: int
    seq_len: int
    metric: str  # "tflops_per_gpu", "mfu" or "iteration_s"
    value: float
    convention: str = "model"  # how the source counts FLOPs (module docstring)
    assumed: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.layout.world

    def flops_per_step(self) -> float:
        m, b, s = self.model, self.global_batch, self.seq_len
        if self.convention == "megatron":
            layers, h, v = m.n_layer, m.d_model, m.vocab
            return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        return m.flops_per_token(s) * b * s

    def predicted(self, step_s: float) -> float:
        """The paper's metric from a predicted step time."""
        if self.metric == "iteration_s":
            return step_s
        tflops = self.flops_per_step() / step_s / self.gpus
        if self.metric == "mfu":
            return tflops / clusters.preset(self.cluster).peak
        return tflops / 1e12


def _megatron(name, layers, hidden, heads, tp, pp, gpus, batch, tflops) -> Published:
    """A row of Narayanan et al.'s table 1: sequence 2048, vocabulary 51200, A100 80GB (DGX A100,
    8 x 200 Gb/s HDR per node), full recomputation, micro-batch 1, the interleaved schedule where
    the model is pipelined. Micro-batch size and v are not in the table: assumed 1 and 2. The
    gradients are all-reduced after the pipeline's backward, not overlapped with it: Megatron-LM's
    default "local" DDP of the time did so (its overlapped reduction came in 2023)."""
    lay = PlanLayout(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=1, recompute="full",
                     schedule="interleaved" if pp > 1 else "1f1b",
                     virtual_stages=2 if pp > 1 else 1,
                     precision="bf16", attention="math", grad_overlap=False)
    return Published(NARAYANAN, models.megatron_gpt(name, layers, hidden, heads), "a100-80gb", lay,
                     batch, 2048, "tflops_per_gpu", tflops, "megatron",
                     "micro-batch 1 and v = 2 (not stated in the table)")


ROWS = [
    _megatron("GPT 1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("GPT 3.6B", 30, 3072, 32, 2, 1, 64, 512, 138),
    _megatron("GPT 7.5B", 36, 4096, 32, 4, 1, 128, 512, 142),
    _megatron("GPT 18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135),
    _megatron("GPT 39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138),
    _megatron("GPT 76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140),
    _megatron("GPT 145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148),
    _megatron("GPT 310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155),
    _megatron("GPT 529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163),
    _megatron("GPT 1008.0B", 128, 25600, 160, 8, 64, 3072, 3072, 163),
]


def _korthikanti(name, layers, hidden, heads, pp, gpus, batch, micro, full_s, present_s,
                 mfu) -> list[Published]:
    """Korthikanti et al.'s models (their table 3: tensor parallelism 8, sequence 2048,
    vocabulary 51200, A100 80GB, data parallelism 1) timed per iteration with full
    recomputation and with their "present work", sequence parallelism plus selective
    recomputation (table 4). The present work's MFU (``extra["mfu"]``, also in Megatron-LM's
    README) cross-checks the times: 72 B s l h^2 (1 + s/6h + V/12lh) / (time N 312 TFLOP/s).
    The schedule is not stated: assumed 1F1B."""
    spec = models.megatron_gpt(name, layers, hidden, heads)
    out = []
    for recompute, sp, value in (("full", False, full_s), ("selective", True, present_s)):
        lay = PlanLayout(dp=gpus // (8 * pp), tp=8, pp=pp, sequence_parallel=sp, recompute=recompute,
                         micro_batch=micro, attention="math", precision="bf16")
        extra = {"mfu": mfu} if recompute == "selective" else {}
        out.append(Published(KORTHIKANTI, spec, "a100-80gb", lay, batch, 2048, "iteration_s", value,
                             assumed="the 1F1B schedule (not stated)", extra=extra))
    return out


def _llama3(dp, cp, seq, batch_per_dp, tflops) -> Published:
    """Llama 3 405B on H100s (Dubey et al. 2024, table 4: tp 8, pp 16, bf16, "TFLOPs/GPU"):
    interleaved 1F1B (sec. 3.3.2), v and micro-batch size not stated: assumed 2 and 1. The paper
    does not give its FLOPs count; the row uses 6N + 12 l h s per token (attention counted
    whole, as PaLM does)."""
    lay = PlanLayout(dp=dp, tp=8, pp=16, cp=cp, zero=1, sequence_parallel=True,
                     schedule="interleaved", virtual_stages=2,
                     micro_batch=1, precision="bf16")
    return Published(LLAMA3, models.preset("llama3-405b"), "h100-sxm", lay, dp * batch_per_dp, seq,
                     "tflops_per_gpu", tflops, "model",
                     "v = 2, micro-batch 1, ZeRO-1 for its FSDP (not stated); attention FLOPs whole")


ROWS += [
    *_korthikanti("GPT 22B", 48, 6144, 64, 1, 8, 4, 4, 1.42, 1.10, 0.415),
    *_korthikanti("GPT-3 175B", 96, 12288, 96, 8, 64, 64, 1, 18.13, 13.75, 0.514),
    *_korthikanti("MT-NLG 530B", 105, 20480, 128, 35, 280, 280, 1, 49.05, 37.83, 0.560),
    *_korthikanti("GPT 1T", 128, 25600, 160, 64, 512, 512, 1, 94.42, 71.49, 0.563),
    _llama3(64, 1, 8192, 32, 430),
    _llama3(128, 1, 8192, 16, 400),
    _llama3(8, 16, 131072, 16, 380),  # dp = 16,384 / (8 tp x 16 cp x 16 pp), 16M tokens a batch
]


def check(rows: list[Published] | None = None) -> list[dict]:
    """Each row's published figure beside the prediction: ``error`` in the paper's metric,
    ``throughput_error`` in throughput (TFLOP/s per GPU or MFU; an iteration time's inverse),
    positive where the planner is optimistic."""
    out = []
    for row in rows or ROWS:
        p = plan(row.model, clusters.preset(row.cluster), row.layout, row.global_batch, row.seq_len)
        pred = row.predicted(p.step_s)
        out.append({"source": row.source, "model": row.model.name, "gpus": row.gpus,
                    "layout": row.layout.describe(), "metric": row.metric, "published": row.value,
                    "predicted": pred, "error": pred / row.value - 1,
                    "throughput_error": (row.value / pred if row.metric == "iteration_s"
                                         else pred / row.value) - 1, "fits": p.fits,
                    "memory_GB": p.memory["total"] / 1e9, "assumed": row.assumed})
    return out


def mean_abs_error(results: list[dict]) -> float:
    """Mean absolute throughput error (TFLOP/s per GPU, or MFU) over the rows."""
    return sum(abs(r["throughput_error"]) for r in results) / len(results)


def table(results: list[dict]) -> str:
    """``check``'s rows as text: each configuration, the paper's figure, the plan's and the error
    in the paper's metric; then the mean absolute throughput error and the sources."""
    lines = [f"{'model':14s} {'GPUs':>5s} {'layout':44s} {'metric':>14s} "
             f"{'paper':>7s} {'plan':>7s} {'error':>6s}"]
    lines += [f"{r['model']:14s} {r['gpus']:5d} {r['layout'][:44]:44s} {r['metric']:>14s} "
              f"{r['published']:7.3g} {r['predicted']:7.3g} {r['error']:+6.1%}" for r in results]
    lines.append(f"mean absolute error: {mean_abs_error(results):.1%} over {len(results)} configurations")
    lines += [f" - {source}" for source in dict.fromkeys(r["source"] for r in results)]
    return "\n".join(lines)
