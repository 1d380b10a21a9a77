def one_f_one_b(stage, n_stages, microbatches):
    warm = min(n_stages - stage - 1, microbatches)  # forwards in flight before the first backward
    order = [("F", i) for i in range(warm)]
    for i in range(microbatches - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(microbatches - warm, microbatches)]
