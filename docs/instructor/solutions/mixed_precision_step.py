def mixed_precision_step(master, grad16, scale, lr):
    grad = grad16.float() / scale  # unscale in fp32: divided in fp16, 2e-8 would become 0
    if not torch.isfinite(grad).all():  # overflow: skip the step (the scaler halves the scale)
        return master, master.half(), False
    master = master - lr * grad  # the update goes into fp32, where 1e-4 at 1.0 survives
    return master, master.half(), True
