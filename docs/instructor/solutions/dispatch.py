import torch
import torch.distributed as dist


def dispatch(x, expert, n_expert, rank, world_size):
    order = torch.argsort(expert, stable=True)  # rows for each rank now contiguous
    x, expert = x[order], expert[order]
    send = torch.bincount(expert // (n_expert // world_size), minlength=world_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # how many rows each rank will send me
    out_splits, in_splits = recv.tolist(), send.tolist()
    rows = x.new_empty(sum(out_splits), x.shape[1])
    dist.all_to_all_single(rows, x.contiguous(), out_splits, in_splits)
    row_expert = expert.new_empty(sum(out_splits))
    dist.all_to_all_single(row_expert, expert, out_splits, in_splits)
    return rows, row_expert
