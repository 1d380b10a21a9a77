"""The published rows the planner is scored on (``dlab.theory.plan.published``), as code: each
source's configurations with the figure as the source states it, where it states it.

Twelve sources, 135 configurations, two GPU generations, the stacks they ran:

- Narayanan et al. 2021 (Megatron-LM, 3D parallelism on A100s), table 1: 10 rows;
- Korthikanti et al. 2022 (sequence parallelism, selective recomputation, A100s), table 4: 8;
- Dubey et al. 2024 (Llama 3 405B on H100s, 4D with context parallelism), table 4: 3;
- Megatron-LM's README (Megatron-Core r0.8 on H100s, its model table and strong scaling): 11;
- torchtitan (PyTorch-native FSDP2 on A100s and H100s, two benchmark pages): 12;
- MosaicML's llm-foundry (PyTorch FSDP at 128-512 H100s), its large-scale table: 18;

and, added after the planner was built and scored blind when added (``blind.json``):

- BigScience's Megatron-DeepSpeed runs (BLOOM on Jean Zay's A100s): 11;
- Narayanan et al. 2021, table 2 (DeepSpeed's ZeRO-3 without model parallelism beside PTD-P at a
  fixed batch as the GPUs double): 12;
- MT-NLG 530B (Smith et al. 2022): 3; OPT-175B (Zhang et al. 2022, metaseq): 1;
- IBM's fms-fsdp (PyTorch FSDP1, eager and compiled, on 128 A100s and 96 H100s): 16;
- llm-foundry's A100 tables, their rows over more than one node (FSDP1 at 16-128 GPUs): 30.

Each row says what was assumed where its source is silent (``Published.assumed``). Left out:
rows in fp8 (the planner prices bf16 kernels only), torchtitan's 405B row (its "H100 (94GB
memory)" matches no machine the project describes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dlab.theory.plan import clusters
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.predict import plan
from dlab.theory.plan.spec import PRESETS, Transformer, megatron_gpt
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


NARAYANAN = Source("narayanan2021", "Narayanan et al. 2021, Efficient Large-Scale Language Model "
                   "Training on GPU Clusters Using Megatron-LM (SC'21), table 1", "Narayanan et al. 2021")
KORTHIKANTI = Source("korthikanti2022", "Korthikanti et al. 2022, Reducing Activation "
                     "Recomputation in Large Transformer Models (MLSys'23), table 4",
                     "Korthikanti et al. 2022")
LLAMA3 = Source("llama3", "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv 2407.21783), table 4",
                "Llama 3 (Dubey et al. 2024)")
MCORE = Source("megatron-core", "NVIDIA Megatron-LM README, 'Performance Benchmarking': "
               "images/model_table.png (Megatron-Core r0.8.0, committed 2024-07-15) and the strong "
               "scaling text (177B, 96 to 4,608 H100s, MFU 47 % to 42 %)", "Megatron-LM README 2024")
TITAN = Source("torchtitan", "pytorch/torchtitan: docs/performance.md at 157a12c (2024-04-24), "
               "64 A100s; benchmarks/llama3_h100_202412_torchtitan.md (runs of 2024-12, "
               "committed 2025-06-13), tables 1 and 3", "torchtitan 2024")
FOUNDRY = Source("llm-foundry", "mosaicml/llm-foundry: scripts/train/benchmarking/README.md at "
                 "5e85bd6 (2024-01-06), 'H100 80GB BF16 (Large Scale, >= 128 GPUs)'",
                 "llm-foundry 2024")


BIGSCIENCE = Source("bigscience", "bigscience-workshop/bigscience at e726b15 (2022): "
                    "train/tr11-176B-ml/README.md (BLOOM's training log lines, iterations 3707 and "
                    "85376) and chronicles-prequel.md ('48 node contenders' and 'Final round "
                    "comparison' tables, 2022-02-21/23): Megatron-DeepSpeed on Jean Zay's A100s",
                    "BigScience (BLOOM) 2022")
NARAYANAN_ZERO = Source("narayanan2021-zero3", "Narayanan et al. 2021, Efficient Large-Scale "
                        "Language Model Training on GPU Clusters Using Megatron-LM (SC'21), table 2: "
                        "ZeRO-3 without model parallelism (DeepSpeed) against PTD-P at a fixed "
                        "batch as the GPUs double, GPT 174.6B and 529.6B on DGX A100s",
                        "Narayanan et al. 2021, table 2")
MTNLG = Source("mt-nlg", "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing "
               "NLG 530B (arXiv 2201.11990), sec. 2.4: batch 1920 on 280, 350 and 420 DGX A100 "
               "nodes, 60.1, 50.2 and 44.4 s an iteration, 126, 121 and 113 teraFLOP/s per GPU",
               "MT-NLG 530B (Smith et al. 2022)")
FOUNDRY_A100 = Source("llm-foundry-a100", "mosaicml/llm-foundry: scripts/train/benchmarking/"
                      "README.md at 5e85bd6 (2024-01-06), 'A100 80GB with 1600 Gbps node-node "
                      "interconnect (RoCE)' and 'A100 40GB with 1600 Gbps node-node interconnect "
                      "(RoCE)': their rows over more than one node (16 to 128 GPUs)",
                      "llm-foundry A100 2024")
FMS = Source("fms-fsdp", "foundation-model-stack/fms-fsdp: README.md, 'Training throughput "
             "benchmarks', at 4ffb9bd (2024-03-21, eager) and at ed74fd5 (2024-05-09, 'updated with "
             "torch.compile'): Llama 2 shapes on 128 A100 80GB (400 Gb/s a node) and 96 H100 "
             "(800 Gb/s a node), PyTorch FSDP1 without model parallelism, its MFU and HFU table "
             "beside", "IBM fms-fsdp 2024")
OPT = Source("opt", "Zhang et al. 2022, OPT: Open Pre-trained Transformer Language Models (arXiv "
             "2205.01068), sec. 2.4 ('up to 147 TFLOP/s per GPU' on 992 A100 80GB); its settings "
             "from facebookresearch/metaseq: metaseq/launcher/opt_job_constants.py and "
             "opt_baselines.py, its FLOPs count from projects/OPT/chronicles/final_update.md "
             "(4.30E+23 FLOPs for 300B tokens)", "OPT-175B (Zhang et al. 2022)")


def _other_v(pp: int, v: int = 2) -> tuple:
    """Where a source does not say how many model chunks its interleaved schedule ran: the
    schedules beside the assumed ``v`` (1F1B, v = 2, 4, 8)."""
    if pp == 1:
        return ()
    return tuple({"schedule": "1f1b", "virtual_stages": 1} if k == 1 else {"virtual_stages": k}
                 for k in (1, 2, 4, 8) if k != v)


def _other_micro(pp: int, v: int = 2) -> tuple:
    """Where a source does not state its micro-batch: 2 and 4 sequences beside the assumed 1,
    and the schedules ``_other_v`` allows."""
    return ({"micro_batch": 2}, {"micro_batch": 4}, *_other_v(pp, v))


def _narayanan(name, layers, hidden, heads, tp, pp, gpus, batch, tflops) -> Published:
    """A row of Narayanan et al.'s table 1: sequence 2048, vocabulary 51200, A100 80GB (DGX A100,
    8 x 200 Gb/s HDR), full recomputation, the interleaved schedule where pipelined."""
    lay = PlanLayout(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=1, recompute="full",
                     schedule="interleaved" if pp > 1 else "1f1b",
                     virtual_stages=2 if pp > 1 else 1, precision="bf16", attention="math")
    return Published(NARAYANAN, megatron_gpt(name, layers, hidden, heads), "a100-80gb", lay,
                     batch, 2048, "tflops_per_gpu", tflops, "megatron-lm-2021", "megatron",
                     "micro-batch 1 and v = 2 (not in the table); 16-bit gradients reduced",
                     alternatives=_other_micro(pp))


def _zero3_or_ptdp(scheme, size, gpus, batch, micro, tflops) -> Published:
    """A row of Narayanan et al.'s table 2: GPT 174.6B (96 layers, width 12288, 96 heads) or
    529.6B (105, 20480, 128), sequence 2048, vocabulary 51200, full recomputation, their FLOPs
    count. "ZeRO-3": DeepSpeed's stage 3 over every GPU (its 2021 release) at the table's
    micro-batch, one per step; "PTD-P": Megatron-LM with the table's model-parallel size (96:
    tp 8 x pp 12; 280: tp 8 x pp 35) and the interleaved schedule."""
    shape = {175: ("GPT 174.6B", 96, 12288, 96), 530: ("GPT 529.6B", 105, 20480, 128)}[size]
    if scheme == "ZeRO-3":
        lay = PlanLayout(dp=gpus, zero=3, micro_batch=micro, recompute="full", precision="bf16",
                         attention="math")
        return Published(NARAYANAN_ZERO, megatron_gpt(*shape), "a100-80gb", lay, batch, 2048,
                         "tflops_per_gpu", tflops, "deepspeed-zero3-2021", "megatron",
                         "DeepSpeed's ZeRO-3 defaults of 2021 (the paper names none)")
    pp = 12 if size == 175 else 35
    lay = PlanLayout(dp=gpus // (8 * pp), tp=8, pp=pp, micro_batch=micro, recompute="full",
                     schedule="interleaved", virtual_stages=2, precision="bf16", attention="math")
    return Published(NARAYANAN_ZERO, megatron_gpt(*shape), "a100-80gb", lay, batch, 2048,
                     "tflops_per_gpu", tflops, "megatron-lm-2021", "megatron",
                     "v = 2 (not in the table)", alternatives=_other_v(pp))


def _korthikanti(name, layers, hidden, heads, pp, gpus, batch, micro, full_s, present_s,
                 mfu) -> list[Published]:
    """Korthikanti et al.'s models (table 3: tp 8, sequence 2048, vocabulary 51200, A100 80GB,
    dp 1) timed per iteration with full recomputation and with their "present work", sequence
    parallelism and selective recomputation (table 4). The present work's MFU (``extra``)
    cross-checks the times (``tests/test_plan_published.py``)."""
    spec = megatron_gpt(name, layers, hidden, heads)
    out = []
    for recompute, sp, value in (("full", False, full_s), ("selective", True, present_s)):
        lay = PlanLayout(dp=gpus // (8 * pp), tp=8, pp=pp, sequence_parallel=sp, recompute=recompute,
                         micro_batch=micro, attention="math", precision="bf16")
        extra = {"mfu": mfu} if recompute == "selective" else {}
        out.append(Published(KORTHIKANTI, spec, "a100-80gb", lay, batch, 2048, "iteration_s", value,
                             "megatron-lm-2022", assumed="the 1F1B schedule (not stated)", extra=extra,
                             alternatives=(({"schedule": "interleaved", "virtual_stages": 2},)
                                           if pp > 1 else ())))
    return out


def _llama3(dp, cp, seq, batch_per_dp, tflops) -> Published:
    """Llama 3 405B on H100s (table 4: tp 8, pp 16, bf16, "TFLOPs/GPU"): interleaved 1F1B
    (sec. 3.3.2) over 16 stages of 8 layers (one fewer on the first and last: its balanced
    pipeline); its FSDP shards optimizer state and gradients and gathers the weights once
    (zero=2 here); context parallelism by all-gathering K and V (sec. 3.3.2). The chunks per
    stage are not stated: v = 4 (a chunk of two layers), the middle of the 2 to 8 a stage of 8
    layers allows, each of which widens the range."""
    lay = PlanLayout(dp=dp, tp=8, pp=16, cp=cp, zero=2, sequence_parallel=True,
                     schedule="interleaved", virtual_stages=4, micro_batch=1, precision="bf16",
                     cp_attention="allgather")
    return Published(LLAMA3, PRESETS["llama3-405b"], "h100-sxm", lay, dp * batch_per_dp, seq,
                     "tflops_per_gpu", tflops, "llama3-meta", "model",
                     "v = 4 and micro-batch 1 (not stated); the paper's FLOPs count is not given: "
                     "6N + 12 L h s assumed", alternatives=_other_v(16, 4)[1:])


def _mcore(name, heads, hidden, layers, tp, pp, gpus, batch, tflops, metric="tflops_per_gpu") -> Published:
    """A GPT of Megatron-LM's 2024 benchmark (vocabulary 131072, sequence 4096, data parallelism
    48 in its table): Megatron-Core r0.8 with its overlaps, the distributed optimizer, sequence
    parallelism with tensor parallelism (its TP overlap needs it)."""
    spec = Transformer(name, layers, hidden, heads, 4 * hidden, 131072)
    lay = PlanLayout(dp=gpus // (tp * pp), tp=tp, pp=pp, zero=1, sequence_parallel=tp > 1,
                     schedule="interleaved" if pp > 1 else "1f1b",
                     virtual_stages=2 if pp > 1 else 1, micro_batch=1,
                     precision="bf16-fp32-grads")
    return Published(MCORE, spec, "h100-sxm", lay, batch, 4096, metric, tflops,
                     "megatron-core-2024", "model",
                     "GeLU, f = 4h, untied (the table's sizes); micro-batch 1, v = 2, no "
                     "recomputation (not stated)", peak=989e12, alternatives=_other_micro(pp))


def _titan(model, gpus, batch, seq, recompute, tps, cluster, stack, every=1, note="") -> Published:
    """torchtitan's FSDP2 (zero=3 over every GPU, gradients reduced in fp32: its
    mixed_precision_reduce default), one micro-batch of the local batch."""
    lay = PlanLayout(dp=gpus, zero=3, micro_batch=batch, recompute=recompute, recompute_every=every,
                     precision="bf16-fp32-grads")
    return Published(TITAN, PRESETS[model], cluster, lay, gpus * batch, seq, "tokens_per_s_per_gpu",
                     tps, stack, assumed=note or "SDPA's flash backend, the selective op policy")


#: MPT shapes (layers, width, heads) of llm-foundry's yamls (scripts/train/yamls/pretrain)
MPT = {"350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16), "3b": (32, 2560, 20),
       "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}


def _mpt_spec(size) -> Transformer:
    """An MPT of llm-foundry's yamls: GeLU, f = 4h, tied embedding, vocabulary 50368."""
    layers, hidden, heads = MPT[size]
    return Transformer(f"MPT {size}", layers, hidden, heads, 4 * hidden, 50368, tied=True)


def _mpt(size, gpus, micro, tps, sharding, ac) -> Published:
    """An MPT of llm-foundry's table: GeLU, f = 4h, tied embedding, vocabulary 50368, sequence
    2048, FlashAttention (triton), FSDP in the table's "amp_bf16" with Composer's "DEFAULT" mixed
    precision: bf16 weights, gradients reduced in fp32 (Composer v0.17.2, the version the
    README's commit pins: composer/trainer/mosaic_fsdp_utils.py, ``reduce_dtype = float32``)."""
    lay = PlanLayout(dp=gpus, zero=3 if sharding == "FULL_SHARD" else 2, micro_batch=micro,
                     recompute="full" if ac else "none", precision="bf16-fp32-grads")
    return Published(FOUNDRY, _mpt_spec(size), "h100-sxm", lay, gpus * micro, 2048,
                     "tokens_per_s_per_gpu", tps, "pytorch-fsdp1",
                     assumed="DGX H100 nodes (the platform's network is not stated)")


def _mpt_a100(size, memory, gpus, micro, accum, tps, ac) -> Published:
    """A multi-node row of llm-foundry's A100 tables: an MPT (as ``_mpt``) under FSDP1's
    FULL_SHARD in "bf16" with Composer's "PURE" mixed precision (bf16 weights, gradients and
    reductions), ``accum`` micro-batches of ``micro`` sequences a step."""
    lay = PlanLayout(dp=gpus, zero=3, micro_batch=micro, recompute="full" if ac else "none",
                     precision="bf16")
    return Published(FOUNDRY_A100, _mpt_spec(size), f"a100-{memory}gb", lay, gpus * micro * accum, 2048,
                     "tokens_per_s_per_gpu", tps, "pytorch-fsdp1",
                     assumed="its nodes as DGX A100s (8 GPUs, NVSwitch; 1600 Gb/s a node as 8 x 200)")


def _bigscience(name, layers, hidden, heads, dp, tp, pp, micro, batch, seconds, where) -> Published:
    """A Megatron-DeepSpeed run of BigScience's on Jean Zay (sequence 2048, a 250,880-token
    vocabulary (BLOOM's, padded), tied embeddings, dropout 0.1 (Megatron's default: its script
    sets none), full recomputation (--checkpoint-activations), DeepSpeed's 1F1B pipeline, bf16
    with ZeRO stage 0 in its DeepSpeed config ("bf16 must use z0! it implements its own zero
    stage 1 equivalent", tr11-176B-ml.slurm): DeepSpeed's BF16_Optimizer, ZeRO-1 over the data
    ranks with gradients accumulated and all-reduced in fp32), timed per iteration as its log
    or table prints it."""
    spec = Transformer(name, layers, hidden, heads, 4 * hidden, 250880, tied=True, dropout=True)
    lay = PlanLayout(dp=dp, tp=tp, pp=pp, zero=1, micro_batch=micro, recompute="full",
                     precision="bf16-fp32-grads", attention="math")
    return Published(BIGSCIENCE, spec, "a100-80gb-opa", lay, batch, 2048, "iteration_s", seconds,
                     "megatron-deepspeed", assumed=where)


def _mtnlg(nodes, tflops) -> Published:
    """MT-NLG 530B (105 layers, width 20480, 128 heads, sequence 2048, batch 1920) over tp 8 x
    pp 35 x dp (nodes / 35) on Selene's DGX A100s, Megatron's FLOPs count (the iteration times
    the paper gives beside these figures are that count over the figure)."""
    lay = PlanLayout(dp=nodes * 8 // 280, tp=8, pp=35, zero=1, micro_batch=1, recompute="full",
                     precision="bf16", attention="math")
    return Published(MTNLG, megatron_gpt("MT-NLG 530B", 105, 20480, 128), "a100-80gb", lay, 1920,
                     2048, "tflops_per_gpu", tflops, "megatron-deepspeed", "megatron",
                     "micro-batch 1, DeepSpeed's 1F1B and ZeRO-1 over the data ranks (not stated)",
                     alternatives=_other_micro(35, 1)[:2])


def _fms(size, sharding, every, a100_tps, h100_tps, compiled, note) -> list[Published]:
    """A row of IBM's fms-fsdp table on both of its machines: PyTorch FSDP1 over every GPU
    ("FSDP": FULL_SHARD) or sharded inside a node and replicated across ("HSDP": HYBRID_SHARD,
    ``zero_group`` 8), each block its own FSDP unit with ``limit_all_gathers``, bf16 weights and
    reductions (its bfSixteen policy), 2 sequences of 4096 a GPU, one micro-batch a step, SDPA's
    flash backend; ``every``: one block in every this many recomputed (0: none). Eager PyTorch
    in its March 2024 table, torch.compile over the model in its May 2024 one."""
    out = []
    for cluster, gpus, tps in (("a100-80gb-400g", 128, a100_tps), ("h100-sxm-800g", 96, h100_tps)):
        lay = PlanLayout(dp=gpus, zero=3, zero_group=8 if sharding == "HSDP" else 0, micro_batch=2,
                         recompute="full" if every else "none", recompute_every=every or 1,
                         precision="bf16")
        other = tuple({"recompute_every": k} for k in (1, 2, 3) if every and k != every)
        out.append(Published(FMS, PRESETS[f"llama2-{size}"], cluster, lay, 2 * gpus, 4096,
                             "tokens_per_s_per_gpu", tps,
                             "pytorch-fsdp1-compile" if compiled else "pytorch-fsdp1",
                             assumed=note + "; H100 SXM (its 'H100 80G')", alternatives=other))
    return out


def _opt() -> Published:
    """OPT-175B as metaseq ran it: tp 8 over 992 GPUs (dp 124), a batch of 2M tokens split as
    metaseq's launcher does (2,097,152 // 124 // 2048 = 8 sequences a data rank, 992 in all),
    FSDP without resharding after forward (--no-reshard-after-forward: zero=2), full
    recomputation with each layer's saved input cut over the tp ranks
    (--distribute-checkpointed-activations), fp16, tied embeddings, ReLU (two MLP matrices),
    dropout 0.1, separate Q, K and V projections with biases (fairseq's)."""
    spec = Transformer("OPT-175B", 96, 12288, 96, 4 * 12288, 50272, tied=True, dropout=True,
                       split_qkv=True)
    lay = PlanLayout(dp=124, tp=8, zero=2, micro_batch=8, recompute="full", precision="bf16",
                     attention="math", distribute_saved=True)
    return Published(OPT, spec, "a100-80gb", lay, 992, 2048, "tflops_per_gpu", 147, "metaseq",
                     "megatron",
                     "'up to' 147: the best step; Azure's A100 nodes as DGX A100s (8 x 200 Gb/s)")


ROWS = [
    _narayanan("GPT 1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _narayanan("GPT 3.6B", 30, 3072, 32, 2, 1, 64, 512, 138),
    _narayanan("GPT 7.5B", 36, 4096, 32, 4, 1, 128, 512, 142),
    _narayanan("GPT 18.4B", 40, 6144, 48, 8, 1, 256, 1024, 135),
    _narayanan("GPT 39.1B", 48, 8192, 64, 8, 2, 512, 1536, 138),
    _narayanan("GPT 76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 140),
    _narayanan("GPT 145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 148),
    _narayanan("GPT 310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 155),
    _narayanan("GPT 529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 163),
    _narayanan("GPT 1008.0B", 128, 25600, 160, 8, 64, 3072, 3072, 163),
    *_korthikanti("GPT 22B", 48, 6144, 64, 1, 8, 4, 4, 1.42, 1.10, 0.415),
    *_korthikanti("GPT-3 175B", 96, 12288, 96, 8, 64, 64, 1, 18.13, 13.75, 0.514),
    *_korthikanti("MT-NLG 530B", 105, 20480, 128, 35, 280, 280, 1, 49.05, 37.83, 0.560),
    *_korthikanti("GPT 1T", 128, 25600, 160, 64, 512, 512, 1, 94.42, 71.49, 0.563),
    _llama3(64, 1, 8192, 32, 430),
    _llama3(128, 1, 8192, 16, 400),
    _llama3(8, 16, 131072, 16, 380),  # dp = 16,384 / (8 tp x 16 cp x 16 pp), 16M tokens a batch
    _mcore("GPT 1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _mcore("GPT 7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _mcore("GPT 16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _mcore("GPT 32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _mcore("GPT 70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _mcore("GPT 119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _mcore("GPT 177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _mcore("GPT 314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _mcore("GPT 462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    _mcore("GPT 177B", 96, 12288, 96, 8, 6, 96, 1152, 0.47, "mfu"),  # strong scaling's ends
    _mcore("GPT 177B", 96, 12288, 96, 8, 6, 4608, 1152, 0.42, "mfu"),
    _titan("llama3-8b", 64, 1, 8192, "full", 2904, "a100-80gb", "torchtitan-fsdp2", every=2,
           note="selective layer AC as every second layer recomputed (its default then); DGX A100 nodes"),
    _titan("llama3-8b", 64, 1, 8192, "selective", 2973, "a100-80gb", "torchtitan-fsdp2",
           note="its selective op policy; DGX A100 nodes"),
    _titan("llama3-70b", 64, 1, 8192, "full", 331, "a100-80gb", "torchtitan-fsdp2",
           note="DGX A100 nodes"),
    _titan("llama2-13b", 64, 2, 4096, "none", 2162, "a100-80gb", "torchtitan-fsdp2",
           note="DGX A100 nodes"),
    _titan("llama2-13b", 64, 2, 4096, "full", 1914, "a100-80gb", "torchtitan-fsdp2", every=2,
           note="selective layer AC as every second layer recomputed (its default then); DGX A100 nodes"),
    _titan("llama2-13b", 64, 2, 4096, "selective", 1904, "a100-80gb", "torchtitan-fsdp2",
           note="its selective op policy; DGX A100 nodes"),
    _titan("llama2-70b", 64, 1, 4096, "selective", 355, "a100-80gb", "torchtitan-fsdp2",
           note="its selective op policy; DGX A100 nodes"),
    _titan("llama2-70b", 64, 2, 4096, "full", 353, "a100-80gb", "torchtitan-fsdp2",
           note="DGX A100 nodes"),
    _titan("llama3-8b", 8, 2, 8192, "selective", 5762, "h100-grand-teton", "torchtitan-fsdp2",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _titan("llama3-8b", 8, 2, 8192, "selective", 6667, "h100-grand-teton", "torchtitan-fsdp2-compile",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _titan("llama3-8b", 128, 2, 8192, "selective", 5605, "h100-grand-teton", "torchtitan-fsdp2",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _titan("llama3-8b", 128, 2, 8192, "selective", 6514, "h100-grand-teton", "torchtitan-fsdp2-compile",
           note="sequence 8192 (its llama3_8b.toml); the selective op policy"),
    _mpt("70b", 512, 8, 1007, "FULL_SHARD", True),
    _mpt("70b", 256, 8, 1035, "FULL_SHARD", True),
    _mpt("70b", 128, 8, 1058, "FULL_SHARD", True),
    _mpt("30b", 512, 8, 2115, "FULL_SHARD", True),
    _mpt("30b", 256, 8, 2148, "FULL_SHARD", True),
    _mpt("30b", 128, 8, 2199, "FULL_SHARD", True),
    _mpt("13b", 512, 16, 4952, "FULL_SHARD", True),
    _mpt("13b", 256, 16, 4989, "FULL_SHARD", True),
    _mpt("13b", 128, 16, 5080, "FULL_SHARD", True),
    _mpt("7b", 512, 6, 9670, "FULL_SHARD", False),
    _mpt("7b", 256, 6, 10119, "FULL_SHARD", False),
    _mpt("7b", 128, 6, 10475, "FULL_SHARD", False),
    _mpt("3b", 512, 8, 21664, "SHARD_GRAD_OP", False),
    _mpt("3b", 256, 8, 22772, "SHARD_GRAD_OP", False),
    _mpt("3b", 128, 8, 23422, "SHARD_GRAD_OP", False),
    _mpt("1b", 512, 12, 39837, "SHARD_GRAD_OP", False),
    _mpt("1b", 256, 12, 42555, "SHARD_GRAD_OP", False),
    _mpt("1b", 128, 12, 44123, "SHARD_GRAD_OP", False),
    _bigscience("BLOOM 176B", 70, 14336, 112, 8, 4, 12, 2, 2048, 104.70,
                "README: iteration 85376 at batch 2048"),
    _bigscience("BLOOM 176B", 70, 14336, 112, 8, 4, 12, 2, 16, 15.23,
                "README: iteration 3707 at batch 16 (one micro-batch a pipeline)"),
    *(_bigscience("BLOOM 181B", 72, 14336, 64, dp, 8, pp, mb, 2048, sec, "chronicles-prequel: "
                  "'48 node contenders', the second iteration")
      for dp, pp, mb, sec in ((4, 12, 1, 143.31), (4, 12, 2, 134.02), (4, 12, 4, 123.69),
                              (4, 12, 8, 129.26), (8, 6, 1, 139.82), (8, 6, 2, 131.02),
                              (8, 6, 4, 121.48))),
    *(_bigscience("BLOOM 177B", 96, 12288, 64, 8, 8, 6, mb, 2048, sec, "chronicles-prequel: "
                  "'Final round comparison', the second iteration")
      for mb, sec in ((2, 136.73), (4, 122.96))),
    *(_zero3_or_ptdp(*row) for row in (
        ("ZeRO-3", 175, 384, 1536, 4, 144), ("ZeRO-3", 175, 768, 1536, 2, 88),
        ("ZeRO-3", 175, 1536, 1536, 1, 44), ("ZeRO-3", 530, 640, 2560, 4, 138),
        ("ZeRO-3", 530, 1120, 2240, 2, 98), ("ZeRO-3", 530, 2240, 2240, 1, 48),
        ("PTD-P", 175, 384, 1536, 1, 153), ("PTD-P", 175, 768, 1536, 1, 149),
        ("PTD-P", 175, 1536, 1536, 1, 141), ("PTD-P", 530, 560, 2240, 1, 171),
        ("PTD-P", 530, 1120, 2240, 1, 167), ("PTD-P", 530, 2240, 2240, 1, 159))),
    _mtnlg(280, 126),
    _mtnlg(350, 121),
    _mtnlg(420, 113),
    _opt(),
    _mpt_a100("70b", 80, 64, 8, 4, 410, True),
    _mpt_a100("70b", 80, 32, 2, 16, 373, True),
    *(_mpt_a100(size, 40, gpus, micro, 1, tps, ac) for size, gpus, micro, tps, ac in (
        ("70b", 128, 4, 376, True), ("70b", 64, 2, 276, True), ("30b", 128, 6, 865, True),
        ("30b", 32, 4, 857, True), ("13b", 128, 16, 1972, True), ("13b", 64, 16, 1976, True),
        ("13b", 32, 14, 1998, True), ("13b", 16, 10, 1993, True), ("7b", 128, 18, 3623, True),
        ("7b", 64, 18, 3665, True), ("7b", 32, 18, 3725, True), ("7b", 16, 16, 3645, True),
        ("3b", 128, 6, 9538, False), ("3b", 64, 6, 9736, False), ("3b", 32, 6, 9914, False),
        ("3b", 16, 5, 9750, False), ("1b", 128, 10, 18647, False), ("1b", 64, 10, 19001, False),
        ("1b", 32, 10, 15555, False), ("1b", 16, 8, 19085, False), ("760m", 128, 12, 28940, False),
        ("760m", 64, 12, 29344, False), ("760m", 32, 12, 29648, False),
        ("760m", 16, 12, 29607, False), ("350m", 128, 18, 51934, False),
        ("350m", 64, 18, 52689, False), ("350m", 32, 18, 53811, False),
        ("350m", 16, 18, 55413, False))),
    *_fms("7b", "HSDP", 0, 3700, 7500, False, "no recomputation (its table)"),
    *_fms("13b", "FSDP", 2, 1800, 3800, False, "'Selective AC', every second block recomputed: "
          "its selective_checkpointing k recomputes one block in k, and its HFU over MFU on the "
          "A100s, 0.59 / 0.51 = 1.16, is recomputing half the blocks' forward (1 + 1/2 x 1/3)"),
    *_fms("34b", "FSDP", 1, 700, 1550, False, "full recomputation (its table)"),
    *_fms("70b", "FSDP", 1, 370, 800, False, "full recomputation (its table)"),
    *_fms("7b", "HSDP", 0, 4550, 9600, True, "no recomputation (its table)"),
    *_fms("13b", "FSDP", 2, 2150, 4850, True, "'Selective AC' of an unstated share p of the "
          "blocks: its HFU over MFU on the A100s, 0.69 / 0.61 = 1.13, lies between a half (1.17) "
          "and a third (1.11); a half assumed"),
    *_fms("34b", "FSDP", 1, 820, 1830, True, "'Selective AC' of an unstated share: its HFU over "
          "MFU on the A100s, 0.74 / 0.55 = 1.35, is full recomputation's 4/3: every block"),
    *_fms("70b", "FSDP", 1, 410, 890, True, "'Selective AC' of an unstated share: its HFU over "
          "MFU on the A100s, 0.74 / 0.55 = 1.35, is full recomputation's 4/3: every block"),
]
