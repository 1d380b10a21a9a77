"""The planner against what it can be checked against: published runs at scale, scored
leave-one-source-out in each source's own metric, and a run on this machine (memory and bytes
to the byte, against counts made here from the model itself)."""
from __future__ import annotations

import pytest

import dlab
from dlab.bench.nd import BATCH, MODEL
from dlab.bench.plan import plan_layout, predict
from dlab.models.gpt import GPT, GPTConfig
from dlab.plan import clusters, published
from dlab.theory.plan import predict as predict_module
from dlab.theory.plan.rows import ROWS


@pytest.fixture(scope="module")
def results():
    return published.check()


def test_the_rows_come_from_six_sources_and_cover_what_issue_36_asks():
    """At least 40 rows from 6 sources, each citing its table, section or page and date:
    Megatron-style 3D, ZeRO-3/FSDP at 128 GPUs or more, PyTorch-native FSDP, two GPU
    generations, context parallelism; and (issue 47) A100 runs of software other than
    Megatron-LM's own."""
    assert len(ROWS) >= 40
    sources = {r.source for r in ROWS}
    assert len(sources) >= 6
    assert all(any(w in s.cite for w in ("table", "sec.", ".md", "README")) and "20" in s.cite
               for s in sources)
    assert {r.stack for r in ROWS if r.generation == "A100"} >= {"megatron-deepspeed", "metaseq"}
    assert any(r.layout.tp > 1 and r.layout.pp > 1 and r.layout.dp > 1 for r in ROWS)
    assert any(r.layout.zero == 3 and r.gpus >= 128 for r in ROWS)
    assert any(r.stack.startswith("torchtitan") for r in ROWS)
    assert {r.generation for r in ROWS} == {"A100", "H100"}
    assert any(r.layout.cp > 1 for r in ROWS)


def test_every_source_is_predicted_within_15_percent_out_of_sample(results):
    """Each source scored with the sustained shares fitted on the other sources' rows only:
    mean absolute throughput error at most 15 % per source the planner was built on and 25 %
    per source added blind (issue 47's bar for sources out of sample), 10 % over all rows; the
    signed mean within 5 % of zero; at least 80 % of the published figures inside their
    ranges."""
    blind = published.blind_scores()
    for key, s in published.by_source(results).items():
        assert s["mean_abs"] <= (0.25 if blind[key]["blind"] else 0.15), (key, s)
    assert published.mean_abs_error(results) <= 0.10
    assert abs(published.signed_mean_error(results)) <= 0.05
    assert sum(r["inside"] for r in results) >= 0.8 * len(results)


#: each row's throughput error when this model was set down: a change that moves any by more
#: than 2 points (a term dropped from the step, a dimension's traffic miscounted) must be
#: deliberate and its table re-recorded
BANDS = {
    ('narayanan2021', 'GPT 1.7B', 32, 512, 'dp32 mb1 full', 'megatron-lm-2021', 137): -0.105,
    ('narayanan2021', 'GPT 3.6B', 64, 512, 'dp32 x tp2 mb1 full', 'megatron-lm-2021', 138): -0.071,
    ('narayanan2021', 'GPT 7.5B', 128, 512, 'dp32 x tp4 mb1 full', 'megatron-lm-2021', 142): -0.164,
    ('narayanan2021', 'GPT 18.4B', 256, 1024,
     'dp32 x tp8 mb1 full', 'megatron-lm-2021', 135): -0.145,
    ('narayanan2021', 'GPT 39.1B', 512, 1536,
     'pp2 x dp32 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 138): -0.053,
    ('narayanan2021', 'GPT 76.1B', 1024, 1792,
     'pp4 x dp32 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 140): +0.019,
    ('narayanan2021', 'GPT 145.6B', 1536, 2304,
     'pp8 x dp24 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 148): -0.023,
    ('narayanan2021', 'GPT 310.1B', 1920, 2160,
     'pp16 x dp15 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 155): -0.012,
    ('narayanan2021', 'GPT 529.6B', 2520, 2520,
     'pp35 x dp9 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 163): -0.027,
    ('narayanan2021', 'GPT 1008.0B', 3072, 3072,
     'pp64 x dp6 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 163): -0.014,
    ('korthikanti2022', 'GPT 22B', 8, 4, 'tp8 mb4 full', 'megatron-lm-2022', 1.42): -0.022,
    ('korthikanti2022', 'GPT 22B', 8, 4, 'tp8 sp mb4 selective', 'megatron-lm-2022', 1.1): +0.012,
    ('korthikanti2022', 'GPT-3 175B', 64, 64,
     'pp8 x tp8 1f1b mb1 full', 'megatron-lm-2022', 18.13): -0.121,
    ('korthikanti2022', 'GPT-3 175B', 64, 64,
     'pp8 x tp8 sp 1f1b mb1 selective', 'megatron-lm-2022', 13.75): -0.101,
    ('korthikanti2022', 'MT-NLG 530B', 280, 280,
     'pp35 x tp8 1f1b mb1 full', 'megatron-lm-2022', 49.05): -0.136,
    ('korthikanti2022', 'MT-NLG 530B', 280, 280,
     'pp35 x tp8 sp 1f1b mb1 selective', 'megatron-lm-2022', 37.83): -0.114,
    ('korthikanti2022', 'GPT 1T', 512, 512,
     'pp64 x tp8 1f1b mb1 full', 'megatron-lm-2022', 94.42): -0.115,
    ('korthikanti2022', 'GPT 1T', 512, 512,
     'pp64 x tp8 sp 1f1b mb1 selective', 'megatron-lm-2022', 71.49): -0.111,
    ('llama3', 'Llama 3 405B', 8192, 2048,
     'pp16 x dp64 x tp8 zero2 sp interleaved v4 mb1', 'llama3-meta', 430): -0.105,
    ('llama3', 'Llama 3 405B', 16384, 2048,
     'pp16 x dp128 x tp8 zero2 sp interleaved v4 mb1', 'llama3-meta', 400): -0.127,
    ('llama3', 'Llama 3 405B', 16384, 128,
     'pp16 x dp8 x cp16 x tp8 zero2 sp interleaved v4 mb1', 'llama3-meta', 380): -0.172,
    ('megatron-core', 'GPT 1.7B', 48, 192, 'dp48 zero1 mb1', 'megatron-core-2024', 408.8): +0.158,
    ('megatron-core', 'GPT 7.1B', 96, 192,
     'dp48 x tp2 zero1 sp mb1', 'megatron-core-2024', 465.9): +0.076,
    ('megatron-core', 'GPT 16B', 192, 192,
     'dp48 x tp4 zero1 sp mb1', 'megatron-core-2024', 489.1): -0.086,
    ('megatron-core', 'GPT 32B', 384, 192,
     'dp48 x tp8 zero1 sp mb1', 'megatron-core-2024', 459.6): -0.254,
    ('megatron-core', 'GPT 70B', 768, 384,
     'pp2 x dp48 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 419.7): -0.058,
    ('megatron-core', 'GPT 119B', 1536, 768,
     'pp4 x dp48 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 420.5): -0.031,
    ('megatron-core', 'GPT 177B', 2304, 1152,
     'pp6 x dp48 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 432.8): -0.022,
    ('megatron-core', 'GPT 314B', 3072, 1536,
     'pp8 x dp48 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 474.4): -0.067,
    ('megatron-core', 'GPT 462B', 6144, 3072,
     'pp16 x dp48 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 459.9): -0.047,
    ('megatron-core', 'GPT 177B', 96, 1152,
     'pp6 x dp2 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 0.47): +0.066,
    ('megatron-core', 'GPT 177B', 4608, 1152,
     'pp6 x dp96 x tp8 zero1 sp interleaved v2 mb1', 'megatron-core-2024', 0.42): -0.115,
    ('torchtitan', 'Llama 3 8B', 64, 64, 'dp64 zero3 mb1 full/2', 'torchtitan-fsdp2', 2904): -0.044,
    ('torchtitan', 'Llama 3 8B', 64, 64,
     'dp64 zero3 mb1 selective', 'torchtitan-fsdp2', 2973): -0.037,
    ('torchtitan', 'Llama 3 70B', 64, 64, 'dp64 zero3 mb1 full', 'torchtitan-fsdp2', 331): -0.051,
    ('torchtitan', 'Llama 2 13B', 64, 128, 'dp64 zero3 mb2', 'torchtitan-fsdp2', 2162): -0.015,
    ('torchtitan', 'Llama 2 13B', 64, 128,
     'dp64 zero3 mb2 full/2', 'torchtitan-fsdp2', 1914): -0.038,
    ('torchtitan', 'Llama 2 13B', 64, 128,
     'dp64 zero3 mb2 selective', 'torchtitan-fsdp2', 1904): +0.002,
    ('torchtitan', 'Llama 2 70B', 64, 64,
     'dp64 zero3 mb1 selective', 'torchtitan-fsdp2', 355): +0.025,
    ('torchtitan', 'Llama 2 70B', 64, 128, 'dp64 zero3 mb2 full', 'torchtitan-fsdp2', 353): -0.057,
    ('torchtitan', 'Llama 3 8B', 8, 16,
     'dp8 zero3 mb2 selective', 'torchtitan-fsdp2', 5762): -0.023,
    ('torchtitan', 'Llama 3 8B', 8, 16,
     'dp8 zero3 mb2 selective', 'torchtitan-fsdp2-compile', 6667): -0.007,
    ('torchtitan', 'Llama 3 8B', 128, 256,
     'dp128 zero3 mb2 selective', 'torchtitan-fsdp2', 5605): +0.007,
    ('torchtitan', 'Llama 3 8B', 128, 256,
     'dp128 zero3 mb2 selective', 'torchtitan-fsdp2-compile', 6514): +0.019,
    ('llm-foundry', 'MPT 70b', 512, 4096, 'dp512 zero3 mb8 full', 'pytorch-fsdp1', 1007): -0.002,
    ('llm-foundry', 'MPT 70b', 256, 2048, 'dp256 zero3 mb8 full', 'pytorch-fsdp1', 1035): -0.028,
    ('llm-foundry', 'MPT 70b', 128, 1024, 'dp128 zero3 mb8 full', 'pytorch-fsdp1', 1058): -0.048,
    ('llm-foundry', 'MPT 30b', 512, 4096,
     'dp512 zero3 mb8 full', 'pytorch-fsdp1-triton', 2115): -0.010,
    ('llm-foundry', 'MPT 30b', 256, 2048,
     'dp256 zero3 mb8 full', 'pytorch-fsdp1-triton', 2148): -0.022,
    ('llm-foundry', 'MPT 30b', 128, 1024,
     'dp128 zero3 mb8 full', 'pytorch-fsdp1-triton', 2199): -0.044,
    ('llm-foundry', 'MPT 13b', 512, 8192,
     'dp512 zero3 mb16 full', 'pytorch-fsdp1-triton', 4952): -0.061,
    ('llm-foundry', 'MPT 13b', 256, 4096,
     'dp256 zero3 mb16 full', 'pytorch-fsdp1-triton', 4989): -0.066,
    ('llm-foundry', 'MPT 13b', 128, 2048,
     'dp128 zero3 mb16 full', 'pytorch-fsdp1-triton', 5080): -0.082,
    ('llm-foundry', 'MPT 7b', 512, 3072, 'dp512 zero3 mb6', 'pytorch-fsdp1', 9670): +0.156,
    ('llm-foundry', 'MPT 7b', 256, 1536, 'dp256 zero3 mb6', 'pytorch-fsdp1', 10119): +0.120,
    ('llm-foundry', 'MPT 7b', 128, 768, 'dp128 zero3 mb6', 'pytorch-fsdp1', 10475): +0.089,
    ('llm-foundry', 'MPT 3b', 512, 4096, 'dp512 zero2 mb8', 'pytorch-fsdp1', 21664): +0.119,
    ('llm-foundry', 'MPT 3b', 256, 2048, 'dp256 zero2 mb8', 'pytorch-fsdp1', 22772): +0.082,
    ('llm-foundry', 'MPT 3b', 128, 1024, 'dp128 zero2 mb8', 'pytorch-fsdp1', 23422): +0.060,
    ('llm-foundry', 'MPT 1b', 512, 6144, 'dp512 zero2 mb12', 'pytorch-fsdp1', 39837): +0.174,
    ('llm-foundry', 'MPT 1b', 256, 3072, 'dp256 zero2 mb12', 'pytorch-fsdp1', 42555): +0.117,
    ('llm-foundry', 'MPT 1b', 128, 1536, 'dp128 zero2 mb12', 'pytorch-fsdp1', 44123): +0.086,
    ('bigscience', 'BLOOM 176B', 384, 2048,
     'pp12 x dp8 x tp4 zero1 1f1b mb2 full', 'megatron-deepspeed', 104.7): +0.019,
    ('bigscience', 'BLOOM 176B', 384, 16,
     'pp12 x dp8 x tp4 zero1 1f1b mb2 full', 'megatron-deepspeed', 15.23): +0.297,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp12 x dp4 x tp8 zero1 1f1b mb1 full', 'megatron-deepspeed', 143.31): +0.079,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp12 x dp4 x tp8 zero1 1f1b mb2 full', 'megatron-deepspeed', 134.02): +0.108,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp12 x dp4 x tp8 zero1 1f1b mb4 full', 'megatron-deepspeed', 123.69): +0.038,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp12 x dp4 x tp8 zero1 1f1b mb8 full', 'megatron-deepspeed', 129.26): +0.036,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp6 x dp8 x tp8 zero1 1f1b mb1 full', 'megatron-deepspeed', 139.82): +0.111,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp6 x dp8 x tp8 zero1 1f1b mb2 full', 'megatron-deepspeed', 131.02): +0.143,
    ('bigscience', 'BLOOM 181B', 384, 2048,
     'pp6 x dp8 x tp8 zero1 1f1b mb4 full', 'megatron-deepspeed', 121.48): +0.079,
    ('bigscience', 'BLOOM 177B', 384, 2048,
     'pp6 x dp8 x tp8 zero1 1f1b mb2 full', 'megatron-deepspeed', 136.73): +0.179,
    ('bigscience', 'BLOOM 177B', 384, 2048,
     'pp6 x dp8 x tp8 zero1 1f1b mb4 full', 'megatron-deepspeed', 122.96): +0.087,
    ('narayanan2021-zero3', 'GPT 174.6B', 384, 1536,
     'dp384 zero3 mb4 full', 'deepspeed-zero3-2021', 144): +0.187,
    ('narayanan2021-zero3', 'GPT 174.6B', 768, 1536,
     'dp768 zero3 mb2 full', 'deepspeed-zero3-2021', 88): +0.334,
    ('narayanan2021-zero3', 'GPT 174.6B', 1536, 1536,
     'dp1536 zero3 mb1 full', 'deepspeed-zero3-2021', 44): -0.098,
    ('narayanan2021-zero3', 'GPT 529.6B', 640, 2560,
     'dp640 zero3 mb4 full', 'deepspeed-zero3-2021', 138): +0.270,
    ('narayanan2021-zero3', 'GPT 529.6B', 1120, 2240,
     'dp1120 zero3 mb2 full', 'deepspeed-zero3-2021', 98): +0.332,
    ('narayanan2021-zero3', 'GPT 529.6B', 2240, 2240,
     'dp2240 zero3 mb1 full', 'deepspeed-zero3-2021', 48): +0.404,
    ('narayanan2021-zero3', 'GPT 174.6B', 384, 1536,
     'pp12 x dp4 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 153): -0.019,
    ('narayanan2021-zero3', 'GPT 174.6B', 768, 1536,
     'pp12 x dp8 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 149): -0.011,
    ('narayanan2021-zero3', 'GPT 174.6B', 1536, 1536,
     'pp12 x dp16 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 141): +0.009,
    ('narayanan2021-zero3', 'GPT 529.6B', 560, 2240,
     'pp35 x dp2 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 171): -0.015,
    ('narayanan2021-zero3', 'GPT 529.6B', 1120, 2240,
     'pp35 x dp4 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 167): -0.008,
    ('narayanan2021-zero3', 'GPT 529.6B', 2240, 2240,
     'pp35 x dp8 x tp8 interleaved v2 mb1 full', 'megatron-lm-2021', 159): +0.009,
    ('mt-nlg', 'MT-NLG 530B', 2240, 1920,
     'pp35 x dp8 x tp8 zero1 1f1b mb1 full', 'megatron-deepspeed', 126): +0.185,
    ('mt-nlg', 'MT-NLG 530B', 2800, 1920,
     'pp35 x dp10 x tp8 zero1 1f1b mb1 full', 'megatron-deepspeed', 121): +0.195,
    ('mt-nlg', 'MT-NLG 530B', 3360, 1920,
     'pp35 x dp12 x tp8 zero1 1f1b mb1 full', 'megatron-deepspeed', 113): +0.240,
    ('opt', 'OPT-175B', 992, 992, 'dp124 x tp8 zero2 mb8 full saved/tp', 'metaseq', 147): +0.144,
    ('llm-foundry-a100', 'MPT 70b', 64, 2048,
     'dp64 zero3 mb8 full', 'pytorch-fsdp1-triton', 410): -0.027,
    ('llm-foundry-a100', 'MPT 70b', 32, 1024,
     'dp32 zero3 mb2 full', 'pytorch-fsdp1-triton', 373): +0.024,
    ('llm-foundry-a100', 'MPT 70b', 128, 512,
     'dp128 zero3 mb4 full', 'pytorch-fsdp1-triton', 376): +0.044,
    ('llm-foundry-a100', 'MPT 70b', 64, 128,
     'dp64 zero3 mb2 full', 'pytorch-fsdp1-triton', 276): +0.371,
    ('llm-foundry-a100', 'MPT 30b', 128, 768,
     'dp128 zero3 mb6 full', 'pytorch-fsdp1-triton', 865): -0.028,
    ('llm-foundry-a100', 'MPT 30b', 32, 128,
     'dp32 zero3 mb4 full', 'pytorch-fsdp1-triton', 857): -0.033,
    ('llm-foundry-a100', 'MPT 13b', 128, 2048,
     'dp128 zero3 mb16 full', 'pytorch-fsdp1-triton', 1972): -0.038,
    ('llm-foundry-a100', 'MPT 13b', 64, 1024,
     'dp64 zero3 mb16 full', 'pytorch-fsdp1-triton', 1976): -0.040,
    ('llm-foundry-a100', 'MPT 13b', 32, 448,
     'dp32 zero3 mb14 full', 'pytorch-fsdp1-triton', 1998): -0.051,
    ('llm-foundry-a100', 'MPT 13b', 16, 160,
     'dp16 zero3 mb10 full', 'pytorch-fsdp1-triton', 1993): -0.052,
    ('llm-foundry-a100', 'MPT 7b', 128, 2304,
     'dp128 zero3 mb18 full', 'pytorch-fsdp1-triton', 3623): -0.016,
    ('llm-foundry-a100', 'MPT 7b', 64, 1152,
     'dp64 zero3 mb18 full', 'pytorch-fsdp1-triton', 3665): -0.028,
    ('llm-foundry-a100', 'MPT 7b', 32, 576,
     'dp32 zero3 mb18 full', 'pytorch-fsdp1-triton', 3725): -0.043,
    ('llm-foundry-a100', 'MPT 7b', 16, 256,
     'dp16 zero3 mb16 full', 'pytorch-fsdp1-triton', 3645): -0.022,
    ('llm-foundry-a100', 'MPT 3b', 128, 768,
     'dp128 zero3 mb6', 'pytorch-fsdp1-triton', 9538): +0.089,
    ('llm-foundry-a100', 'MPT 3b', 64, 384, 'dp64 zero3 mb6', 'pytorch-fsdp1-triton', 9736): +0.070,
    ('llm-foundry-a100', 'MPT 3b', 32, 192, 'dp32 zero3 mb6', 'pytorch-fsdp1-triton', 9914): +0.052,
    ('llm-foundry-a100', 'MPT 3b', 16, 80, 'dp16 zero3 mb5', 'pytorch-fsdp1-triton', 9750): +0.044,
    ('llm-foundry-a100', 'MPT 1b', 128, 1280,
     'dp128 zero3 mb10', 'pytorch-fsdp1-triton', 18647): +0.055,
    ('llm-foundry-a100', 'MPT 1b', 64, 640,
     'dp64 zero3 mb10', 'pytorch-fsdp1-triton', 19001): +0.038,
    ('llm-foundry-a100', 'MPT 1b', 32, 320,
     'dp32 zero3 mb10', 'pytorch-fsdp1-triton', 15555): +0.269,
    ('llm-foundry-a100', 'MPT 1b', 16, 128,
     'dp16 zero3 mb8', 'pytorch-fsdp1-triton', 19085): +0.021,
    ('llm-foundry-a100', 'MPT 760m', 128, 1536,
     'dp128 zero3 mb12', 'pytorch-fsdp1-triton', 28940): +0.071,
    ('llm-foundry-a100', 'MPT 760m', 64, 768,
     'dp64 zero3 mb12', 'pytorch-fsdp1-triton', 29344): +0.060,
    ('llm-foundry-a100', 'MPT 760m', 32, 384,
     'dp32 zero3 mb12', 'pytorch-fsdp1-triton', 29648): +0.051,
    ('llm-foundry-a100', 'MPT 760m', 16, 192,
     'dp16 zero3 mb12', 'pytorch-fsdp1-triton', 29607): +0.053,
    ('llm-foundry-a100', 'MPT 350m', 128, 2304,
     'dp128 zero3 mb18', 'pytorch-fsdp1-triton', 51934): +0.000,
    ('llm-foundry-a100', 'MPT 350m', 64, 1152,
     'dp64 zero3 mb18', 'pytorch-fsdp1-triton', 52689): -0.010,
    ('llm-foundry-a100', 'MPT 350m', 32, 576,
     'dp32 zero3 mb18', 'pytorch-fsdp1-triton', 53811): -0.029,
    ('llm-foundry-a100', 'MPT 350m', 16, 288,
     'dp16 zero3 mb18', 'pytorch-fsdp1-triton', 55413): -0.057,
    ('fms-fsdp', 'Llama 2 7B', 128, 256, 'dp128 zero3 shard8 mb2', 'pytorch-fsdp1', 3700): +0.043,
    ('fms-fsdp', 'Llama 2 7B', 96, 192, 'dp96 zero3 shard8 mb2', 'pytorch-fsdp1', 7500): +0.161,
    ('fms-fsdp', 'Llama 2 13B', 128, 256, 'dp128 zero3 mb2 full/2', 'pytorch-fsdp1', 1800): +0.022,
    ('fms-fsdp', 'Llama 2 13B', 96, 192, 'dp96 zero3 mb2 full/2', 'pytorch-fsdp1', 3800): +0.099,
    ('fms-fsdp', 'Llama 2 34B', 128, 256, 'dp128 zero3 mb2 full', 'pytorch-fsdp1', 700): -0.044,
    ('fms-fsdp', 'Llama 2 34B', 96, 192, 'dp96 zero3 mb2 full', 'pytorch-fsdp1', 1550): +0.022,
    ('fms-fsdp', 'Llama 2 70B', 128, 256, 'dp128 zero3 mb2 full', 'pytorch-fsdp1', 370): -0.099,
    ('fms-fsdp', 'Llama 2 70B', 96, 192, 'dp96 zero3 mb2 full', 'pytorch-fsdp1', 800): +0.003,
    ('fms-fsdp', 'Llama 2 7B', 128, 256,
     'dp128 zero3 shard8 mb2', 'pytorch-fsdp1-compile', 4550): -0.072,
    ('fms-fsdp', 'Llama 2 7B', 96, 192,
     'dp96 zero3 shard8 mb2', 'pytorch-fsdp1-compile', 9600): +0.031,
    ('fms-fsdp', 'Llama 2 13B', 128, 256,
     'dp128 zero3 mb2 full/2', 'pytorch-fsdp1-compile', 2150): -0.075,
    ('fms-fsdp', 'Llama 2 13B', 96, 192,
     'dp96 zero3 mb2 full/2', 'pytorch-fsdp1-compile', 4850): -0.038,
    ('fms-fsdp', 'Llama 2 34B', 128, 256,
     'dp128 zero3 mb2 full', 'pytorch-fsdp1-compile', 820): -0.136,
    ('fms-fsdp', 'Llama 2 34B', 96, 192,
     'dp96 zero3 mb2 full', 'pytorch-fsdp1-compile', 1830): -0.058,
    ('fms-fsdp', 'Llama 2 70B', 128, 256,
     'dp128 zero3 mb2 full', 'pytorch-fsdp1-compile', 410): -0.146,
    ('fms-fsdp', 'Llama 2 70B', 96, 192,
     'dp96 zero3 mb2 full', 'pytorch-fsdp1-compile', 890): -0.029,
    ('torchtitan-asynctp', 'Llama 3 70B', 256, 512,
     'dp32 x tp8 zero3 sp mb16 full', 'torchtitan-fsdp2-compile', 597.3): +0.006,
    ('torchtitan-asynctp', 'Llama 3 70B', 256, 512,
     'dp32 x tp8 zero3 sp mb16 full', 'torchtitan-asynctp', 652.4): +0.061,
    ('torchtitan-asynctp', 'Llama 3 8B', 64, 96,
     'dp8 x tp8 zero3 sp mb12 selective', 'torchtitan-fsdp2-compile', 4378.0): +0.146,
    ('torchtitan-asynctp', 'Llama 3 8B', 64, 96,
     'dp8 x tp8 zero3 sp mb12 selective', 'torchtitan-asynctp', 4809.4): +0.168,
    ('llm-foundry-h100', 'MPT 70b', 64, 2048,
     'dp64 zero3 mb8 full', 'pytorch-fsdp1-triton', 1039): -0.049,
    ('llm-foundry-h100', 'MPT 70b', 32, 1024,
     'dp32 zero3 mb2 full', 'pytorch-fsdp1-triton', 882): +0.066,
    ('llm-foundry-h100', 'MPT 30b', 8, 168,
     'dp8 zero3 mb1 full', 'pytorch-fsdp1-triton', 1384): +0.226,
    ('llm-foundry-h100', 'MPT 30b', 8, 168,
     'dp8 zero3 mb1 full', 'pytorch-fsdp1-triton', 1802): +0.038,
    ('llm-foundry-h100', 'MPT 30b', 32, 1344,
     'dp32 zero3 mb14 full', 'pytorch-fsdp1-triton', 2308): -0.076,
    ('llm-foundry-h100', 'MPT 30b', 16, 480,
     'dp16 zero3 mb10 full', 'pytorch-fsdp1-triton', 2263): -0.058,
    ('llm-foundry-h100', 'MPT 30b', 8, 504,
     'dp8 zero3 mb3 full', 'pytorch-fsdp1-triton', 2002): +0.012,
    ('llm-foundry-h100', 'MPT 30b', 8, 1008,
     'dp8 zero3 mb6 full', 'pytorch-fsdp1-triton', 2084): +0.008,
    ('llm-foundry-h100', 'MPT 13b', 8, 24,
     'dp8 zero3 mb1 full', 'pytorch-fsdp1-triton', 1976): -0.050,
    ('llm-foundry-h100', 'MPT 13b', 8, 72,
     'dp8 zero3 mb3 full', 'pytorch-fsdp1-triton', 2985): -0.076,
    ('llm-foundry-h100', 'MPT 13b', 8, 240,
     'dp8 zero3 mb10 full', 'pytorch-fsdp1-triton', 4717): -0.098,
    ('llm-foundry-h100', 'MPT 13b', 64, 128,
     'dp64 zero3 mb2', 'pytorch-fsdp1-triton', 4800): +0.175,
    ('llm-foundry-h100', 'MPT 13b', 32, 64, 'dp32 zero3 mb2', 'pytorch-fsdp1-triton', 4811): +0.172,
    ('llm-foundry-h100', 'MPT 13b', 16, 32, 'dp16 zero3 mb2', 'pytorch-fsdp1-triton', 4767): +0.178,
    ('llm-foundry-h100', 'MPT 13b', 8, 16, 'dp8 zero3 mb2', 'pytorch-fsdp1-triton', 4792): +0.159,
    ('llm-foundry-h100', 'MPT 13b', 8, 960,
     'dp8 zero3 mb40 full', 'pytorch-fsdp1-triton', 5502): -0.106,
    ('llm-foundry-h100', 'MPT 7b', 8, 16,
     'dp8 zero3 mb1 full', 'pytorch-fsdp1-triton', 1956): -0.049,
    ('llm-foundry-h100', 'MPT 7b', 8, 32,
     'dp8 zero3 mb2 full', 'pytorch-fsdp1-triton', 3318): -0.058,
    ('llm-foundry-h100', 'MPT 7b', 8, 128,
     'dp8 zero3 mb8 full', 'pytorch-fsdp1-triton', 6935): -0.079,
    ('llm-foundry-h100', 'MPT 7b', 8, 256,
     'dp8 zero3 mb16 full', 'pytorch-fsdp1-triton', 8611): -0.103,
    ('llm-foundry-h100', 'MPT 7b', 8, 48, 'dp8 zero3 mb6', 'pytorch-fsdp1-triton', 10643): +0.033,
    ('llm-foundry-h100', 'MPT 7b', 8, 1024,
     'dp8 zero3 mb64 full', 'pytorch-fsdp1-triton', 10203): -0.101,
    ('llm-foundry-h100', 'MPT 3b', 8, 16,
     'dp8 zero3 mb1 full', 'pytorch-fsdp1-triton', 3262): -0.033,
    ('llm-foundry-h100', 'MPT 3b', 8, 144,
     'dp8 zero3 mb3 full', 'pytorch-fsdp1-triton', 5873): -0.059,
    ('llm-foundry-h100', 'MPT 3b', 8, 48, 'dp8 zero3 mb1', 'pytorch-fsdp1-triton', 11152): +0.003,
    ('llm-foundry-h100', 'MPT 3b', 8, 144, 'dp8 zero3 mb3', 'pytorch-fsdp1-triton', 16578): -0.027,
    ('llm-foundry-h100', 'MPT 3b', 8, 240, 'dp8 zero3 mb5', 'pytorch-fsdp1-triton', 20964): -0.026,
    ('llm-foundry-h100', 'MPT 3b', 64, 1152,
     'dp64 zero3 mb6', 'pytorch-fsdp1-triton', 22525): +0.025,
    ('llm-foundry-h100', 'MPT 3b', 32, 576,
     'dp32 zero3 mb6', 'pytorch-fsdp1-triton', 23021): +0.006,
    ('llm-foundry-h100', 'MPT 3b', 16, 480,
     'dp16 zero3 mb10', 'pytorch-fsdp1-triton', 24142): -0.020,
    ('llm-foundry-h100', 'MPT 3b', 8, 960, 'dp8 zero3 mb20', 'pytorch-fsdp1-triton', 27046): -0.048,
    ('llm-foundry-h100', 'MPT 3b', 8, 1920,
     'dp8 zero3 mb40', 'pytorch-fsdp1-triton', 27965): -0.037,
    ('llm-foundry-h100', 'MPT 1b', 8, 16,
     'dp8 zero3 mb1 full', 'pytorch-fsdp1-triton', 5506): -0.025,
    ('llm-foundry-h100', 'MPT 1b', 8, 32, 'dp8 zero3 mb1', 'pytorch-fsdp1-triton', 12025): +0.005,
    ('llm-foundry-h100', 'MPT 1b', 8, 64, 'dp8 zero3 mb2', 'pytorch-fsdp1-triton', 19649): +0.012,
    ('llm-foundry-h100', 'MPT 1b', 8, 96, 'dp8 zero3 mb3', 'pytorch-fsdp1-triton', 29157): +0.006,
    ('llm-foundry-h100', 'MPT 1b', 8, 224, 'dp8 zero3 mb7', 'pytorch-fsdp1-triton', 38535): +0.001,
    ('llm-foundry-h100', 'MPT 1b', 64, 1280,
     'dp64 zero3 mb20', 'pytorch-fsdp1-triton', 44402): +0.031,
    ('llm-foundry-h100', 'MPT 1b', 32, 640,
     'dp32 zero3 mb20', 'pytorch-fsdp1-triton', 45130): +0.016,
    ('llm-foundry-h100', 'MPT 1b', 16, 320,
     'dp16 zero3 mb20', 'pytorch-fsdp1-triton', 46037): -0.004,
    ('llm-foundry-h100', 'MPT 1b', 8, 112, 'dp8 zero3 mb14', 'pytorch-fsdp1-triton', 45455): +0.003,
    ('llm-foundry-h100', 'MPT 1b', 8, 576, 'dp8 zero3 mb18', 'pytorch-fsdp1-triton', 48910): +0.023,
    ('llm-foundry-h100', 'MPT 1b', 8, 1792,
     'dp8 zero3 mb56', 'pytorch-fsdp1-triton', 52275): +0.016,
    ('llm-foundry-h100', 'MPT 760m', 8, 16, 'dp8 zero3 mb1', 'pytorch-fsdp1-triton', 16291): +0.010,
    ('llm-foundry-h100', 'MPT 760m', 8, 48, 'dp8 zero3 mb3', 'pytorch-fsdp1-triton', 27815): -0.010,
    ('llm-foundry-h100', 'MPT 760m', 8, 96, 'dp8 zero3 mb6', 'pytorch-fsdp1-triton', 41825): -0.009,
    ('llm-foundry-h100', 'MPT 760m', 8, 192,
     'dp8 zero3 mb12', 'pytorch-fsdp1-triton', 55459): +0.000,
    ('llm-foundry-h100', 'MPT 760m', 32, 768,
     'dp32 zero3 mb24', 'pytorch-fsdp1-triton', 67971): -0.020,
    ('llm-foundry-h100', 'MPT 760m', 16, 384,
     'dp16 zero3 mb24', 'pytorch-fsdp1-triton', 68551): -0.027,
    ('llm-foundry-h100', 'MPT 760m', 8, 384,
     'dp8 zero3 mb24', 'pytorch-fsdp1-triton', 63147): +0.057,
    ('llm-foundry-h100', 'MPT 760m', 8, 768,
     'dp8 zero3 mb48', 'pytorch-fsdp1-triton', 78581): -0.055,
    ('llm-foundry-h100', 'MPT 760m', 8, 1536,
     'dp8 zero3 mb96', 'pytorch-fsdp1-triton', 83749): -0.060,
}


def test_each_row_stays_in_its_band(results):
    # the published figure is part of a row's name: two runs of one configuration (torchtitan's
    # vanilla and async tensor parallelism, which the planner prices alike) are two rows
    got = {(r["key"], r["model"], r["gpus"], r["batch"], r["layout"], r["stack"], r["published"]):
           r["throughput_error"] for r in results}
    assert set(got) == set(BANDS)
    moved = {k: (round(got[k], 3), v) for k, v in BANDS.items() if abs(got[k] - v) > 0.02}
    assert not moved, moved


def test_the_sustained_shares_are_what_the_rows_choose():
    """The one constant chosen by looking at rows is fitted, not typed: ``SUSTAINED`` is what
    ``published.fit`` finds over every source, and its spread what ``published.spread`` finds."""
    table = published.steps(ROWS, published.GRID)
    assert published.fit(ROWS, table) == pytest.approx(predict_module.SUSTAINED, abs=0.002)
    assert published.spread(ROWS, table) == pytest.approx(predict_module.SUSTAINED_SPREAD, abs=0.011)


def test_each_row_predicts_the_papers_own_metric():
    row = next(r for r in ROWS if r.metric == "tflops_per_gpu" and r.convention == "megatron")
    m, b, s = row.model, row.global_batch, row.seq_len
    # Narayanan et al. eq. 3, written out: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration
    h, layers = m.d_model, m.n_layer
    flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + m.vocab / (16 * layers * h))
    assert row.predicted(10.0) == pytest.approx(flops / 10.0 / row.gpus / 1e12)
    timed = next(r for r in ROWS if r.metric == "iteration_s")
    assert timed.predicted(12.5) == 12.5
    tokens = next(r for r in ROWS if r.metric == "tokens_per_s_per_gpu")
    assert tokens.predicted(2.0) == tokens.global_batch * tokens.seq_len / 2.0 / tokens.gpus


def test_korthikanti_iteration_times_agree_with_the_mfu_they_report():
    """A typo guard from an independent figure: the paper's (and Megatron-LM's README's) MFU of
    each present-work run, from its model FLOPs 72 B s l h^2 (1 + s/6h + V/12lh), its time and
    N x 312 TFLOP/s."""
    rows = [r for r in ROWS if "mfu" in r.extra]
    assert len(rows) == 4
    for r in rows:
        m, b, s = r.model, r.global_batch, r.seq_len
        h, layers = m.d_model, m.n_layer
        flops = 72 * b * s * layers * h * h * (1 + s / (6 * h) + m.vocab / (12 * layers * h))
        assert flops / (r.value * r.gpus * 312e12) == pytest.approx(r.extra["mfu"], abs=0.002), m.name


def test_megatron_core_rows_are_the_sizes_its_table_prints():
    """A typo guard: the model table's sizes from its heads, width and layers (GeLU, f = 4h,
    vocabulary 131072, untied), and its MFU column from its TFLOP/s over 989."""
    for row, size in zip([r for r in ROWS if r.source.key == "megatron-core"][:9],
                         (1.7, 7.1, 16, 32, 70, 119, 177, 314, 462)):
        assert row.model.n_params() / 1e9 == pytest.approx(size, rel=0.03), row.model.name


def test_a_run_here_holds_what_the_plan_says_to_the_byte(tmp_path):
    options = {"dp": 2, "zero": 1, "pp": 2}
    run = dlab.launch("nd", 4, runs_dir=tmp_path, wait=True, model_options=MODEL, options=options,
                      batch_size=BATCH, steps=2)
    machine = clusters.this_machine(peak=1e10, ranks=4)
    pred = predict(options, machine)
    state = max(sum(m["memory"][k] for k in ("parameters", "gradients", "optimizer"))
                for m in (run.metrics(r)[-1] for r in range(4)))
    sent = max(run.metrics(r)[-1]["comm"]["sent_bytes"] for r in range(4))
    act = max(run.metrics(r)[-1]["memory"]["activations"] for r in range(4))
    assert pred["state_plan_MB"] * 1e6 == pytest.approx(state, abs=1)
    assert pred["sent_plan_MB"] * 1e6 == pytest.approx(sent, abs=1)
    assert pred["act_plan_MB"] * 1e6 == pytest.approx(act, rel=0.02)


def test_data_parallel_state_and_bytes_equal_a_count_of_the_models_own_parameters(tmp_path):
    """Derived apart from ``dlab.theory``: two replicas of the lab GPT each hold its Psi
    parameters in fp32 (4 bytes), their gradients (4) and Adam's two moments (8, plus a 4-byte
    step counter per tensor), and each sends 2 (n-1)/n x 4 Psi = 4 Psi bytes a step (a ring
    all-reduce of the gradients); the planner says the same."""
    model = GPT(GPTConfig(**MODEL))
    psi = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    options = {"dp": 2}
    run = dlab.launch("nd", 2, runs_dir=tmp_path, wait=True, model_options=MODEL, options=options,
                      batch_size=BATCH, steps=2)
    last = [run.metrics(r)[-1] for r in range(2)]
    pred = predict(options, clusters.this_machine(peak=1e10, ranks=2))
    for m in last:
        assert m["memory"]["parameters"] == 4 * psi
        assert m["memory"]["gradients"] == 4 * psi
        assert m["memory"]["optimizer"] == 8 * psi + 4 * tensors
        assert m["comm"]["sent_bytes"] == 4 * psi
    assert pred["state_plan_MB"] * 1e6 == pytest.approx(16 * psi + 4 * tensors, abs=1)
    assert pred["sent_plan_MB"] * 1e6 == pytest.approx(4 * psi, abs=1)


SLOW = pytest.mark.slow
LAYOUTS = [pytest.param({"cp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, id="cp2-tp2-sp-zero1"),
           pytest.param({"pp": 2, "tp": 2, "sequence_parallel": True}, id="pp2-tp2-sp", marks=SLOW),
           pytest.param({"tp": 4}, id="tp4", marks=SLOW),
           pytest.param({"pp": 2, "dp": 2, "zero": 1}, id="pp2-dp2-zero1")]


@pytest.mark.parametrize("options", LAYOUTS)
def test_the_plan_counts_the_collectives_a_run_makes(options, tmp_path):
    """On the CPU with more ranks than cores every blocking collective is charged its measured
    cost, so the count per dimension must be the run's: each rank's calls per step, as its comm
    meter booked them, against ``collective_calls`` for its pipeline stage. (The slow cases
    take the same code path as cp2-tp2-sp-zero1 and pp2-dp2-zero1.)"""
    from dlab.theory.plan import cpu as tm
    from dlab.theory.plan.spec import from_gpt
    lay = plan_layout(options)
    run = dlab.launch("nd", 4, runs_dir=tmp_path, wait=True, model_options=MODEL, options=options,
                      batch_size=BATCH, steps=2)
    spec = from_gpt(GPTConfig(**MODEL))
    names = {"tp": "tensor", "cp": "context", "data": "data", "pp": "pipeline", "tied": "tied"}
    for rank in range(4):
        pp_rank = rank // (4 // lay.pp)
        layers = tm.layers_on(spec, lay, pp_rank)
        want = tm.collective_calls(lay, lay.for_batch(BATCH).microbatches, layers, pp_rank, 1.0, 1.0, 1.0,
                                   boundary=1.0, tied=1.0)
        booked = run.metrics(rank)[-1]["comm_by_dim"]
        for dim, calls in want.items():
            per_call = 2 if dim in ("cp", "pp") else 1  # a pass or pair: a send and a receive
            assert sum(c[2] for c in calls) * per_call == booked[names[dim]]["calls"], (rank, dim)


def _rounds(world: int, alone: float, fixed: float, per_byte: float, fill: float):
    """What ``collective_probe``'s ranks would report: every (op, group, payload) round costs
    ``alone`` (the compute) + ``fixed`` + ``per_byte`` x payload, as CPU and as wall seconds,
    rank r a little over and rank world-1-r as much under (their mean is the round); where the
    ranks outnumber 2 cores each round's wall is such that they fill ``fill`` of the cores' time,
    else it is the round."""
    from dlab.tools import calibrate

    def per_rank(r):
        out = {}
        for g in (g for g in range(2, world + 1) if world % g == 0):
            for op in calibrate.OPS:
                for size in calibrate.PROBE_SIZES:
                    round_ = alone + fixed + per_byte * size
                    cpu = round_ + 1e-6 * (r - (world - 1) / 2)
                    out[(op, g, size)] = (world * round_ / (2 * fill) if world > 2 else round_, cpu)
        return out
    return lambda fn, n, *args, **kwargs: [per_rank(r) for r in range(n)]


@pytest.mark.parametrize("world,fill", [(4, 0.8), (8, 1.2), (2, 1.0)])
def test_the_probe_takes_each_calls_cost_from_its_rounds(world, fill, monkeypatch):
    """The probe's arithmetic, on rounds written here: a call's cost is its round less the same
    compute alone, its fixed part and its part per byte through the two payloads; where 4 or 8
    ranks share 2 cores the cost is CPU seconds and the utilization the ranks' CPU over the
    cores' time (never above 1: a measured 1.2 is clocks' skew), with a core each it is wall
    seconds and the utilization 1."""
    from dlab.tools import calibrate
    monkeypatch.setattr(calibrate, "usable_cores", lambda: 2)
    monkeypatch.setattr(calibrate, "_work_seconds", lambda work, clock: 1.3e-3)
    monkeypatch.setattr(calibrate, "spawn", _rounds(world, 1.3e-3, 4e-4, 2e-9, fill))
    probe = calibrate.collective_probe(world, runs_dir="unused")
    groups = [g for g in range(2, world + 1) if world % g == 0]
    assert {(op, g) for op, g, _, _ in probe.calls} == {(op, g) for op in calibrate.OPS for g in groups}
    for _, _, fixed, per_byte in probe.calls:
        assert (fixed, per_byte) == (pytest.approx(4e-4, rel=1e-6), pytest.approx(2e-9, rel=1e-6))
    assert probe.utilization == pytest.approx(min(fill, 1.0) if world > 2 else 1.0)
    machine = clusters.this_machine(peak=1e10, ranks=world, calls=probe.calls)
    assert machine.call_cost("all_reduce", groups[-1], 1e6) == pytest.approx(4e-4 + 2e-9 * 1e6, rel=1e-6)
    assert machine.call_cost("all_reduce", 16, 1.0) is None  # not measured: the planner uses the link


def test_the_probe_measures_every_op_the_planner_charges_on_real_ranks(tmp_path):
    """Two ranks on this machine, the probe at its smallest (one piece of compute, one round a
    trial): every op over the one group that divides 2, each cost a finite number of seconds
    no smaller than 0, and with a core per rank the utilization 1. (How far a call's cost lies
    above its wire time is timing: the slow test below.)"""
    import math

    from dlab.tools import calibrate
    probe = calibrate.collective_probe(2, work=1, repeats=1, trials=1, runs_dir=tmp_path)
    assert {(op, g) for op, g, _, _ in probe.calls} == {(op, 2) for op in calibrate.OPS}
    assert all(math.isfinite(x) and x >= 0 for _, _, fixed, per_byte in probe.calls
               for x in (fixed, per_byte))
    shared = 2 > calibrate.usable_cores()
    assert probe.utilization == 1.0 or shared and 0 < probe.utilization <= 1.0


@pytest.mark.slow
@pytest.mark.skipif((__import__("os").cpu_count() or 1) >= 4, reason="needs 4 ranks to outnumber the cores")
def test_with_ranks_outnumbering_cores_the_probe_measures_every_op_for_every_group(tmp_path):
    """The probe at 4 ranks on fewer cores: every op the planner charges, for every group size
    that divides 4, each a finite cost, and the share of the cores' time the ranks fill in (0, 1].
    How far a call's cost lies above its wire time there is timing, which moves by 10x either way
    with the machine's other work (at a load of 8 one 4-rank run read a tenth of the wire time,
    one 2-rank run 140 times it): ``python -m dlab bench plan`` prints it (its probe rows), no
    test holds a threshold on it."""
    import math

    from dlab.tools import calibrate
    probe = calibrate.collective_probe(4, repeats=5, trials=1, runs_dir=tmp_path)
    assert {(op, g) for op, g, _, _ in probe.calls} == {(op, g) for op in calibrate.OPS for g in (2, 4)}
    assert all(math.isfinite(x) and x >= 0 for _, _, fixed, per_byte in probe.calls
               for x in (fixed, per_byte))
    assert 0 < probe.utilization <= 1.0
