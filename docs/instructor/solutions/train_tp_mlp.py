import torch


def train_tp_mlp(params, batches, lr, rank, world_size):
    n = params["w1"].shape[0] // world_size
    mine = slice(rank * n, (rank + 1) * n)  # this rank's hidden units: rows of w1, columns of w2
    held = {"w0": params["w0"], "w1": params["w1"][mine], "b1": params["b1"][mine],
            "w2": params["w2"][:, mine], "b2": params["b2"]}
    held = {k: v.clone().requires_grad_() for k, v in held.items()}
    losses = []
    for x, y in batches:
        h = column_parallel_linear(x @ held["w0"].T, held["w1"], held["b1"])  # f, then my columns
        z = row_parallel_linear(torch.nn.functional.gelu(h), held["w2"], held["b2"])  # g, b2 once
        loss = ((z - y) ** 2).mean()  # the same, whole, on every rank
        loss.backward()  # f's all-reduce gives w0 its whole gradient; no other sum is needed
        with torch.no_grad():
            for p in held.values():
                p -= lr * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in held.items()}
