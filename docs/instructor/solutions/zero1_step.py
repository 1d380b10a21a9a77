import torch
import torch.distributed as dist


def zero1_step(params, grads, lr, rank, world_size):
    shard = params.numel() // world_size
    mine = torch.empty(shard)
    dist.reduce_scatter_tensor(mine, grads)  # the sum of every rank's gradient, my shard only
    mine /= world_size
    own = params[rank * shard:(rank + 1) * shard] - lr * mine  # my optimizer state's shard
    out = torch.empty_like(params)
    dist.all_gather_into_tensor(out, own)  # everyone's updated shard
    return out
