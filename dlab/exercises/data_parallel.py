"""Notebook 04's exercises: a gradient average and a bucketed DDP that overlaps backward. The
judges watch the collectives each answer calls: DDP's buckets and when they start (notebook 05's
sharded exercises are in ``dlab.exercises.zero``)."""
from __future__ import annotations

import time

import torch

from dlab.exercises.registry import exercise, first_difference
from dlab.exercises.watch import log_collectives
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
