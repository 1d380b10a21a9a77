"""The data-parallel exercises: a gradient average and a bucketed DDP that overlaps backward
(04), a ZeRO-1 step and a ZeRO-3 forward that gathers and frees (05). The judges watch the
collectives each answer calls: DDP's buckets and when they start, ZeRO-1's reduce-scatter and
all-gather, the gathered parameters ZeRO-3 holds at once."""
from __future__ import annotations

import time
import weakref

import torch

from dlab.exercises.registry import exercise, first_difference
from dlab.exercises.watch import flat, log_collectives, outermost, per_rank, values
from dlab.theory.data_parallel import bucket_sizes


# --- 04: data parallelism: average the gradients ------------------------------------------------
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
          run=run_bucketed_ddp, watch=log_collectives)
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
        # overlap is an all-reduce still pending while backward goes on: one not waited for
        # before the next bucket's launch or the end of backward (read in program order, so
        # the verdict does not depend on how fast the machine is)
        launches = [c["t"] for c in reduces[1:]] + [backward_end]
        if all(c.get("waited", float("inf")) < min(nxt, backward_end)
               for c, nxt in zip(reduces, launches) if c["t"] < backward_end):
            return (f"rank {r} waited for each all-reduce in the hook that started it: backward "
                    f"stops there until the bucket is reduced, so nothing overlaps; keep the "
                    f"handles and wait for them in finish()")
    return None


# --- 05: a ZeRO-1 step --------------------------------------------------------------------------
LR = 0.1
ZERO_NUMEL = 8
def run_zero1_step(fn, rank, world):
    params = values(0, ZERO_NUMEL, seed=4)  # the same replica everywhere
    return fn(params.clone(), values(rank, ZERO_NUMEL, seed=5), LR, rank, world)


@exercise(name="zero1_step", notebook="05_zero_fsdp", ranks=2,
          task="zero1_step(params, grads, lr, rank, world_size): reduce-scatter the gradients "
               "(mean over ranks), SGD-update only this rank's 1/N shard, all-gather the "
               "parameters; return the full updated parameters",
          run=run_zero1_step, watch=log_collectives)
def judge_zero1_step(answers):
    n = len(answers)
    mean = sum(values(r, ZERO_NUMEL, seed=5) for r in range(n)) / n
    want = values(0, ZERO_NUMEL, seed=4) - LR * mean
    wrong = per_rank([a for a, _ in answers], [want] * n, "the updated parameters")
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
        if flat(rs["out"]).numel() != shard or ag["in_numel"] != shard:
            return (f"rank {r}: the reduce-scatter wrote {flat(rs['out']).numel()} elements and "
                    f"the all-gather took {ag['in_numel']}; each should be this rank's shard, "
                    f"{ZERO_NUMEL} / {n} = {shard}")
        wrong = first_difference(flat(ag["out"]), want, "what the all-gather gathered")
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
    factory = outermost(on_call)
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
        for layer in layers:
            x = z3_layer(layer, x)
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
