def zero_memory(psi, n, stage):
    params, grads, optimizer = 2 * psi, 2 * psi, 12 * psi  # fp16 weights, fp16 grads, fp32 Adam
    if stage >= 1:
        optimizer /= n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        params /= n
    return params + grads + optimizer
