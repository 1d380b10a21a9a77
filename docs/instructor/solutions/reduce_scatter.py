import torch
import torch.distributed as dist


def reduce_scatter(chunks, rank, world_size):
    # Every rank sends chunk c to rank c and adds what the others send for its own chunk.
    # isend first, so that no pair of ranks waits on each other's blocking send.
    sends = [dist.isend(chunks[c], dst=c) for c in range(world_size) if c != rank]
    total = chunks[rank].clone()
    for src in range(world_size):
        if src != rank:
            got = torch.empty_like(chunks[rank])
            dist.recv(got, src=src)
            total += got
    for s in sends:
        s.wait()
    return total
