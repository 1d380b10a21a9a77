"""The published rows the planner is scored on (``dlab.theory.plan.published``), as code: each
source's configurations with the figure as the source states it, where it states it.

Fourteen sources, 191 configurations, two GPU generations, the stacks they ran:

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
- llm-foundry's A100 tables, their rows over more than one node (FSDP1 at 16-128 GPUs): 30;
- torchtitan's async TP page (FSDP2 x TP 8 on 64 and 256 H100s, compiled, bf16): 4;
- llm-foundry's "H100 80GB BF16" table (FSDP1 on 8-64 H100s, sequences of 512 to 65,536): 52.

Each row says what was assumed where its source is silent (``Published.assumed``). Left out:
rows in fp8 (the planner prices bf16 kernels only), torchtitan's 405B row (its "H100 (94GB
memory)" matches no machine the project describes).
"""
from __future__ import annotations

from dlab.theory.plan.rows import fsdp, megatron, meta
from dlab.theory.plan.rows.record import Published, Source

__all__ = ["ROWS", "Published", "Source"]

#: every row, the six sources the planner was built on first, then the others as they were added
ROWS = [*megatron.TABLE_1, *megatron.KORTHIKANTI_ROWS, *meta.LLAMA3_ROWS, *megatron.MCORE_ROWS,
        *fsdp.TITAN_ROWS, *fsdp.FOUNDRY_ROWS, *megatron.BIGSCIENCE_ROWS, *megatron.TABLE_2,
        *megatron.MTNLG_ROWS, *meta.OPT_ROWS, *fsdp.FOUNDRY_A100_ROWS, *fsdp.FMS_ROWS,
        *fsdp.TITAN_TP_ROWS, *fsdp.FOUNDRY_H100_ROWS]
