def capstone_layout():
    # s = 32768 makes activations the largest term: cp 2 halves each rank's tokens, tp 2 with
    # sequence parallelism halves them again and halves the weights; ZeRO-3 over the 32 data
    # ranks (dp 16 x cp 2) leaves 0.3 GB of gradients and 1.5 GB of optimizer state per GPU.
    from dlab.plan import PlanLayout
    return PlanLayout(dp=16, cp=2, tp=2, zero=3, sequence_parallel=True, micro_batch=1)
