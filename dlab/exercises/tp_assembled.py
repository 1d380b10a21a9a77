"""Notebook 07's assembled exercise, ``train_tp_mlp``: a tensor-parallel MLP block (column-parallel
linear, GeLU, row-parallel linear) from the learner's ``column_parallel_linear`` and
``row_parallel_linear``, trained on 2 ranks against one process (``dlab.exercises.assembly``);
the judge also counts the collectives, by autograd phase: one all-reduce in each forward (g's),
one in each backward (f's), nothing else."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlab.exercises.assembly import LR, RANKS, find_pieces, own_check, run_piece, same
from dlab.exercises.model_parallel import (
    judge_column_parallel,
    judge_row_parallel,
    run_column_parallel,
    run_row_parallel,
)
from dlab.exercises.registry import COLLECTIVES, exercise, first_difference

D, H, BATCH, STEPS = 4, 8, 6, 4  # width, hidden units (cut over the ranks), rows, SGD steps
TP_CALL = ("check('train_tp_mlp', train_tp_mlp, CopyToParallel, column_parallel_linear, "
           "ReduceFromParallel, row_parallel_linear)")
F_NEVER_RAN = ("f's backward never ran, so w0 (the layer before the block) got no gradient "
               "through the block; pass x @ w0.T to your column_parallel_linear as it is (not "
               "detached), every step")
TP_CUT = (f"each rank holds rows r*{H}/t to (r+1)*{H}/t of w1 and b1 (its hidden units), the same "
          f"columns of w2, and w0 and b2 whole")


def tp_inputs():
    """The whole block as one process holds it, and the batches of every step."""
    g = torch.Generator().manual_seed(70)
    params = {"w0": torch.randn(D, D, generator=g) / 2, "w1": torch.randn(H, D, generator=g) / 2,
              "b1": torch.randn(H, generator=g) / 2, "w2": torch.randn(D, H, generator=g) / 2,
              "b2": torch.randn(D, generator=g) / 2}
    batches = [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g))
               for _ in range(STEPS)]
    return params, batches


def train_whole_mlp(variant: str = "") -> tuple[list[float], dict]:
    """One process training the unsharded block (``variant``: a typical mistake's forward)."""
    params, batches = tp_inputs()
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    losses = []
    for x, y in batches:
        h0 = x if variant == "no_w0" else x @ p["w0"].T
        h = h0 @ p["w1"].T + p["b1"]
        if variant == "uncut":  # every rank's whole output added by g: t times the product
            z = RANKS * (F.gelu(h) @ p["w2"].T) + p["b2"]
        elif variant == "b2_every_rank":  # before the sum on every rank, or again after it
            z = F.gelu(h) @ p["w2"].T + RANKS * p["b2"]
        elif variant in ("gelu_after", "gelu_twice"):
            inner = F.gelu(h) if variant == "gelu_twice" else h
            z = F.gelu(inner @ p["w2"].T + p["b2"])
        elif variant == "no_gelu":
            z = h @ p["w2"].T + p["b2"]
        else:
            z = F.gelu(h) @ p["w2"].T + p["b2"]
        loss = ((z - y) ** 2).sum() if variant == "sum_loss" else ((z - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for t in p.values():
                if t.grad is not None:
                    t -= LR * t.grad
                    t.grad = None
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in p.items()}


def tp_cut(params: dict, rank: int, world: int) -> dict:
    mine = slice(rank * H // world, (rank + 1) * H // world)
    return {"w0": params["w0"], "w1": params["w1"][mine], "b1": params["b1"][mine],
            "w2": params["w2"][:, mine], "b2": params["b2"]}


def _phase_logged(calls: list) -> dict:
    """Wrap dist's data-moving calls to log (in backward?, op, payload shape) for the learner's
    own calls (not those a wrapped call makes); returns the originals."""
    depth = [0]
    originals = {op: getattr(dist, op) for op in (*COLLECTIVES, "send", "recv", "isend", "irecv")
                 if hasattr(dist, op)}

    def wrap(op, original):
        def call(*args, **kwargs):
            if not depth[0]:
                first = args[0] if args else next(iter(kwargs.values()), None)
                shape = tuple(first.shape) if isinstance(first, torch.Tensor) else None
                calls.append((torch._C._current_graph_task_id() != -1, op, shape))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for op, original in originals.items():
        setattr(dist, op, wrap(op, original))
    return originals


def run_train_tp_mlp(fn, rank, world):
    pieces, missing = find_pieces(fn, ("column_parallel_linear", "row_parallel_linear"), TP_CALL)
    if missing:
        return {"missing": missing}
    own = {name: run_piece(name, run, pieces[name], rank, world)
           for name, run in (("column_parallel_linear", run_column_parallel),
                             ("row_parallel_linear", run_row_parallel))}
    every: list = [None] * world
    dist.all_gather_object(every, own)  # each piece judged on every rank, so all skip alike
    for name, judge in (("column_parallel_linear", judge_column_parallel),
                        ("row_parallel_linear", judge_row_parallel)):
        wrong = own_check(name, judge([o[name] for o in every]))
        if wrong:
            return {"pieces": wrong}  # trained with a wrong piece, the block would say less
    params, batches = tp_inputs()
    calls: list = []
    originals = _phase_logged(calls)
    try:
        out = fn({k: v.clone() for k, v in params.items()}, batches, LR, rank, world)
    except (RuntimeError, TypeError, ValueError) as e:
        hint = _tp_hint(str(e), calls)
        if hint:
            raise type(e)(f"{e} ({hint})") from e
        raise
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
    answer = {"calls": calls}
    try:
        losses, shards = out
        answer["losses"] = [float(x) for x in losses]
        answer["shards"] = {k: torch.as_tensor(shards[k]).detach().clone() for k in params}
    except (TypeError, ValueError, KeyError) as e:
        answer["returned"] = (f"returned {type(out).__name__}, expected (losses, shards): the "
                              f"loss of every step and a dict of this rank's final w0, w1, b1, "
                              f"w2, b2 ({type(e).__name__}: {e})")
    return answer


@exercise(name="train_tp_mlp", notebook="07_tensor_sequence", ranks=RANKS,
          pieces=("column_parallel_linear", "row_parallel_linear"),
          task="train_tp_mlp(params, batches, lr, rank, world_size): train the block "
               "z = gelu((x @ w0.T) @ w1.T + b1) @ w2.T + b2 with plain SGD on loss "
               "((z - y) ** 2).mean() for every (x, y) in batches, tensor-parallel: w1, b1 and w2 "
               "cut over the ranks (rows of w1 and b1, the same columns of w2), through your "
               "column_parallel_linear and row_parallel_linear; return (the loss of every step, "
               "{'w0', 'w1', 'b1', 'w2', 'b2': this rank's final tensors})",
          run=run_train_tp_mlp)
def judge_train_tp_mlp(answers):
    if "missing" in answers[0]:
        return answers[0]["missing"]
    if "pieces" in answers[0]:
        return answers[0]["pieces"]
    for r, a in enumerate(answers):
        if "returned" in a:
            return f"rank {r} {a['returned']}"
    for r, a in enumerate(answers):
        wrong = _tp_calls(a["calls"])
        if wrong:
            return f"rank {r}, {wrong}"
    want, final = train_whole_mlp()
    params, _ = tp_inputs()
    n = len(answers)
    # the earliest step that goes wrong, on whichever rank (a rank's own mistake spreads to
    # the others' later steps through f and g)
    wrong_losses = sorted((-1 if step is None else step, r, wrong) for r, a in enumerate(answers)
                          for step, wrong in [_tp_losses(a["losses"], want)] if wrong)
    if wrong_losses:
        step, r, wrong = wrong_losses[0]
        if step > 0:  # the forward was right: a tensor left out of the update says most
            shards = answers[r]["shards"]
            wrong = _unchanged(shards, tp_cut(params, r, n), tp_cut(final, r, n)) or wrong
        return f"rank {r}, {wrong}"
    for r, a in enumerate(answers):
        start, end = tp_cut(params, r, n), tp_cut(final, r, n)
        wrong = _unchanged(a["shards"], start, end)
        if wrong:
            return f"rank {r}, {wrong}"
        for k, got in a["shards"].items():
            wrong = first_difference(got, end[k], f"final {k} ({_held(k, r, n)})")
            if wrong:
                return f"rank {r}, {wrong}"
    return None


def _unchanged(shards: dict, start: dict, end: dict) -> str | None:
    for k, got in shards.items():
        if same(got, start[k]) and not same(end[k], start[k]):
            return (f"{k} never changed: update every tensor the rank holds, {k} too "
                    f"({'its gradient comes whole from f' if k == 'w0' else 'p -= lr * p.grad'})")
    return None


def _tp_hint(error: str, calls: list) -> str | None:
    """What to change, for an error the learner's block raised that says it."""
    if "shape" in error or "size of tensor" in error:
        return f"{TP_CUT}; nn.Linear stores a weight as [out, in]"
    if "NoneType" in error and not any(inside for inside, _, _ in calls):
        return f"a gradient is None, and no all-reduce ran in backward: {F_NEVER_RAN}"
    if "NoneType" in error:
        return "a gradient is None: every tensor the rank holds takes part in the forward"
    return None


def _held(name: str, rank: int, world: int) -> str:
    lo, hi = rank * H // world, (rank + 1) * H // world
    return {"w1": f"rows {lo}..{hi - 1} of w1", "b1": f"elements {lo}..{hi - 1} of b1",
            "w2": f"columns {lo}..{hi - 1} of w2"}.get(name, f"{name}, whole on every rank")


def _tp_calls(calls: list) -> str | None:
    """One all-reduce in each forward (g's, of the partial sums) and one in each backward (f's,
    of the block input's gradient), nothing else."""
    other = sorted({op for _, op, _ in calls if op != "all_reduce"})
    if other:
        return (f"called dist.{', dist.'.join(other)}: the block communicates through f and g "
                f"alone (your column_parallel_linear and row_parallel_linear)")
    backward = [shape for inside, _, shape in calls if inside]
    outside = [shape for inside, _, shape in calls if not inside]
    if not backward:
        return f"no all-reduce in backward over {STEPS} steps: {F_NEVER_RAN}"
    if len(backward) > STEPS:
        return (f"{len(backward)} all-reduces in backward over {STEPS} steps, expected one per "
                f"step (f's): is the block's input passed through f more than once?")
    extra = [s for s in outside if s != (BATCH, D)]
    if extra:
        return (f"all-reduced a tensor of shape {extra[0]} outside backward, besides g's partial "
                f"sums {(BATCH, D)}: the gradients need no all-reduce after backward, f and g "
                f"already made them right (each rank's shards' gradients are its own, w0's came "
                f"whole from f, b2's is whole on every rank since g's backward is the identity)")
    if len(outside) != STEPS or len(backward) != STEPS:
        return (f"{len(outside)} all-reduces in forward and {len(backward)} in backward over "
                f"{STEPS} steps, expected one of each per step (g's and f's): train on every "
                f"batch, each through your column_parallel_linear and row_parallel_linear once")
    return None


TP_VARIANTS = (  # a typical mistake: what its forward does differently, and what to change
    ("gelu_after", "GeLU applied after the row-parallel sum: it goes between the two linears, "
                   "on each rank's own hidden units (it acts element by element, so it needs no "
                   "communication), and the block's output is not passed through it"),
    ("gelu_twice", "GeLU applied again after the row-parallel sum: the block's output is not "
                   "passed through GeLU, only the hidden units between the linears"),
    ("no_gelu", "no GeLU between the linears: z = gelu(x @ w0.T @ w1.T + b1) @ w2.T + b2"),
    ("uncut", f"every rank used the whole w1, b1 and w2, so g added {RANKS} whole products: "
              f"{TP_CUT}"),
    ("b2_every_rank", f"b2 added {RANKS} times (on every rank before the sum, or again after "
                      f"your row_parallel_linear): add it once, after g's all-reduce, as your "
                      f"row_parallel_linear does"),
    ("sum_loss", "the loss is summed: it is the mean of (z - y) ** 2 over the rows and features"),
    ("no_w0", "the block's input is x @ w0.T (w0: the layer before the block, whole on every "
              "rank), not x"),
)


def _tp_losses(got: list[float], want: list[float]) -> tuple[int | None, str | None]:
    """The first step whose loss differs, and what to say about it."""
    if len(got) != len(want):
        return None, f"{len(got)} losses, expected one per step: {len(want)}"
    step = next((i for i, (g, w) in enumerate(zip(got, want)) if not same(g, w)), None)
    if step is None:
        return None, None
    said = f"step {step}'s loss: expected {want[step]:.6g}, got {got[step]:.6g}"
    if step == 0:
        for variant, why in TP_VARIANTS:
            if same(got[0], train_whole_mlp(variant)[0][0]):
                return 0, f"{said}: {why}"
        return 0, (f"{said}: the forward differs from the whole block's; {TP_CUT}, GeLU between "
                   f"the linears")
    return step, (f"{said} (step 0's is right): the update differs from SGD on the whole "
                  f"block's gradients, p -= lr * p.grad for every tensor the rank holds, the "
                  f"gradients cleared after each step")
