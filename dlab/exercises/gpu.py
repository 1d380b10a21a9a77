"""Notebook 15's checked exercise: a kernel's time on the roofline (Williams et al. 2009).

``roofline_time(flops, nbytes, peak, bandwidth) -> (seconds, bound)``: a kernel takes at least
its FLOPs at the peak and at least its bytes at the memory bandwidth, and the two overlap (its
loads stream while it computes), so its time is the longer of the two; ``bound`` says which,
"compute" or "memory". Checked on kernels of one GPT layer on an H100 SXM (datasheet bf16 peak
and HBM bandwidth), each case's figures computed directly here:
"""
from __future__ import annotations

from dlab.exercises.registry import exercise

PEAK, HBM = 989e12, 3.35e12  # H100 SXM: dense bf16 FLOP/s, bytes/s (its datasheet)
B, S, H = 8, 1024, 4096  # micro-batch, sequence, width: the tokens and layer the kernels see
T = B * S
#: name: (FLOPs, bytes) of a bf16 kernel
KERNELS = {
    "the MLP's first matmul (T x h by h x 4h)": (2 * T * H * 4 * H, 2 * (T * H + H * 4 * H + T * 4 * H)),
    "a decode-time matmul, 8 tokens (8 x h by h x 4h)": (2 * 8 * H * 4 * H,
                                                         2 * (8 * H + H * 4 * H + 8 * 4 * H)),
    "layer norm over T x h (read, write; ~8 FLOPs an element)": (8 * T * H, 2 * 2 * T * H),
    "a residual add over T x h": (T * H, 3 * 2 * T * H),
    "GELU over T x 4h (~10 FLOPs an element)": (10 * T * 4 * H, 2 * 2 * T * 4 * H),
}


def run_roofline_time(fn):
    return {name: fn(flops, nbytes, PEAK, HBM) for name, (flops, nbytes) in KERNELS.items()}


@exercise(name="roofline_time", notebook="15_gpu",
          task="roofline_time(flops, nbytes, peak, bandwidth): the kernel's seconds on the "
               "roofline and which bound sets them, 'compute' or 'memory'",
          run=run_roofline_time)
def judge_roofline_time(answer):
    for name, (flops, nbytes) in KERNELS.items():
        compute, memory = flops / PEAK, nbytes / HBM
        want = max(compute, memory)
        bound = "compute" if compute >= memory else "memory"
        got = answer[name]
        if not isinstance(got, tuple) or len(got) != 2:
            return f"{name}: return (seconds, bound), got {got!r}"
        seconds, said = got
        if abs(seconds - want) > 1e-9 * want:
            hint = ""
            if abs(seconds - (compute + memory)) <= 1e-9 * want:
                hint = ("; that is the two times added: the loads stream while the tensor cores "
                        "compute, so the kernel takes the longer of the two, not their sum")
            elif abs(seconds - compute) <= 1e-9 * want:
                hint = (f"; that is its FLOPs at the peak alone: its {nbytes / 1e6:.1f} MB at "
                        f"{HBM / 1e12:.2f} TB/s take {memory * 1e6:.1f} us, longer")
            return f"{name}: expected {want * 1e6:.3f} us, got {seconds * 1e6:.3f} us{hint}"
        if said != bound:
            return (f"{name}: bound {said!r}, expected {bound!r} ({compute * 1e6:.2f} us of "
                    f"compute against {memory * 1e6:.2f} us of memory traffic)")
    return None
