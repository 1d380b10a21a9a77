import torch
import torch.distributed as dist


def zero3_forward(shards, x, layer, rank, world_size):
    # ZeRO-3 (Rajbhandari et al. 2020, sec. 5.3): a layer's parameters exist whole only while
    # it runs; the peak is one layer's gathered parameters, not the model's.
    for shard in shards:
        full = torch.empty(shard.numel() * world_size)
        dist.all_gather_into_tensor(full, shard)  # every rank's 1/N, in rank order
        x = layer(full, x)
        del full  # the last reference: the gathered parameters are freed here
    return x
