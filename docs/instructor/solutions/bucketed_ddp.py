import torch
import torch.distributed as dist


def bucketed_ddp(model, bucket_cap_bytes, world_size):
    # Li et al. 2020 (PyTorch DDP), sec. 3.2.3: buckets in the order backward produces the
    # gradients, each all-reduced asynchronously as soon as its last gradient is ready.
    buckets = []
    for p in reversed(list(model.parameters())):
        size = p.numel() * p.element_size()
        if buckets and buckets[-1]["bytes"] + size <= bucket_cap_bytes:
            buckets[-1]["params"].append(p)
            buckets[-1]["bytes"] += size
        else:
            buckets.append({"params": [p], "bytes": size})
    in_flight, ready = [], set()

    def hook(p):
        ready.add(p)
        # launch, in bucket order (every rank must issue the same collectives in the same
        # order), every bucket whose gradients are all ready
        while len(in_flight) < len(buckets) and all(q in ready for q in buckets[len(in_flight)]["params"]):
            params = buckets[len(in_flight)]["params"]
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            in_flight.append((dist.all_reduce(flat, async_op=True), flat, params))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for work, flat, params in in_flight:
            work.wait()
            flat /= world_size  # the sum over the replicas / N: the gradient of the mean loss
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        in_flight.clear()
        ready.clear()

    return finish
