"""Every checked exercise (``dlab.exercises``): the checker passes the reference solution in
``docs/instructor/solutions/`` and rejects a typical mistake with a message that says what is
wrong (which rank, which element or step, expected against got)."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import WITHOUT_A_CHECKED_EXERCISE

from dlab.exercises import EXERCISES, check

SOLUTIONS = Path(__file__).resolve().parent.parent / "docs" / "instructor" / "solutions"

MISTAKES = {  # exercise: (a learner's typical wrong answer, what the report must say)
    "roofline_time": (  # compute and memory time added, as if nothing overlapped
        "def roofline_time(flops, nbytes, peak, bandwidth):\n"
        "    compute, memory = flops / peak, nbytes / bandwidth\n"
        "    return compute + memory, 'compute' if compute >= memory else 'memory'\n",
        "the kernel takes the longer of the two, not their sum"),
    "capstone_layout": (  # plain data parallelism: the whole model state on every GPU
        "def capstone_layout():\n"
        "    from dlab.plan import PlanLayout\n"
        "    return PlanLayout(dp=32, recompute='full', precision='bf16-fp32-grads')\n",
        "model state dominates; shard it"),
    "mixed_precision_step": (  # the update added to the fp16 weight: no fp32 master
        "def mixed_precision_step(master, grad16, scale, lr):\n"
        "    grad = grad16.float() / scale\n"
        "    if not torch.isfinite(grad).all():\n        return master, master.half(), False\n"
        "    weight16 = master.half() - lr * grad.half()\n"
        "    return weight16.float(), weight16, True\n",
        "rounded away: add it to the fp32 master"),
    "activation_bytes": (  # every term divided by t, sequence parallel or not
        "def activation_bytes(s, b, h, a, t, sp, recompute):\n"
        "    sbh = s * b * h\n"
        "    if recompute == 'full':\n        return 2 * sbh / t\n"
        "    core = 0 if recompute == 'selective' else 5 * a * s * s * b\n"
        "    return (34 * sbh + core) / t\n",
        "without sequence parallelism the 10 s b h"),
    "reduce_scatter": ("def reduce_scatter(chunks, rank, world_size):\n"
                       "    out = torch.empty_like(chunks[rank])\n"
                       "    dist.reduce_scatter(out, chunks)\n    return out\n",
                       "raised RuntimeError: dist.reduce_scatter is off limits"),
    "ring_all_reduce": (  # a gather to rank 0, which sums and sends back: right sums, no ring
        "def ring_all_reduce(x, rank, world_size):\n"
        "    if rank != 0:\n        dist.send(x, dst=0)\n        dist.recv(x, src=0)\n        return x\n"
        "    buf = torch.empty_like(x)\n"
        "    for r in range(1, world_size):\n        dist.recv(buf, src=r)\n        x += buf\n"
        "    for r in range(1, world_size):\n        dist.send(x, dst=r)\n    return x\n",
        "rank 0 sent 120 bytes; a ring all-reduce sends 2(N-1)/N x S = 60 bytes"),
    "average_gradients": ("def average_gradients(model, world_size):\n"
                          "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n",
                          "rank 0, gradient of 0.weight: element (0, 0): expected"),
    "zero1_step": (  # all-reduce and a full update: the right numbers, data parallelism
        "def zero1_step(params, grads, lr, rank, world_size):\n"
        "    dist.all_reduce(grads)\n    return params - lr * grads / world_size\n",
        "rank 0 all-reduced: every rank then holds the whole gradient"),
    "train_zero1": (  # every rank trains on the whole global batch: right numbers, nothing parallel
        "def train_zero1(model, batches, lr, rank, world_size):\n"
        "    params, losses = list(model.parameters()), []\n"
        "    for x, y in batches:\n        model.zero_grad(set_to_none=True)\n"
        "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        loss.backward()\n        losses.append(loss.item())\n"
        "        with torch.no_grad():\n"
        "            new = zero1_step(torch.cat([p.reshape(-1) for p in params]),\n"
        "                             torch.cat([p.grad.reshape(-1) for p in params]),\n"
        "                             lr, rank, world_size)\n"
        "            for p, part in zip(params, new.split([p.numel() for p in params])):\n"
        "                p.copy_(part.view_as(p))\n"
        "    return losses\n",
        "rank 0, step 0: the model's forward took all 8 rows of the global batch"),
    "bucketed_ddp": (  # every bucket reduced after backward, from finish(): nothing overlaps
        "def bucketed_ddp(model, bucket_cap_bytes, world_size):\n"
        "    params = list(model.parameters())[::-1]\n    buckets = [[params[0]]]\n"
        "    for p in params[1:]:\n"
        "        if sum(q.numel() * 4 for q in buckets[-1]) + p.numel() * 4 <= bucket_cap_bytes:\n"
        "            buckets[-1].append(p)\n        else:\n            buckets.append([p])\n"
        "    def finish():\n        for b in buckets:\n"
        "            flat = torch.cat([q.grad.reshape(-1) for q in b])\n"
        "            dist.all_reduce(flat, async_op=True).wait()\n            flat /= world_size\n"
        "            for q, g in zip(b, flat.split([q.numel() for q in b])):\n"
        "                q.grad.copy_(g.view_as(q))\n"
        "    return finish\n",
        "rank 0 started its first all-reduce after backward had finished"),
    "zero3_forward": (  # every layer gathered first: the whole model held at once
        "def zero3_forward(shards, x, layer, rank, world_size):\n"
        "    fulls = []\n    for s in shards:\n"
        "        fulls.append(torch.empty(s.numel() * world_size))\n"
        "        dist.all_gather_into_tensor(fulls[-1], s)\n"
        "    for full in fulls:\n        x = layer(full, x)\n    return x\n",
        "rank 0 held 504 bytes of gathered parameters at once, 3 layers"),
    "one_f_one_b": ("def one_f_one_b(stage, n_stages, microbatches):\n"  # GPipe's order
                    "    return [('F', i) for i in range(microbatches)] + "
                    "[('B', i) for i in range(microbatches)]\n",
                    "4 stages, 6 micro-batches, stage 0: after action 4 (F4) it holds 5 "
                    "micro-batches' activations; 1F1B holds at most min(p - s, m) = 4"),
    "column_parallel_linear": ("def column_parallel_linear(x, w_shard, b_shard):\n"
                               "    return x @ w_shard.T + b_shard\n",  # f forgotten
                               "rank 0, gradient of x (does f all-reduce it?): element (0, 0)"),
    "row_parallel_linear": (  # the bias added on every rank before the sum: t times b
        "class G(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n"
        "        x = x.clone()\n        dist.all_reduce(x)\n        return x\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        return grad\n\n"
        "def row_parallel_linear(y_shard, w_shard, b):\n"
        "    return G.apply(y_shard @ w_shard.T + b)\n",
        "rank 0, output (is b added once, after the sum?): element (0, 0)"),
    "reshard": ("def reshard(shards, numel, m):\n"  # cut without padding
                "    return list(torch.cat(shards)[:numel].chunk(m))\n",
                "10 elements from 4 to 3 shards, shard 2: shape (2,), expected (4,)"),
    "merge": ("def merge(o1, lse1, o2, lse2):\n"
              "    return (o1 + o2) / 2, torch.logaddexp(lse1, lse2)\n", "output: element (0, 0)"),
    "dispatch": ("def dispatch(x, expert, n_expert, rank, world_size):\n"  # rows not sorted
                 "    send = torch.bincount(expert // (n_expert // world_size), minlength=world_size)\n"
                 "    recv = torch.empty_like(send)\n    dist.all_to_all_single(recv, send)\n"
                 "    rows = x.new_empty(int(recv.sum()), x.shape[1])\n"
                 "    dist.all_to_all_single(rows, x, recv.tolist(), send.tolist())\n"
                 "    row_expert = expert.new_empty(int(recv.sum()))\n"
                 "    dist.all_to_all_single(row_expert, expert, recv.tolist(), send.tolist())\n"
                 "    return rows, row_expert\n", "experts of the rows received: element"),
    "mesh_groups": ("def mesh_groups(dims, dim):\n"  # the first dimension taken as the fastest
                    "    import itertools\n    names, sizes = list(dims), list(dims.values())\n"
                    "    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]\n"
                    "    k = names.index(dim)\n"
                    "    others = [range(s) if i != k else [0] for i, s in enumerate(sizes)]\n"
                    "    return sorted([sum(c * st for c, st in zip(cs, strides)) + j * strides[k]"
                    " for j in range(sizes[k])] for cs in itertools.product(*others))\n",
                    "mesh {'dp': 2, 'tp': 2}, groups along 'tp': expected [[0, 1], [2, 3]], got"),
    "topk_feedback": ("def topk_feedback(grad, error, k):\n"  # no memory: the rest is lost
                      "    idx = grad.abs().topk(k).indices\n"
                      "    return grad[idx], idx, torch.zeros_like(grad)\n",
                      "step 0, the new memory: element"),
    "gang_admit": ("def gang_admit(queue, free, running, backfill):\n"  # any job that fits: first fit
                   "    started = []\n"
                   "    for name, gpus, hours in queue:\n"
                   "        if gpus <= free:\n            started.append(name)\n"
                   "            free -= gpus\n"
                   "    return started\n",
                   "job C started ahead of job B, which waits for 4 GPUs: without backfill the "
                   "first job that does not fit holds the line"),
    # the assembled exercises (their pieces, the reference's, go with them: ``with_pieces``)
    "train_tp_mlp": (  # GeLU moved after the row-parallel sum
        "def train_tp_mlp(params, batches, lr, rank, world_size):\n"
        "    n = params['w1'].shape[0] // world_size\n    mine = slice(rank * n, (rank + 1) * n)\n"
        "    held = {'w0': params['w0'], 'w1': params['w1'][mine], 'b1': params['b1'][mine],\n"
        "            'w2': params['w2'][:, mine], 'b2': params['b2']}\n"
        "    held = {k: v.clone().requires_grad_() for k, v in held.items()}\n"
        "    losses = []\n    for x, y in batches:\n"
        "        h = column_parallel_linear(x @ held['w0'].T, held['w1'], held['b1'])\n"
        "        z = torch.nn.functional.gelu(row_parallel_linear(h, held['w2'], held['b2']))\n"
        "        loss = ((z - y) ** 2).mean()\n        loss.backward()\n"
        "        with torch.no_grad():\n            for p in held.values():\n"
        "                p -= lr * p.grad\n                p.grad = None\n"
        "        losses.append(loss.item())\n"
        "    return losses, {k: v.detach() for k, v in held.items()}\n",
        "rank 0, step 0's loss: expected 1.96503, got 1.70279: GeLU applied after the "
        "row-parallel sum"),
    "train_pipeline_1f1b": (  # each micro-batch's loss not divided by their number
        "def train_pipeline_1f1b(part, stage, batches, microbatches, act_shape, lr):\n"
        "    losses = []\n    for x, y in batches:\n"
        "        xs, ys = x.chunk(microbatches), y.chunk(microbatches)\n"
        "        kept, sends, total = {}, [], 0.0\n"
        "        for kind, i in one_f_one_b(stage, 2, microbatches):\n"
        "            if kind == 'F' and stage == 0:\n"
        "                out = part(xs[i])\n"
        "                sends.append(dist.isend(out.detach(), dst=1))\n"
        "                kept[i] = out\n"
        "            elif kind == 'F':\n"
        "                act = torch.empty(act_shape)\n                dist.recv(act, src=0)\n"
        "                act.requires_grad_()\n"
        "                loss = ((part(act) - ys[i]) ** 2).mean()\n"
        "                kept[i] = (act, loss)\n                total += loss.item()\n"
        "            elif stage == 0:\n"
        "                grad = torch.empty(act_shape)\n                dist.recv(grad, src=1)\n"
        "                kept.pop(i).backward(grad)\n"
        "            else:\n"
        "                act, loss = kept.pop(i)\n                loss.backward()\n"
        "                sends.append(dist.isend(act.grad, dst=0))\n"
        "        for work in sends:\n            work.wait()\n"
        "        with torch.no_grad():\n            for p in part.parameters():\n"
        "                p -= lr * p.grad\n                p.grad = None\n"
        "        losses.append(total)\n"
        "    return losses\n",
        "step 0's loss: expected 0.798305, got 3.19322, 4 times the batch's mean: divide each "
        "micro-batch's loss by the number of micro-batches (4)"),
}


def with_pieces(name: str, source: str) -> str:
    """``source`` after the reference solutions of the pieces ``name`` is assembled from (a
    learner passes their own to ``check`` as helpers); ``source`` alone for other exercises."""
    pieces = [(SOLUTIONS / f"{piece}.py").read_text() for piece in EXERCISES[name].pieces]
    return "\n\n".join([*pieces, source])


def solution(name: str) -> str:
    return with_pieces(name, (SOLUTIONS / f"{name}.py").read_text())


# Wrong answers whose results may be right: the checker must fail on the property the notebook
# teaches (how the data moves), and on a mistake made on a non-zero rank only.
PROPERTY_MISTAKES = {  # exercise: [(wrong answer, what the report must say), ...]
    "row_parallel_linear": [
        ("def row_parallel_linear(y_shard, w_shard, b):\n"  # gather everything, one whole matmul
         "    n = dist.get_world_size()\n"
         "    ys = [torch.empty_like(y_shard) for _ in range(n)]\n"
         "    ws = [torch.empty_like(w_shard) for _ in range(n)]\n"
         "    dist.all_gather(ys, y_shard.detach())\n    dist.all_gather(ws, w_shard)\n"
         "    ys[dist.get_rank()] = y_shard\n"
         "    return torch.cat(ys, 1) @ torch.cat(ws, 1).T + b\n",
         "rank 0, forward: the collectives were ['all_gather', 'all_gather']; g is one all_reduce"),
        ("class G(torch.autograd.Function):\n"  # g's backward all-reduces too: f and g confused
         "    @staticmethod\n    def forward(ctx, x):\n"
         "        x = x.clone()\n        dist.all_reduce(x)\n        return x\n"
         "    @staticmethod\n    def backward(ctx, grad):\n"
         "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n\n"
         "def row_parallel_linear(y_shard, w_shard, b):\n"
         "    return G.apply(y_shard @ w_shard.T) + b\n",
         "rank 0, backward: the collectives were ['all_reduce']"),
        ("class G(torch.autograd.Function):\n"  # rank 1 cuts its input off from autograd
         "    @staticmethod\n    def forward(ctx, x):\n"
         "        x = x.clone()\n        dist.all_reduce(x)\n        return x\n"
         "    @staticmethod\n    def backward(ctx, grad):\n        return grad\n\n"
         "def row_parallel_linear(y_shard, w_shard, b):\n"
         "    y = y_shard if dist.get_rank() == 0 else y_shard.detach()\n"
         "    return G.apply(y @ w_shard.T) + b\n",
         "rank 1 raised RuntimeError: element 0 of tensors does not require grad"),
    ],
    "dispatch": [
        ("def dispatch(x, expert, n_expert, rank, world_size):\n"  # everything to everyone
         "    xs = [torch.empty_like(x) for _ in range(world_size)]\n"
         "    es = [torch.empty_like(expert) for _ in range(world_size)]\n"
         "    dist.all_gather(xs, x)\n    dist.all_gather(es, expert)\n"
         "    rows, exps, per = [], [], n_expert // world_size\n"
         "    for xx, ee in zip(xs, es):\n"
         "        order = torch.argsort(ee, stable=True)\n"
         "        mine = order[ee[order] // per == rank]\n"
         "        rows.append(xx[mine])\n        exps.append(ee[mine])\n"
         "    return torch.cat(rows), torch.cat(exps)\n",
         "rank 0, moved data with dist.all_gather"),
        ("def dispatch(x, expert, n_expert, rank, world_size):\n"  # point to point, in turn
         "    order = torch.argsort(expert, stable=True)\n"
         "    x, expert = x[order], expert[order]\n"
         "    owner = expert // (n_expert // world_size)\n"
         "    rows, exps = [], []\n"
         "    for src in range(world_size):\n"
         "        if src == rank:\n"
         "            for dst in range(world_size):\n"
         "                if dst != rank:\n"
         "                    mine = owner == dst\n"
         "                    dist.send(mine.sum().reshape(1), dst)\n"
         "                    dist.send(x[mine].contiguous(), dst)\n"
         "                    dist.send(expert[mine].contiguous(), dst)\n"
         "            rows.append(x[owner == rank])\n            exps.append(expert[owner == rank])\n"
         "        else:\n"
         "            n = torch.zeros(1, dtype=torch.long)\n            dist.recv(n, src)\n"
         "            r, e = x.new_empty(int(n), x.shape[1]), expert.new_empty(int(n))\n"
         "            dist.recv(r, src)\n            dist.recv(e, src)\n"
         "            rows.append(r)\n            exps.append(e)\n"
         "    return torch.cat(rows), torch.cat(exps)\n",
         "rank 0, moved data with dist.recv, dist.send"),
        ("def dispatch(x, expert, n_expert, rank, world_size):\n"  # every row to every rank
         "    per = n_expert // world_size\n"
         "    rows = x.new_empty(world_size * len(x), x.shape[1])\n"
         "    dist.all_to_all_single(rows, x.repeat(world_size, 1))\n"
         "    exps = expert.new_empty(world_size * len(expert))\n"
         "    dist.all_to_all_single(exps, expert.repeat(world_size))\n"
         "    out_rows, out_exps = [], []\n"
         "    for xx, ee in zip(rows.chunk(world_size), exps.chunk(world_size)):\n"
         "        order = torch.argsort(ee, stable=True)\n"
         "        mine = order[ee[order] // per == rank]\n"
         "        out_rows.append(xx[mine])\n        out_exps.append(ee[mine])\n"
         "    return torch.cat(out_rows), torch.cat(out_exps)\n",
         "rank 0, the rows' all-to-all sent 48 bytes, expected"),
        ("def dispatch(x, expert, n_expert, rank, world_size):\n"  # rank 1 does not sort
         "    if rank == 0:\n"
         "        order = torch.argsort(expert, stable=True)\n"
         "        x, expert = x[order], expert[order]\n"
         "    send = torch.bincount(expert // (n_expert // world_size), minlength=world_size)\n"
         "    recv = torch.empty_like(send)\n    dist.all_to_all_single(recv, send)\n"
         "    rows = x.new_empty(int(recv.sum()), x.shape[1])\n"
         "    dist.all_to_all_single(rows, x, recv.tolist(), send.tolist())\n"
         "    row_expert = expert.new_empty(int(recv.sum()))\n"
         "    dist.all_to_all_single(row_expert, expert, recv.tolist(), send.tolist())\n"
         "    return rows, row_expert\n", "experts of the rows received: element"),
    ],
    "bucketed_ddp": [
        ("def bucketed_ddp(model, bucket_cap_bytes, world_size):\n"  # a bucket per tensor:
         "    works = []\n"  # the right mean, async, overlapped, but eight messages, not four
         "    def hook(p):\n        works.append((dist.all_reduce(p.grad, async_op=True), p))\n"
         "    for p in model.parameters():\n        p.register_post_accumulate_grad_hook(hook)\n"
         "    def finish():\n        for w, p in works:\n            w.wait()\n"
         "            p.grad /= world_size\n        works.clear()\n"
         "    return finish\n", "rank 0 all-reduced 8 messages of"),
        ("def bucketed_ddp(model, bucket_cap_bytes, world_size):\n"  # right buckets, async, but
         "    params = list(model.parameters())[::-1]\n    buckets = [[params[0]]]\n"  # waited at once
         "    for p in params[1:]:\n"
         "        if sum(q.numel() * 4 for q in buckets[-1]) + p.numel() * 4 <= bucket_cap_bytes:\n"
         "            buckets[-1].append(p)\n        else:\n            buckets.append([p])\n"
         "    ready = set()\n    def hook(p):\n        ready.add(id(p))\n        for b in buckets:\n"
         "            if id(p) in {id(q) for q in b} and all(id(q) in ready for q in b):\n"
         "                flat = torch.cat([q.grad.reshape(-1) for q in b])\n"
         "                dist.all_reduce(flat, async_op=True).wait()\n"
         "                flat /= world_size\n"
         "                for q, g in zip(b, flat.split([q.numel() for q in b])):\n"
         "                    q.grad.copy_(g.view_as(q))\n"
         "    for p in model.parameters():\n        p.register_post_accumulate_grad_hook(hook)\n"
         "    def finish():\n        ready.clear()\n"
         "    return finish\n", "rank 0 waited for each all-reduce in the hook that started it"),
    ],
}


# a judge that looks at rank (or stage) 0 alone passes these (#41)
RANK_MISTAKES = {  # exercise: (a mistake whose rank 0 is right, what the report must say)
    "one_f_one_b": ("def one_f_one_b(stage, n_stages, microbatches):\n"  # stage left out
                    "    warm = min(n_stages - 1, microbatches)\n"
                    "    order = [('F', i) for i in range(warm)]\n"
                    "    for i in range(microbatches - warm):\n"
                    "        order += [('F', warm + i), ('B', i)]\n"
                    "    return order + [('B', i) for i in range(microbatches - warm, microbatches)]\n",
                    "4 stages, 6 micro-batches, stage 1: after action 3 (F3) it holds 4"),
    "reduce_scatter": (  # ranks above 0 drop what rank 0 sends them
        "def reduce_scatter(chunks, rank, world_size):\n"
        "    sends = [dist.isend(chunks[c], dst=c) for c in range(world_size) if c != rank]\n"
        "    total = chunks[rank].clone()\n"
        "    for src in range(world_size):\n"
        "        if src != rank:\n"
        "            got = torch.empty_like(chunks[rank])\n            dist.recv(got, src=src)\n"
        "            if rank == 0 or src != 0:\n                total += got\n"
        "    for s in sends:\n        s.wait()\n    return total\n", "rank 1, the reduced chunk"),
    "average_gradients": (  # rank 1 divides by N twice
        "def average_gradients(model, world_size):\n"
        "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n"
        "        p.grad /= world_size if dist.get_rank() == 0 else world_size * world_size\n",
        "rank 1, gradient of 0.weight"),
    "column_parallel_linear": (  # rank 1 adds its bias twice
        "class F(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return x.view_as(x)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n"
        "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n\n"
        "def column_parallel_linear(x, w_shard, b_shard):\n"
        "    b = b_shard if dist.get_rank() == 0 else 2 * b_shard\n"
        "    return F.apply(x) @ w_shard.T + b\n", "rank 1, output"),
    "ring_all_reduce": (  # a reduce to rank 0: only rank 0 holds the sum
        "def ring_all_reduce(x, rank, world_size):\n"
        "    if rank != 0:\n        dist.send(x, dst=0)\n        return x\n"
        "    buf = torch.empty_like(x)\n"
        "    for r in range(1, world_size):\n        dist.recv(buf, src=r)\n        x += buf\n"
        "    return x\n", "rank 1, the sum: element"),
    "zero1_step": (  # the updated shards gathered to rank 0 only
        "def zero1_step(params, grads, lr, rank, world_size):\n"
        "    shard = params.numel() // world_size\n    mine = torch.empty(shard)\n"
        "    dist.reduce_scatter_tensor(mine, grads)\n"
        "    params[rank * shard:(rank + 1) * shard] -= lr * mine / world_size\n"
        "    parts = [torch.empty(shard) for _ in range(world_size)] if rank == 0 else None\n"
        "    dist.gather(params[rank * shard:(rank + 1) * shard].clone(), parts, dst=0)\n"
        "    return torch.cat(parts) if rank == 0 else params\n",
        "rank 1, the updated parameters: element"),
    "bucketed_ddp": (  # each bucket reduced to rank 0, not all-reduced
        "def bucketed_ddp(model, bucket_cap_bytes, world_size):\n"
        "    params = list(model.parameters())\n"
        "    def finish():\n        for p in params:\n"
        "            dist.reduce(p.grad, dst=0)\n            p.grad /= world_size\n"
        "    return finish\n", "rank 1, gradient of"),
    "zero3_forward": (  # rank 1 keeps every gathered layer (a cache meant for its backward)
        "def zero3_forward(shards, x, layer, rank, world_size):\n"
        "    kept = []\n    for s in shards:\n"
        "        full = torch.empty(s.numel() * world_size)\n"
        "        dist.all_gather_into_tensor(full, s)\n        x = layer(full, x)\n"
        "        if rank > 0:\n            kept.append(full)\n"
        "    return x\n", "rank 1 held"),
}


def test_every_exercise_has_a_solution_and_a_mistake():
    assert set(EXERCISES) == set(MISTAKES) == {p.stem for p in SOLUTIONS.glob("*.py")}
    notebooks = {ex.notebook for ex in EXERCISES.values()}
    on_disk = {p.stem for p in (SOLUTIONS.parents[2] / "notebooks").glob("*.ipynb")}
    assert notebooks == on_disk - WITHOUT_A_CHECKED_EXERCISE  # a checked exercise in every other notebook


@pytest.mark.parametrize("name", sorted(RANK_MISTAKES))
def test_the_checker_looks_at_every_rank(name, runs_dir):
    """A mistake that leaves rank 0 right is caught on the rank it breaks."""
    wrong, says = RANK_MISTAKES[name]
    report = check(name, with_pieces(name, wrong), runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_the_checker_passes_the_solution_and_names_the_mistake(name, runs_dir):
    reference = check(name, solution(name), runs_dir=str(runs_dir))
    assert reference.ok, reference
    wrong, says = MISTAKES[name]
    report = check(name, with_pieces(name, wrong), runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report
    if "raised" in says:  # every rank raised: the report names one of them
        assert report.message.startswith("rank "), report


def test_an_unwritten_exercise_says_what_to_write():
    def ring_all_reduce(x, rank, world_size):
        raise NotImplementedError
    report = check("ring_all_reduce", ring_all_reduce)
    assert not report.ok and report.message.startswith("not written yet: ring_all_reduce(x, rank")


SAME_PATH_AS_ANOTHER = {("dispatch", 1)}  # point to point: judged as the all-gather is


@pytest.mark.parametrize("name,case", [
    pytest.param(n, i, marks=[pytest.mark.slow] if (n, i) in SAME_PATH_AS_ANOTHER else [])
    for n, cases in sorted(PROPERTY_MISTAKES.items()) for i in range(len(cases))])
def test_the_checker_fails_a_right_result_reached_the_wrong_way(name, case, runs_dir):
    wrong, says = PROPERTY_MISTAKES[name][case]
    report = check(name, with_pieces(name, wrong), runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report
