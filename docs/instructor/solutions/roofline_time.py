def roofline_time(flops, nbytes, peak, bandwidth):
    # Williams et al. 2009: a kernel needs its FLOPs at the peak and its bytes at the memory
    # bandwidth; the loads overlap the math, so the longer of the two is its time
    compute, memory = flops / peak, nbytes / bandwidth
    return max(compute, memory), "compute" if compute >= memory else "memory"
