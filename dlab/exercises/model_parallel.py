"""The model-parallel exercises: a column-parallel linear with its f and a row-parallel one
with its g (07), and an MoE all-to-all dispatch (09). The row-parallel and dispatch judges count
the collectives the answer's ``dist`` calls go through (an instrumented ``Comm``): g is one
all-reduce, the dispatch one all-to-all of exactly the rows that leave."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dlab.comm.instrumented import Comm
from dlab.exercises.registry import COLLECTIVES, exercise, first_difference


# --- 07: column-parallel linear with its f ------------------------------------------------------
def _linear_inputs():
    g = torch.Generator().manual_seed(6)
    return (torch.randn(3, 4, generator=g), torch.randn(6, 4, generator=g),
            torch.randn(6, generator=g), torch.randn(3, 6, generator=g))


def run_column_parallel(fn, rank, world):
    x, w, b, up = _linear_inputs()
    rows = slice(rank * 6 // world, (rank + 1) * 6 // world)  # this rank's output features
    x = x.clone().requires_grad_()
    y = fn(x, w[rows].clone(), b[rows].clone())
    (y * up[:, rows]).sum().backward()  # the loss's share of this rank's outputs
    return y.detach(), x.grad


@exercise(name="column_parallel_linear", notebook="07_tensor_sequence", ranks=2,
          task="column_parallel_linear(x, w_shard, b_shard): this rank's output features "
               "x @ w_shard.T + b_shard, with x passed through f (identity forward, all-reduce of "
               "the input's gradient backward)",
          run=run_column_parallel)
def judge_column_parallel(answers):
    x, w, b, up = _linear_inputs()
    x.requires_grad_()
    y = x @ w.T + b
    (y * up).sum().backward()
    n = len(answers)
    for r, (got_y, got_dx) in enumerate(answers):
        rows = slice(r * 6 // n, (r + 1) * 6 // n)
        wrong = (first_difference(got_y, y.detach()[:, rows], "output")
                 or first_difference(got_dx, x.grad, "gradient of x (does f all-reduce it?)"))
        if wrong:
            return f"rank {r}, {wrong}"
    return None


# --- 07: row-parallel linear with its g --------------------------------------------------------
def _row_inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(3, 6, generator=g), torch.randn(4, 6, generator=g),
            torch.randn(4, generator=g), torch.randn(3, 4, generator=g))


def run_row_parallel(fn, rank, world):
    y, w, b, up = _row_inputs()
    cols = slice(rank * 6 // world, (rank + 1) * 6 // world)  # this rank's input features
    y_shard = y[:, cols].clone().requires_grad_()
    calls: list = []
    originals = _counted(Comm(None), calls)
    try:
        z = fn(y_shard, w[:, cols].clone(), b.clone())
        forward = len(calls)
        (z * up).sum().backward()
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
    grad = None if y_shard.grad is None else y_shard.grad.clone()
    return z.detach(), grad, [op for op, _, _ in calls[:forward]], [op for op, _, _ in calls[forward:]]


@exercise(name="row_parallel_linear", notebook="07_tensor_sequence", ranks=2,
          task="row_parallel_linear(y_shard, w_shard, b): the whole output y @ w.T + b from this "
               "rank's input features y_shard and the matching columns w_shard of w, through g "
               "(one all-reduce of the partial sums in forward, identity in backward); b added once",
          run=run_row_parallel)
def judge_row_parallel(answers):
    y, w, b, up = _row_inputs()
    y.requires_grad_()
    z = y @ w.T + b
    (z * up).sum().backward()
    n = len(answers)
    for r, (_, _, forward, backward) in enumerate(answers):
        if forward != ["all_reduce"]:
            return (f"rank {r}, forward: the collectives were {forward or 'none'}; g is one "
                    f"all_reduce of the partial sums (y_shard @ w_shard.T), nothing else")
        if backward:
            return (f"rank {r}, backward: the collectives were {backward}; g's backward is the "
                    f"identity (the output's gradient is already whole on every rank)")
    for r, (got_z, got_dy, _, _) in enumerate(answers):
        cols = slice(r * 6 // n, (r + 1) * 6 // n)
        if got_dy is None:  # y_shard cut off from autograd on this rank alone
            return f"rank {r}, gradient of y_shard: none (is y_shard detached?)"
        wrong = (first_difference(got_z, z.detach(), "output (is b added once, after the sum?)")
                 or first_difference(got_dy, y.grad[:, cols], "gradient of y_shard"))
        if wrong:
            return f"rank {r}, {wrong}"
    return None


# --- 09: MoE all-to-all dispatch ----------------------------------------------------------------
N_EXPERT = 4
# dist's data-moving calls the dispatch may make, and how each goes through the counting Comm
# (the others are booked by name, with their payload, and run as they are)
_ROUTED = {
    "all_to_all_single": lambda c, output, input, output_split_sizes=None, input_split_sizes=None,
                                async_op=False, **_: c.all_to_all_single(
                                    output, input, output_split_sizes, input_split_sizes, async_op),
    "all_gather_into_tensor": lambda c, output_tensor, input_tensor, async_op=False, **_:
        c.all_gather_into_tensor(output_tensor, input_tensor, async_op),
    "broadcast": lambda c, tensor, src, async_op=False, **_: c.broadcast(tensor, src, async_op),
    "send": lambda c, tensor, dst, **_: c.send(tensor, dst),
    "recv": lambda c, tensor, src, **_: c.recv(tensor, src),
    "isend": lambda c, tensor, dst, **_: c.isend(tensor, dst),
    "irecv": lambda c, tensor, src, **_: c.irecv(tensor, src),
}
_MOVERS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", *COLLECTIVES)


def _counted(comm, calls: list):
    """Replace dist's data-moving calls by ones that go through ``comm`` and append (op, whether
    the payload is floating point, model bytes sent) to ``calls``; returns the originals.
    Comm's own calls into dist go straight to the originals."""
    inside, originals = [False], {op: getattr(dist, op) for op in _MOVERS if hasattr(dist, op)}

    def wrap(op, original):
        def call(*args, **kwargs):
            if inside[0]:
                return original(*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()), None)
            payload = first
            if op == "all_to_all_single":  # (output, input, ...): what is sent is the input
                payload = args[1] if len(args) > 1 else kwargs.get("input", first)
            floating = bool(getattr(payload, "is_floating_point", lambda: False)())
            inside[0] = True
            try:
                route = _ROUTED.get(op)
                name = {"all_to_all_single": "all_to_all", "isend": "send", "irecv": "recv"}.get(op, op)
                before = comm.stats[name].sent_bytes
                if route is None:
                    comm.record(op, 0, 0, 0)
                    result = original(*args, **kwargs)
                else:
                    result = route(comm, *args, **kwargs)
                calls.append((op, floating, comm.stats[name].sent_bytes - before))
                return result
            finally:
                inside[0] = False
        return call

    for op, original in originals.items():
        setattr(dist, op, wrap(op, original))
    return originals


def _tokens(rank: int):
    g = torch.Generator().manual_seed(90 + rank)
    return torch.randn(6, 2, generator=g), torch.randint(0, N_EXPERT, (6,), generator=g)


def run_dispatch(fn, rank, world):
    x, expert = _tokens(rank)
    calls: list = []
    originals = _counted(Comm(None), calls)
    try:
        rows, row_expert = fn(x, expert, N_EXPERT, rank, world)
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
    return rows, row_expert, calls


@exercise(name="dispatch", notebook="09_expert_parallel", ranks=2,
          task="dispatch(x, expert, n_expert, rank, world_size): send every row of x to the rank "
               "that owns its expert (rank e // (n_expert / world_size)) with one "
               "all_to_all_single for the rows (the counts and the experts may take their own); "
               "return (rows received, their experts), from rank 0's first, each sender's rows "
               "sorted by expert (stable)",
          run=run_dispatch)
def judge_dispatch(answers):
    n = len(answers)
    per = N_EXPERT // n
    for me, answer in enumerate(answers):
        wrong = _dispatch_calls(me, answer[2], per)
        if wrong:
            return f"rank {me}, {wrong}"
    for me, (rows, row_expert, _) in enumerate(answers):
        want_rows, want_experts = [], []
        for src in range(n):
            x, expert = _tokens(src)
            order = torch.argsort(expert, stable=True)
            mine = order[expert[order] // per == me]
            want_rows.append(x[mine])
            want_experts.append(expert[mine])
        wrong = (first_difference(row_expert, torch.cat(want_experts), "experts of the rows received")
                 or first_difference(rows, torch.cat(want_rows), "rows received"))
        if wrong:
            return f"rank {me}, {wrong}"
    return None


def _dispatch_calls(me: int, calls: list, per: int) -> str | None:
    """The property the notebook teaches: the rows travel in one all-to-all, each row once, to
    its owner only (an all-gather or point-to-point sends would move them too, at other cost)."""
    others = sorted({op for op, _, _ in calls if op != "all_to_all_single"})
    if others:
        return (f"moved data with dist.{', dist.'.join(others)}: a dispatch sends every row with "
                f"one all_to_all_single (and the counts with another), nothing else")
    payload = [sent for op, floating, sent in calls if floating]
    if len(payload) != 1:
        return (f"sent the rows in {len(payload)} all_to_all_single calls of floating-point data, "
                f"expected one (each row goes out once, in one collective)")
    x, expert = _tokens(me)
    leaving = int((expert // per != me).sum()) * x.shape[1] * x.element_size()
    if payload[0] != leaving:
        return (f"the rows' all-to-all sent {payload[0]:g} bytes, expected {leaving} (the rows whose "
                f"expert lives on another rank, each sent once)")
    return None
