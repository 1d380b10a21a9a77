import torch


def train_zero1(model, batches, lr, rank, world_size):
    # ZeRO-1 end to end (Rajbhandari et al. 2020, P_os): data parallelism over the rows of each
    # global batch, the gradient averaged and the update applied by zero1_step's reduce-scatter,
    # shard update and all-gather; the flat layout is model.parameters() in order.
    params = list(model.parameters())
    losses = []
    for x, y in batches:
        rows = len(x) // world_size
        mine = slice(rank * rows, (rank + 1) * rows)  # this rank's G/N rows
        for p in params:
            p.grad = None  # backward adds to .grad: start every step from none
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            flat_params = torch.cat([p.reshape(-1) for p in params])
            flat_grads = torch.cat([p.grad.reshape(-1) for p in params])
            new = zero1_step(flat_params, flat_grads, lr, rank, world_size)  # yours, sent with it
            for p, part in zip(params, new.split([p.numel() for p in params])):
                p.copy_(part.view_as(p))  # cut back in the order and shapes it was flattened in
    return losses
