"""A cluster as the planner sees it: each GPU's peak and memory, and two link levels.

Ranks fill a node before the next (``gpus_per_node`` of them). A collective whose group lies
inside one node runs on the node's link (NVLink/NVSwitch); one that spans nodes runs at the
inter-node link's speed (a ring is as fast as its slowest hop; each GPU has its own NIC, the
rail-optimised DGX design, so groups that cross nodes side by side do not share one).

Bandwidths are *achievable bus bandwidth* per GPU in the nccl-tests sense (an all-reduce of n
bytes over N ranks takes 2 (N-1)/N n / busbw), not the data-sheet figure; latency ``alpha`` is
paid per ring step. The constants below are assumptions, each with its reason:

- ``peak``: the data sheet's dense bf16 tensor-core peak (A100 312, H100/H200 SXM 989 TFLOP/s).
- ``matmul_efficiency``: the share of that peak large bf16 GEMMs of transformer shapes reach
  in cuBLAS (about 0.8 on A100 and 0.7 on H100, whose faster tensor cores are harder to feed;
  NVIDIA's published GEMM throughput and the FlashAttention-2 paper's A100 figures, Dao 2023).
  Attention's kernels run at ``attention_efficiency`` (FlashAttention-2 forward+backward:
  about 0.5 of peak, Dao 2023 fig. 6-7; FlashAttention-3 on H100 similar).
- ``hbm``: memory bandwidth (A100 80GB 2.0, H100 3.35, H200 4.8 TB/s): the time of layer norms,
  activations and the optimizer, which read and write memory rather than multiply.
- ``intra``: NVLink all-reduce bus bandwidth measured by nccl-tests on DGX A100 (~230 GB/s of
  300 per direction) and DGX H100 (~360 GB/s of 450 without NVLS).
- ``inter``: one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100) NIC per GPU, about 90 % of line
  rate achieved: 22 and 45 GB/s.
- ``reserved``: memory a GPU cannot give to tensors (CUDA context, cuBLAS/NCCL workspaces,
  allocator fragmentation), taken as 4 GB on 80 GB parts.

"this machine" (``this_machine``) is the CPU the lab runs on: one thread per rank, the peak the
fp32 matmul probe measures (``dlab.core.metrics.measure_cpu_peak_flops``), ranks sharing ``cores``
(a rank beyond them waits its turn), and the alpha-beta link fitted by ``python -m dlab bench
allreduce`` (``docs/bench/allreduce.json``'s "(fitted link)" rows). ``dlab.tools.calibrate``
measures the rest for a given model: the rate and fixed cost of its layers on one thread, and,
when ranks outnumber the cores, the CPU each kind of blocking collective costs a rank and the
share of the cores' time the ranks fill.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dlab.core.machine import GPU_PEAK_FLOPS, measure_cpu_peak_flops, usable_cores
from dlab.theory.comm import AlphaBeta

GB = 1e9
FITTED_LINK = Path(__file__).resolve().parents[3] / "docs" / "bench" / "allreduce.json"


@dataclass(frozen=True)
class Cluster:
    name: str
    peak: float  # FLOP/s per GPU at the training precision
    memory: float  # bytes per GPU
    hbm: float  # memory bandwidth, bytes/s
    gpus_per_node: int
    intra: AlphaBeta
    inter: AlphaBeta
    matmul_efficiency: float
    attention_efficiency: float
    reserved: float = 4 * GB
    #: ranks that share one set of cores (the CPU machine); 0 on a GPU cluster
    cores: int = 0
    #: per-rank seconds of fixed cost per layer forward+backward (the CPU lab's Python and
    #: dispatcher time; zero on GPUs, where kernel launches hide behind the queue)
    layer_overhead: float = 0.0
    #: (fixed seconds, seconds per query element) of one tile of the lab's ring attention,
    #: forward and backward, on one CPU thread (``calibrate.compute``); empty on GPUs, where
    #: the tiles are one fused kernel's blocks and their FLOPs are the cost
    ring_tile: tuple = ()
    #: (op, group size, seconds, seconds per payload byte) one blocking collective costs a rank
    #: on the CPU machine (``calibrate.collective_probe``): CPU seconds where ranks outnumber
    #: ``cores`` (the planner shares them out over the cores), wall seconds where each rank has
    #: one; empty on GPUs, where the links describe a collective
    calls: tuple = ()
    #: with more ranks than ``cores``: the share of the cores' time the ranks' CPU fills (the
    #: rest is hand-offs that leave a core with no rank ready); measured by the same probe
    utilization: float = 1.0

    def oversubscribed(self, world: int) -> bool:
        """Whether ``world`` ranks outnumber the cores: then a step is CPU seconds shared out
        over the cores (``dlab.theory.plan.time``)."""
        return bool(self.cores and world > self.cores)

    def call_cost(self, op: str, group: int, payload: float) -> float | None:
        """Seconds one measured collective costs a rank (``calls``), or None where the probe did
        not measure that op over that many ranks (it measures the group sizes that divide its
        world)."""
        for name, g, fixed, per_byte in self.calls:
            if name == op and g == group:
                return fixed + per_byte * payload
        return None

    def link(self, span: int) -> AlphaBeta:
        """The link a group of ``span`` consecutive ranks' collectives run on."""
        return self.intra if span <= self.gpus_per_node else self.inter


PRESETS = {
    "a100-80gb": Cluster("A100 80GB SXM (DGX A100)", GPU_PEAK_FLOPS["A100"]["bf16"], 80 * GB, 2.039e12, 8,
                         AlphaBeta.link(230 * GB, 3e-6), AlphaBeta.link(22 * GB, 10e-6), 0.80, 0.50),
    "h100-sxm": Cluster("H100 SXM (DGX H100)", GPU_PEAK_FLOPS["H100"]["bf16"], 80 * GB, 3.35e12, 8,
                        AlphaBeta.link(360 * GB, 3e-6), AlphaBeta.link(45 * GB, 10e-6), 0.70, 0.50),
    "h200": Cluster("H200 SXM (HGX H200)", GPU_PEAK_FLOPS["H200"]["bf16"], 141 * GB, 4.8e12, 8,
                    AlphaBeta.link(360 * GB, 3e-6), AlphaBeta.link(45 * GB, 10e-6), 0.70, 0.50),
}


def preset(name: str) -> Cluster:
    if name == "this-machine":
        return this_machine()
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; choose one of "
                         f"{', '.join([*PRESETS, 'this-machine'])}") from None


def fitted_link(ranks: int, path: Path = FITTED_LINK) -> AlphaBeta:
    """The alpha-beta link ``bench allreduce`` fitted at ``ranks`` (or the nearest it fitted).
    Its alpha is one whole all-reduce's fixed cost; per ring step that is alpha / (2 (n-1))."""
    rows = [r for r in json.loads(path.read_text()) if r.get("algorithm") == "(fitted link)"]
    if not rows:
        raise ValueError(f"{path} has no '(fitted link)' rows; run python -m dlab bench allreduce "
                         f"--json {path}")
    row = min(rows, key=lambda r: abs(r["ranks"] - ranks))
    steps = 2 * (row["ranks"] - 1)
    return AlphaBeta.link(row["link GB/s"] * GB, row["alpha_us"] * 1e-6 / steps)


def this_machine(peak: float | None = None, ranks: int = 2, layer_overhead: float = 0.0,
                 ring_tile: tuple = (), calls: tuple = (), utilization: float = 1.0) -> Cluster:
    """The lab's CPU: ``peak`` per rank measured now unless given (one thread per rank).
    ``dlab.tools.calibrate.this_machine`` measures every constant for a given model."""
    cores = usable_cores()
    link = fitted_link(ranks)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = measure_cpu_peak_flops(1) if peak is None else peak
    return Cluster("this machine (CPU, Gloo on loopback)", peak, mem / max(ranks, 1), 10 * GB, 1 << 20,
                   link, link, 1.0, 1.0, reserved=0.0, cores=cores, layer_overhead=layer_overhead,
                   ring_tile=ring_tile, calls=calls, utilization=utilization)

