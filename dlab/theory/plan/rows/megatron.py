"""Rows of Megatron-LM and Megatron-DeepSpeed runs on A100s and H100s: Narayanan et al. 2021's
tables 1 and 2 (table 2 with DeepSpeed's ZeRO-3 beside PTD-P), Korthikanti et al. 2022,
Megatron-LM's 2024 README, BigScience's BLOOM runs and MT-NLG 530B."""
from __future__ import annotations

from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.rows.record import Published, Source
from dlab.theory.plan.spec import Transformer, megatron_gpt

NARAYANAN = Source("narayanan2021", "Narayanan et al. 2021, Efficient Large-Scale Language Model "
                   "Training on GPU Clusters Using Megatron-LM (SC'21), table 1", "Narayanan et al. 2021")
KORTHIKANTI = Source("korthikanti2022", "Korthikanti et al. 2022, Reducing Activation "
                     "Recomputation in Large Transformer Models (MLSys'23), table 4",
                     "Korthikanti et al. 2022")
MCORE = Source("megatron-core", "NVIDIA Megatron-LM README, 'Performance Benchmarking': "
               "images/model_table.png (Megatron-Core r0.8.0, committed 2024-07-15) and the strong "
               "scaling text (177B, 96 to 4,608 H100s, MFU 47 % to 42 %)", "Megatron-LM README 2024")


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



TABLE_1 = [
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
]

KORTHIKANTI_ROWS = [
    *_korthikanti("GPT 22B", 48, 6144, 64, 1, 8, 4, 4, 1.42, 1.10, 0.415),
    *_korthikanti("GPT-3 175B", 96, 12288, 96, 8, 64, 64, 1, 18.13, 13.75, 0.514),
    *_korthikanti("MT-NLG 530B", 105, 20480, 128, 35, 280, 280, 1, 49.05, 37.83, 0.560),
    *_korthikanti("GPT 1T", 128, 25600, 160, 64, 512, 512, 1, 94.42, 71.49, 0.563),
]

MCORE_ROWS = [
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
]

BIGSCIENCE_ROWS = [
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
]

TABLE_2 = [
    *(_zero3_or_ptdp(*row) for row in (
        ("ZeRO-3", 175, 384, 1536, 4, 144), ("ZeRO-3", 175, 768, 1536, 2, 88),
        ("ZeRO-3", 175, 1536, 1536, 1, 44), ("ZeRO-3", 530, 640, 2560, 4, 138),
        ("ZeRO-3", 530, 1120, 2240, 2, 98), ("ZeRO-3", 530, 2240, 2240, 1, 48),
        ("PTD-P", 175, 384, 1536, 1, 153), ("PTD-P", 175, 768, 1536, 1, 149),
        ("PTD-P", 175, 1536, 1536, 1, 141), ("PTD-P", 530, 560, 2240, 1, 171),
        ("PTD-P", 530, 1120, 2240, 1, 167), ("PTD-P", 530, 2240, 2240, 1, 159))),
]

MTNLG_ROWS = [
    _mtnlg(280, 126),
    _mtnlg(350, 121),
    _mtnlg(420, 113),
]
