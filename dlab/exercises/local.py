"""The exercises that run in the notebook's own process: the 1F1B order (06), resharding a
checkpoint (12), the online-softmax merge (08), a mesh's groups (10), and top-k with error
feedback (13). Each is checked on several cases against dlab's own implementation or a direct
computation."""
from __future__ import annotations

import math

import torch

from dlab.exercises.registry import exercise, first_difference
from dlab.layout import schedules
from dlab.theory import simulate as simulation


# --- 06: the 1F1B order -------------------------------------------------------------------------
def run_one_f_one_b(fn):
    return {(p, m, s): [tuple(a) for a in fn(s, p, m)] for p, m in ((4, 6), (3, 2), (2, 5))
            for s in range(p)}


def _one_f_one_b_problem(p: int, m: int, orders: list[list[tuple]]) -> str | None:
    """What stops the p stages' orders from being a 1F1B schedule, judged by its properties and
    not by one list: every micro-batch's F and B once, B after F (``validate`` also proves the
    lists cannot deadlock); stage s never holds more than min(p - s, m) micro-batches'
    activations (the reason 1F1B exists, Narayanan et al. 2019/2021); and the bubble no larger
    than (p-1)/(m+p-1) at unit times (GPipe's: the memory bound bought without idling more)."""
    where = f"{p} stages, {m} micro-batches"
    for s, got in enumerate(orders):
        bad = next((a for a in got if len(a) != 2 or a[0] not in ("F", "B")
                    or not isinstance(a[1], int) or not 0 <= a[1] < m), None)
        if bad is not None:
            return f"{where}, stage {s}: {bad!r} is not ('F', i) or ('B', i) with 0 <= i < {m}"
        for kind in ("F", "B"):
            mbs = sorted(i for k, i in got if k == kind)
            if mbs != list(range(m)):
                return (f"{where}, stage {s}: expected {kind} of micro-batches 0..{m - 1} once "
                        f"each, got {kind} of {mbs}")
        held = 0
        bound = min(p - s, m)
        for k, (kind, i) in enumerate(got):
            held += 1 if kind == "F" else -1
            if held > bound:
                return (f"{where}, stage {s}: after action {k} ({kind}{i}) it holds {held} "
                        f"micro-batches' activations; 1F1B holds at most min(p - s, m) = {bound} "
                        f"on stage {s} (warm up with p - s - 1 forwards, then alternate)")
    actions = [[(schedules.F if kind == "F" else schedules.B)(s, i) for kind, i in got]
               for s, got in enumerate(orders)]
    plain = tuple(range(p))
    sched = schedules.Schedule("yours", p, m, p, plain, schedules._with_comms(actions, plain))
    try:
        simulation.validate(sched)
    except (ValueError, simulation.DeadlockError) as e:
        return f"{where}: the stages' orders do not run together: {e}"
    idle, best = simulation.bubble(simulation.simulate(sched)), (p - 1) / (m + p - 1)
    if idle > best + 1e-9:
        return (f"{where}: bubble {idle:.3f} at unit times, expected (p-1)/(m+p-1) = {best:.3f}: "
                f"a stage waits where 1F1B keeps it busy (too few warm-up forwards?)")
    return None


@exercise(name="one_f_one_b", notebook="06_pipeline",
          task="one_f_one_b(stage, n_stages, microbatches): this stage's compute order as "
               "('F', i) / ('B', i) pairs: warm-up forwards, one forward one backward, drain",
          run=run_one_f_one_b)
def judge_one_f_one_b(answer):
    for p, m in dict.fromkeys((p, m) for p, m, _ in answer):
        problem = _one_f_one_b_problem(p, m, [answer[(p, m, s)] for s in range(p)])
        if problem:
            return problem
    return None


# --- 07: resharding a flat checkpoint -----------------------------------------------------------
def _flat_cases():
    for numel, n, m in ((10, 4, 3), (12, 3, 4), (7, 2, 5), (9, 4, 2)):
        size = math.ceil(numel / n)
        flat = torch.arange(1.0, numel + 1)
        padded = torch.cat([flat, torch.zeros(size * n - numel)])
        yield numel, m, list(padded.split(size))


def run_reshard(fn):
    return {(numel, len(shards), m): fn(shards, numel, m) for numel, m, shards in _flat_cases()}


@exercise(name="reshard", notebook="12_checkpointing_faults",
          task="reshard(shards, numel, m): the n equal shards of a zero-padded flat tensor of "
               "numel elements, cut again into m equal shards (zero-padded to a multiple of m)",
          run=run_reshard)
def judge_reshard(answer):
    for (numel, n, m), got in answer.items():
        size = math.ceil(numel / m)
        want = list(torch.cat([torch.arange(1.0, numel + 1), torch.zeros(size * m - numel)]).split(size))
        if len(got) != m:
            return f"{numel} elements from {n} to {m} shards: expected {m} shards, got {len(got)}"
        for j, (g, w) in enumerate(zip(got, want)):
            wrong = first_difference(g, w, f"{numel} elements from {n} to {m} shards, shard {j}")
            if wrong:
                return wrong
    return None


# --- 08: the online-softmax merge ---------------------------------------------------------------
def _partial(q, k, v, mask):
    s = (q @ k.T).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - safe[:, None]) @ v, lse


def run_merge(fn):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(6, 3, generator=g) for _ in range(3))
    causal = torch.ones(6, 6).tril().bool()  # query i sees keys 0..i: row 0 sees none of 3..5
    o1, l1 = _partial(q, k[:3], v[:3], causal[:, :3])
    o2, l2 = _partial(q, k[3:], v[3:], causal[:, 3:])
    return fn(o1, l1, o2, l2), (q, k, v, causal)


@exercise(name="merge", notebook="08_context_parallel",
          task="merge(o1, lse1, o2, lse2): the attention output and log-sum-exp over both key "
               "blocks, from each block's partial output and log-sum-exp (lse may be -inf: a row "
               "that sees no key of that block)",
          run=run_merge)
def judge_merge(answer):
    (o, lse), (q, k, v, causal) = answer
    want_o, want_lse = _partial(q, k, v, causal)
    return first_difference(o, want_o, "output") or first_difference(lse, want_lse, "log-sum-exp")


# --- 10: a mesh's groups ------------------------------------------------------------------------
def run_mesh_groups(fn):
    cases = [({"dp": 2, "tp": 2}, "tp"), ({"dp": 2, "tp": 2}, "dp"),
             ({"pp": 2, "dp": 2, "tp": 2}, "dp"), ({"pp": 2, "dp": 3, "cp": 2}, "pp")]
    return {(tuple(d.items()), dim): fn(d, dim) for d, dim in cases}


@exercise(name="mesh_groups", notebook="10_nd_parallelism",
          task="mesh_groups(dims, dim): the groups of ranks along dim of a row-major mesh (the "
               "last dimension fastest), each sorted, the groups ordered by their first rank",
          run=run_mesh_groups)
def judge_mesh_groups(answer):
    for (dims, dim), got in answer.items():
        names = [d for d, _ in dims]
        sizes = dict(dims)
        ranks = torch.arange(math.prod(sizes.values())).view(*sizes.values())
        moved = ranks.movedim(names.index(dim), -1).reshape(-1, sizes[dim])
        want = sorted(row.tolist() for row in moved)
        if sorted(map(list, got)) != want:
            return f"mesh {dict(dims)}, groups along {dim!r}: expected {want}, got {got}"
    return None


# --- 12: top-k with error feedback --------------------------------------------------------------
def run_topk(fn):
    g = torch.Generator().manual_seed(12)
    grads = [torch.randn(10, generator=g) for _ in range(3)]
    error, steps = torch.zeros(10), []
    for grad in grads:  # three steps: the memory carries what was not sent
        values, indices, error = fn(grad, error.clone(), 3)
        steps.append((values, indices, error))
    return grads, steps


@exercise(name="topk_feedback", notebook="13_what_breaks_at_scale",
          task="topk_feedback(grad, error, k): add the memory to the gradient, send the k entries "
               "of largest magnitude as (values, indices), and return them with the new memory "
               "(the sum with those entries zeroed)",
          run=run_topk)
def judge_topk(answer):
    grads, steps = answer
    error = torch.zeros(10)
    for t, (grad, (values, indices, got_error)) in enumerate(zip(grads, steps)):
        acc = grad + error
        want_idx = acc.abs().topk(3).indices
        sent = torch.zeros(10)
        sent[indices.long()] = values
        want_sent = torch.zeros(10)
        want_sent[want_idx] = acc[want_idx]
        error = acc.clone()
        error[want_idx] = 0
        wrong = (first_difference(sent, want_sent, f"step {t}, what is sent (as a dense vector)")
                 or first_difference(got_error, error, f"step {t}, the new memory"))
        if wrong:
            return wrong
    return None
