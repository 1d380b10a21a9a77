import math


def mesh_groups(dims, dim):
    import itertools
    names, sizes = list(dims), list(dims.values())
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]  # row-major, last fastest
    k = names.index(dim)
    others = [range(s) if i != k else [0] for i, s in enumerate(sizes)]
    groups = []
    for coords in itertools.product(*others):
        base = sum(c * st for c, st in zip(coords, strides))
        groups.append([base + j * strides[k] for j in range(sizes[k])])
    return sorted(groups)
