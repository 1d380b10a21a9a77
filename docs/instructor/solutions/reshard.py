import math

import torch


def reshard(shards, numel, m):
    flat = torch.cat(shards)[:numel]  # the padding of the old cut dropped
    size = math.ceil(numel / m)
    return list(torch.cat([flat, flat.new_zeros(size * m - numel)]).split(size))
