"""The exercises that run on ranks: collectives from send/recv (02, 03), a data-parallel gradient
average and a bucketed DDP that overlaps backward (04), a ZeRO-1 step and a ZeRO-3 forward that
gathers and frees (05), a column-parallel linear with its f and a row-parallel one with its g
(07), and an MoE all-to-all dispatch (09). Each ``run_*`` makes its inputs from (rank, world)
alone, so the judge, in the notebook's process, rebuilds every rank's inputs and the reference
from them. Where the notebook teaches how the answer communicates, the exercise watches it
(``Exercise.watch``, or an instrumented ``Comm`` the answer's ``dist`` calls go through): the
bytes the ring sends from each rank, the collectives ZeRO-1 calls and what it gathers, DDP's
buckets and when they start, the gathered parameters ZeRO-3 holds at once, g's one all-reduce,
the dispatch's one all-to-all. The reference answer's value alone does not pass those."""
from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from dlab.comm.instrumented import Comm
from dlab.exercises.registry import COLLECTIVES, exercise, first_difference
from dlab.theory.data_parallel import bucket_sizes

WORLD = 4


def _values(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-9, 10, (n,), generator=g).float()


def _per_rank(answers, want, what: str) -> str | None:
    for r, (got, exp) in enumerate(zip(answers, want)):
        wrong = first_difference(got, exp, what)
        if wrong:
            return f"rank {r}, {wrong}"
    return None


# --- watching what an answer calls ------------------------------------------------------------
#: the collectives a watched answer may call, by the name the judges use (torch 2.13's new names too)
_KINDS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
          "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
          "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
          "all_gather_single": "all_gather", "broadcast": "broadcast", "gather": "gather",
          "reduce": "reduce"}


def _flat(t) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in t]) if isinstance(t, (list, tuple)) else t


def _outermost(on_call):
    """A wrapper factory whose wrappers call ``on_call(name, args, kwargs)`` for the learner's
    call only: torch 2.13's old names call the new ones, which are wrapped too."""
    depth = [0]

    def factory(name):
        def wrap(op):
            def watched(*args, **kwargs):
                if not depth[0]:
                    on_call(name, args, kwargs)
                depth[0] += 1
                try:
                    return op(*args, **kwargs)
                finally:
                    depth[0] -= 1
            return watched
        return wrap
    return factory


def _log_collectives(log):
    """Wrap the collectives to log each call: its kind, the elements it took in and, kept as a
    reference (read when the answer has returned, so async ops have finished), what it wrote."""
    log["calls"] = []

    def on_call(name, args, kwargs):
        kind = _KINDS[name]
        out, inp = (args + (None, None))[:2]
        if kind in ("all_reduce", "broadcast", "reduce", "gather"):
            inp = out
        log["calls"].append({"kind": kind, "out": out, "async": bool(kwargs.get("async_op")),
                             "in_numel": 0 if inp is None else _flat(inp).numel(),
                             "t": time.perf_counter()})
    factory = _outermost(on_call)
    return {name: factory(name) for name in _KINDS}


# --- 01: reduce-scatter from send/recv ----------------------------------------------------------
def _chunks(rank: int, world: int) -> list[torch.Tensor]:
    return [_values(rank, 3, seed=10 + c) for c in range(world)]


def run_reduce_scatter(fn, rank, world):
    return fn(_chunks(rank, world), rank, world)


@exercise(name="reduce_scatter", notebook="02_collectives", ranks=WORLD, p2p_only=True,
          task="reduce_scatter(chunks, rank, world_size): chunks[c] is this rank's contribution to "
               "rank c; return the sum over all ranks of their chunk for this rank, with send/recv",
          run=run_reduce_scatter)
def judge_reduce_scatter(answers):
    want = [sum(_chunks(r, WORLD)[me] for r in range(WORLD)) for me in range(WORLD)]
    return _per_rank(answers, want, "the reduced chunk")


# --- 03: ring all-reduce from send/recv ---------------------------------------------------------
RING_NUMEL = 10  # over 4 ranks: chunks of 3, 3, 2 and 2 elements, not all equal


def run_ring_all_reduce(fn, rank, world):
    x = _values(rank, RING_NUMEL, seed=2)
    out = fn(x, rank, world)
    return x if out is None else out


def _count_sent(log):
    """Wrap send and isend (batch_isend_irecv calls them) to add up the bytes this rank sends."""
    log["sent"] = 0

    def counting(send):
        def counted(tensor, *args, **kwargs):
            log["sent"] += tensor.numel() * tensor.element_size()
            return send(tensor, *args, **kwargs)
        return counted
    return {"send": counting, "isend": counting}


@exercise(name="ring_all_reduce", notebook="03_allreduce_algorithms", ranks=WORLD, p2p_only=True,
          task="ring_all_reduce(x, rank, world_size): every rank ends with the sum of all ranks' x "
               "(a reduce-scatter then an all-gather around the ring), with send/recv, each rank "
               "sending 2(N-1)/N of x's bytes",
          run=run_ring_all_reduce, watch=_count_sent)
def judge_ring_all_reduce(answers):
    total = sum(_values(r, RING_NUMEL, seed=2) for r in range(WORLD))
    wrong = _per_rank([a for a, _ in answers], [total] * WORLD, "the sum")
    if wrong:
        return wrong
    # Patarasuk & Yuan 2009: each rank sends one chunk per step, 2(N-1) steps; with chunks of
    # unequal size a rank's bytes lie between 2(N-1) times the smallest and the largest chunk.
    size = 4  # float32
    chunks = [len(c) * size for c in torch.arange(RING_NUMEL).tensor_split(WORLD)]
    s, steps = RING_NUMEL * size, 2 * (WORLD - 1)
    lo, hi = steps * min(chunks), steps * max(chunks)
    for r, (_, log) in enumerate(answers):
        if not lo <= log["sent"] <= hi:
            why = ("more: does one rank gather and send back everything, or send whole tensors?"
                   if log["sent"] > hi else "less: is a half of the ring missing?")
            return (f"rank {r} sent {log['sent']} bytes; a ring all-reduce sends 2(N-1)/N x S = "
                    f"{steps * s / WORLD:g} bytes from every rank (S = {s} bytes, N = {WORLD}; "
                    f"{lo} to {hi} with chunks of unequal size), so the sum is right but this is "
                    f"not the ring, it sends {why}")
    return None


# --- 03: data parallelism: average the gradients ------------------------------------------------
def _replica_and_batch(rank: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    g = torch.Generator().manual_seed(50 + rank)
    return model, torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)


def run_average_gradients(fn, rank, world):
    model, x, y = _replica_and_batch(rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    fn(model, world)
    return [p.grad.clone() for p in model.parameters()]


@exercise(name="average_gradients", notebook="04_data_parallel", ranks=2,
          task="average_gradients(model, world_size): after backward, make every replica's "
               "gradients the mean over the ranks (what DDP does)",
          run=run_average_gradients)
def judge_average_gradients(answers):
    model, _, _ = _replica_and_batch(0)
    batches = [_replica_and_batch(r)[1:] for r in range(len(answers))]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    torch.nn.functional.mse_loss(model(x), y).backward()  # the whole batch in one process
    names = [n for n, _ in model.named_parameters()]
    for r, grads in enumerate(answers):
        for name, got, p in zip(names, grads, model.parameters()):
            wrong = first_difference(got, p.grad, f"gradient of {name}")
            if wrong:
                return f"rank {r}, {wrong} (one process on the whole batch gives the expected)"
    return None


# --- 04: a bucketed DDP whose all-reduces overlap backward -------------------------------------
DDP_CAP = 290  # bytes: four buckets of this model's eight tensors (bucket_sizes)


def _ddp_model_and_batch(rank: int):
    torch.manual_seed(4)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(40 + rank)
    return model, torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


def run_bucketed_ddp(fn, rank, world):
    model, x, y = _ddp_model_and_batch(rank)
    finish = fn(model, DDP_CAP, world)
    torch.nn.functional.mse_loss(model(x), y).backward()
    backward_end = time.perf_counter()
    finish()
    return [p.grad.clone() for p in model.parameters()], backward_end


@exercise(name="bucketed_ddp", notebook="04_data_parallel", ranks=2,
          task="bucketed_ddp(model, bucket_cap_bytes, world_size): cut the parameters, last first, "
               "into buckets of at most bucket_cap_bytes (a tensor that would pass the cap opens a "
               "new bucket); register gradient hooks that start each full bucket's all-reduce "
               "(async) during backward; return finish(), which waits for them and leaves the "
               "mean gradient in every .grad",
          run=run_bucketed_ddp, watch=_log_collectives)
def judge_bucketed_ddp(answers):
    model, _, _ = _ddp_model_and_batch(0)
    batches = [_ddp_model_and_batch(r)[1:] for r in range(len(answers))]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    torch.nn.functional.mse_loss(model(x), y).backward()  # the whole batch in one process
    names = [n for n, _ in model.named_parameters()]
    want = bucket_sizes([p.numel() * p.element_size() for p in model.parameters()], DDP_CAP)
    for r, ((grads, _), _) in enumerate(answers):
        for name, got, p in zip(names, grads, model.parameters()):
            wrong = first_difference(got, p.grad, f"gradient of {name}")
            if wrong:
                return f"rank {r}, {wrong} (one process on the whole batch gives the expected)"
    for r, ((_, backward_end), log) in enumerate(answers):
        reduces = [c for c in log["calls"] if c["kind"] == "all_reduce"]
        others = sorted({c["kind"] for c in log["calls"]} - {"all_reduce"})
        if others:
            return f"rank {r} called {others}: DDP's buckets need one all-reduce each, nothing else"
        sizes = [c["in_numel"] * 4 for c in reduces]
        if sizes != want:
            return (f"rank {r} all-reduced {len(sizes)} messages of {sizes} bytes; with a cap of "
                    f"{DDP_CAP} bytes the parameters, last first, make {len(want)} buckets of "
                    f"{want} bytes: one all-reduce per bucket, in that order")
        if not all(c["async"] for c in reduces):
            return (f"rank {r} called all_reduce without async_op=True: backward stops until each "
                    f"bucket is reduced, so nothing overlaps")
        if reduces[0]["t"] >= backward_end:
            return (f"rank {r} started its first all-reduce after backward had finished: start "
                    f"each bucket's all-reduce from a gradient hook the moment its last gradient "
                    f"is ready, so it overlaps the rest of backward")
    return None


# --- 05: a ZeRO-1 step --------------------------------------------------------------------------
LR = 0.1
ZERO_NUMEL = 8
def run_zero1_step(fn, rank, world):
    params = _values(0, ZERO_NUMEL, seed=4)  # the same replica everywhere
    return fn(params.clone(), _values(rank, ZERO_NUMEL, seed=5), LR, rank, world)


@exercise(name="zero1_step", notebook="05_zero_fsdp", ranks=2,
          task="zero1_step(params, grads, lr, rank, world_size): reduce-scatter the gradients "
               "(mean over ranks), SGD-update only this rank's 1/N shard, all-gather the "
               "parameters; return the full updated parameters",
          run=run_zero1_step, watch=_log_collectives)
def judge_zero1_step(answers):
    n = len(answers)
    mean = sum(_values(r, ZERO_NUMEL, seed=5) for r in range(n)) / n
    want = _values(0, ZERO_NUMEL, seed=4) - LR * mean
    wrong = _per_rank([a for a, _ in answers], [want] * n, "the updated parameters")
    if wrong:
        return wrong
    shard = ZERO_NUMEL // n
    for r, (_, log) in enumerate(answers):
        kinds = [c["kind"] for c in log["calls"]]
        if "all_reduce" in kinds:
            return (f"rank {r} all-reduced: every rank then holds the whole gradient and can "
                    f"update every parameter, which is data parallelism, not ZeRO-1. Reduce-"
                    f"scatter the gradients so that rank r receives only its 1/N shard's sum, "
                    f"update that shard, then all-gather the parameters")
        if kinds != ["reduce_scatter", "all_gather"]:
            return (f"rank {r} called {kinds or 'no collective'}; a ZeRO-1 step calls one "
                    f"reduce-scatter (the gradients) and then one all-gather (the updated shards)")
        rs, ag = log["calls"]
        if _flat(rs["out"]).numel() != shard or ag["in_numel"] != shard:
            return (f"rank {r}: the reduce-scatter wrote {_flat(rs['out']).numel()} elements and "
                    f"the all-gather took {ag['in_numel']}; each should be this rank's shard, "
                    f"{ZERO_NUMEL} / {n} = {shard}")
        wrong = first_difference(_flat(ag["out"]), want, "what the all-gather gathered")
        if wrong:
            return (f"rank {r}, {wrong}: all-gather the updated parameter shards (each rank "
                    f"updates only its own)")
    return None


# --- 05: a ZeRO-3 forward that gathers each layer and frees it ----------------------------------
Z3_LAYERS, Z3_WIDTH = 3, 6


def _z3_model():
    """The full layers' flat parameters (weight then bias, Z3_WIDTH x Z3_WIDTH + Z3_WIDTH each)."""
    g = torch.Generator().manual_seed(33)
    return [torch.randn(Z3_WIDTH * Z3_WIDTH + Z3_WIDTH, generator=g) for _ in range(Z3_LAYERS)]


def z3_layer(flat, x):
    """One layer from its full flat parameters: tanh(x W^T + b)."""
    w = flat[:Z3_WIDTH * Z3_WIDTH].view(Z3_WIDTH, Z3_WIDTH)
    return torch.tanh(x @ w.T + flat[Z3_WIDTH * Z3_WIDTH:])


def _z3_batch(rank):
    return torch.randn(4, Z3_WIDTH, generator=torch.Generator().manual_seed(330 + rank))


def _held_gathers(log):
    """Wrap all-gather to keep, at each call, the bytes of earlier gathered outputs still alive
    (weak references: a freed buffer is gone) plus this one's: the gathered parameters held."""
    log["held"], live = [], []

    def on_call(name, args, kwargs):
        out = args[0]
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        # Gloo's worker thread lets go of the last op's output a moment after the op returns:
        # give a buffer the answer has dropped up to half a second to go
        deadline = time.perf_counter() + 0.5
        while any(r() is not None for r in live) and time.perf_counter() < deadline:
            time.sleep(0.005)
        held = sum(t.numel() * t.element_size() for t in (r() for r in live) if t is not None)
        log["held"].append(held + sum(t.numel() * t.element_size() for t in outs))
        live.extend(weakref.ref(t) for t in outs)
    factory = _outermost(on_call)
    return {name: factory(name) for name in ("all_gather_into_tensor", "all_gather", "all_gather_single")}


def run_zero3_forward(fn, rank, world):
    shards = [flat.chunk(world)[rank].clone() for flat in _z3_model()]
    with torch.no_grad():  # autograd would keep every layer's weights for backward
        return fn(shards, _z3_batch(rank), z3_layer, rank, world)


@exercise(name="zero3_forward", notebook="05_zero_fsdp", ranks=2,
          task="zero3_forward(shards, x, layer, rank, world_size): shards[i] is this rank's 1/N of "
               "layer i's flat parameters; for each layer all-gather its full parameters, apply "
               "layer(full, x), and free them before gathering the next; return the output",
          run=run_zero3_forward, watch=_held_gathers)
def judge_zero3_forward(answers):
    layers = _z3_model()
    for r, (got, _) in enumerate(answers):
        x = _z3_batch(r)
        for flat in layers:
            x = z3_layer(flat, x)
        wrong = first_difference(got, x, "the output")
        if wrong:
            return f"rank {r}, {wrong} (the unsharded model on this rank's batch gives the expected)"
    for r, (_, log) in enumerate(answers):
        one = layers[0].numel() * layers[0].element_size()
        if len(log["held"]) != Z3_LAYERS:
            return (f"rank {r} all-gathered {len(log['held'])} times; ZeRO-3's forward gathers "
                    f"each of the {Z3_LAYERS} layers once")
        if max(log["held"]) > one:
            return (f"rank {r} held {max(log['held'])} bytes of gathered parameters at once, "
                    f"{max(log['held']) / one:g} layers; ZeRO-3 frees a layer's full parameters "
                    f"before it gathers the next, so its peak is one layer's, {one} bytes "
                    f"(drop every reference to the gathered tensor)")
    return None


# --- 06: column-parallel linear with its f ------------------------------------------------------
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
