def activation_bytes(s, b, h, a, t, sp, recompute):
    # Korthikanti et al. 2022: per layer, 34 s b h of activations the matmuls and norms need back
    # (24 of them inside the tensor-parallel regions, 10 outside) and 5 a s^2 b of the attention
    # core (softmax, its dropout mask, their output), in bytes with 16-bit values
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)  # only the layer's input
    core = 0 if recompute == "selective" else 5 * a * s * s * b / t
    outside = 10 * sbh / (t if sp else 1)  # sequence parallelism splits what tp leaves whole
    return outside + 24 * sbh / t + core
