import torch
import torch.distributed as dist


def ring_all_reduce(x, rank, world_size):
    # Patarasuk and Yuan 2009: N-1 steps of reduce-scatter, N-1 of all-gather, one chunk a step.
    chunks = list(x.tensor_split(world_size))  # views into x, sizes may differ by one
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for step in range(world_size - 1):  # after it, chunk (rank + 1) % N holds the full sum
        send, recv = (rank - step) % world_size, (rank - step - 1) % world_size
        buf = torch.empty_like(chunks[recv])
        req = dist.isend(chunks[send].clone(), dst=right)
        dist.recv(buf, src=left)
        req.wait()
        chunks[recv] += buf
    for step in range(world_size - 1):  # pass the full sums around
        send, recv = (rank + 1 - step) % world_size, (rank - step) % world_size
        buf = torch.empty_like(chunks[recv])
        req = dist.isend(chunks[send].clone(), dst=right)
        dist.recv(buf, src=left)
        req.wait()
        chunks[recv].copy_(buf)
    return x
