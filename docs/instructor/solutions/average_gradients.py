import torch.distributed as dist


def average_gradients(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)  # the sum over the replicas ...
        p.grad /= world_size     # ... divided by N: the gradient of the mean loss
