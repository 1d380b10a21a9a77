"""The model-parallel strategies assembled from the learner's own checked pieces, each trained
for a few SGD steps on 2 ranks against one process training the whole model on the whole batch
(every step's loss and the final weights, 1e-5):

- ``train_tp_mlp`` (07): a tensor-parallel MLP block (column-parallel linear, GeLU,
  row-parallel linear) from the learner's ``column_parallel_linear`` and ``row_parallel_linear``;
  the judge also counts the collectives, by autograd phase: one all-reduce in each forward
  (g's), one in each backward (f's), nothing else;
- ``train_pipeline_1f1b`` (06): a 2-stage pipeline run in the order of the learner's
  ``one_f_one_b``, with send/recv only; the judge checks each stage's messages against that
  order, and a send or receive that waits past ``P2P_TIMEOUT_S`` ends the run as a deadlock.

The pieces are found in the learner's function's scope (``check`` sends them as helpers) and
pass their own checks first, so a report about the assembly is about the assembly. A wrong
result is named, where it can be, by the one-process variant of a typical mistake it equals
(GeLU after the sum, unscaled micro-batch losses, ...)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from dlab.exercises.local import judge_one_f_one_b, run_one_f_one_b
from dlab.exercises.model_parallel import (
    judge_column_parallel,
    judge_row_parallel,
    run_column_parallel,
    run_row_parallel,
)
from dlab.exercises.registry import COLLECTIVES, exercise, first_difference

RANKS = 2
LR = 0.1  # plain SGD: a gradient off by a factor moves the weights by that factor (docs/testing.md)


def _pieces(fn, names: tuple[str, ...], call: str) -> tuple[dict, str | None]:
    """The learner's pieces, from the scope ``check`` defined ``fn`` in, or what is missing."""
    scope = getattr(fn, "__globals__", {})
    missing = [n for n in names if not callable(scope.get(n))]
    if missing:
        return {}, (f"{', '.join(missing)} not found: pass your own with the function, as the "
                    f"cell does: {call}")
    return {n: scope[n] for n in names}, None


def _piece_run(name: str, run, *args):
    """Run a piece's own check on this rank, naming the piece if it raises."""
    try:
        return run(*args)
    except Exception as e:  # noqa: BLE001 - re-raised, saying which piece raised
        raise RuntimeError(f"your {name} raised {type(e).__name__}: {e}") from e


def _own_check(name: str, wrong: str | None) -> str | None:
    if wrong is None:
        return None
    return (f"your {name} does not pass its own check yet ({wrong}): fix it in its cell above and "
            f"check it there, then assemble")


def _same(got, want) -> bool:
    return first_difference(got, want) is None


# --- 07: a tensor-parallel MLP block from column_parallel_linear and row_parallel_linear --------
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
    pieces, missing = _pieces(fn, ("column_parallel_linear", "row_parallel_linear"), TP_CALL)
    if missing:
        return {"missing": missing}
    own = {name: _piece_run(name, run, pieces[name], rank, world)
           for name, run in (("column_parallel_linear", run_column_parallel),
                             ("row_parallel_linear", run_row_parallel))}
    every: list = [None] * world
    dist.all_gather_object(every, own)  # each piece judged on every rank, so all skip alike
    for name, judge in (("column_parallel_linear", judge_column_parallel),
                        ("row_parallel_linear", judge_row_parallel)):
        wrong = _own_check(name, judge([o[name] for o in every]))
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
        if _same(got, start[k]) and not _same(end[k], start[k]):
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
    step = next((i for i, (g, w) in enumerate(zip(got, want)) if not _same(g, w)), None)
    if step is None:
        return None, None
    said = f"step {step}'s loss: expected {want[step]:.6g}, got {got[step]:.6g}"
    if step == 0:
        for variant, why in TP_VARIANTS:
            if _same(got[0], train_whole_mlp(variant)[0][0]):
                return 0, f"{said}: {why}"
        return 0, (f"{said}: the forward differs from the whole block's; {TP_CUT}, GeLU between "
                   f"the linears")
    return step, (f"{said} (step 0's is right): the update differs from SGD on the whole "
                  f"block's gradients, p -= lr * p.grad for every tensor the rank holds, the "
                  f"gradients cleared after each step")


# --- 06: a 2-stage 1F1B pipeline from one_f_one_b and send/recv -----------------------------------
IN, WIDTH, OUT = 4, 8, 3  # stage 0: IN -> WIDTH (tanh), stage 1: WIDTH -> OUT
G, M, PIPE_STEPS = 8, 4, 3  # batch rows, micro-batches, SGD steps
P2P_TIMEOUT_S = 5.0  # a send or receive waiting this long: the stages wait on each other
PIPE_CALL = "check('train_pipeline_1f1b', train_pipeline_1f1b, one_f_one_b)"


def pipeline_parts() -> list[torch.nn.Module]:
    with torch.random.fork_rng():  # the judge runs in the learner's kernel: its seed stays
        torch.manual_seed(60)
        return [torch.nn.Sequential(torch.nn.Linear(IN, WIDTH), torch.nn.Tanh()),
                torch.nn.Linear(WIDTH, OUT)]


def pipeline_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(61)
    return [(torch.randn(G, IN, generator=g), torch.randn(G, OUT, generator=g))
            for _ in range(PIPE_STEPS)]


def train_whole_pipeline(grad_scale: float = 1.0, kept: bool = False) -> tuple[list[float], list[dict]]:
    """One process training both parts on the whole batch (``grad_scale``: the gradients m
    times the batch's when the micro-batch losses are not divided by m; ``kept``: the
    gradients never cleared, so each step adds the earlier steps' again)."""
    parts = pipeline_parts()
    losses = []
    for x, y in pipeline_batches():
        loss = ((parts[1](parts[0](x)) - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for p in (*parts[0].parameters(), *parts[1].parameters()):
                p -= LR * grad_scale * p.grad
                if not kept:
                    p.grad = None
        losses.append(loss.item())
    return losses, [{k: v.detach().clone() for k, v in part.state_dict().items()} for part in parts]


class Deadlock(RuntimeError):
    """A stage waited ``P2P_TIMEOUT_S`` for the other. Its name and message are the run's
    cause (``dlab.analysis.diagnose.own_error``), not the other stage's closed connection."""


def _p2p_logged(log: list) -> dict:
    """Wrap send, recv, isend and irecv (in ``dist`` and in c10d, where batch_isend_irecv and
    P2POp look them up) to log ("send" or "recv", peer, shape) for each of the learner's calls,
    and give every wait for one, blocking or on its handle, a deadline of ``P2P_TIMEOUT_S``;
    returns the originals."""
    originals = {op: getattr(c10d, op) for op in ("send", "recv", "isend", "irecv")}

    def peer(kwargs, args):
        for key in ("dst", "src", "group_dst", "group_src"):
            if kwargs.get(key) is not None:
                return kwargs[key]
        return args[0] if args else None  # (tensor, dst or src, ...): the tensor taken off

    def deadline(work, kind, other):
        try:  # Gloo's wait takes a timeout (its is_completed turns true only in a wait)
            return work.wait(timeout=timedelta(seconds=P2P_TIMEOUT_S))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            raise Deadlock(_deadlock(dist.get_rank(), kind, other)) from None

    class Deadlined:
        """An isend's or irecv's handle whose wait has the deadline."""

        def __init__(self, work, kind, other):
            self._work, self._kind, self._other = work, kind, other

        def wait(self, *args, **kwargs):
            return deadline(self._work, self._kind, self._other)

        def __getattr__(self, name):
            return getattr(self._work, name)

    def posted(kind, blocking):
        def call(tensor, *args, **kwargs):
            other = peer(kwargs, args)
            log.append((kind, other, tuple(tensor.shape)))
            work = originals["isend" if kind == "send" else "irecv"](tensor, *args, **kwargs)
            if blocking:  # what send and recv are: the same op, waited for at once
                deadline(work, kind, other)
                return other if kind == "recv" else None
            return Deadlined(work, kind, other)
        return call

    for op, kind, blocking in (("send", "send", True), ("recv", "recv", True),
                               ("isend", "send", False), ("irecv", "recv", False)):
        wrapped = posted(kind, blocking)
        setattr(c10d, op, wrapped)
        setattr(dist, op, wrapped)
    return originals


def _deadlock(me: int, kind: str, other) -> str:
    waited = (f"stage {me} waited {P2P_TIMEOUT_S:g} s "
              + (f"to receive from stage {other}, and nothing came" if kind == "recv" else
                 f"for stage {other} to receive what it sent, and it did not"))
    return (f"{waited}: the stages wait on each other (a deadlock). A blocking dist.send waits "
            f"for its receive: post the sends with dist.isend and wait for them at the end of "
            f"the step; each stage runs one_f_one_b(stage, 2, microbatches) with its own stage, "
            f"stage 0 sending each activation in its F, stage 1 each activation's gradient in "
            f"its B")


def run_train_pipeline(fn, rank, world):
    pieces, missing = _pieces(fn, ("one_f_one_b",), PIPE_CALL)
    if missing:
        return {"missing": missing}
    schedule = pieces["one_f_one_b"]
    own = _own_check("one_f_one_b", judge_one_f_one_b(_piece_run("one_f_one_b", run_one_f_one_b,
                                                                    schedule)))
    if own:  # the same on every rank: none trains with an order that may not run
        return {"pieces": own}
    order = [tuple(a) for a in schedule(rank, world, M)]
    part = pipeline_parts()[rank]
    dist.barrier()  # not among the collectives p2p_only takes away: the stages start together
    log: list = []
    originals = _p2p_logged(log)
    try:
        losses = fn(part, rank, pipeline_batches(), M, (G // M, WIDTH), LR)
    finally:
        for op, original in originals.items():
            setattr(c10d, op, original)
            setattr(dist, op, original)
    answer = {"order": order, "log": log,
              "state": {k: v.detach().clone() for k, v in part.state_dict().items()}}
    if rank == world - 1:
        try:
            answer["losses"] = [float(x) for x in losses]
        except (TypeError, ValueError) as e:
            answer["returned"] = (f"returned {type(losses).__name__}, expected the loss of every "
                                  f"step (the batch's mean) on the last stage ({e})")
    return answer


@exercise(name="train_pipeline_1f1b", notebook="06_pipeline", ranks=RANKS, p2p_only=True,
          pieces=("one_f_one_b",),
          task="train_pipeline_1f1b(part, stage, batches, microbatches, act_shape, lr): train a "
               "2-stage pipeline, this rank's stage `part`, with plain SGD on every (x, y) in "
               "batches, each cut into micro-batches run in your one_f_one_b order, activations "
               "(act_shape) and their gradients sent with send/recv; loss "
               "((z - y) ** 2).mean() of the whole batch; return the loss of every step on the "
               "last stage",
          run=run_train_pipeline)
def judge_train_pipeline(answers):
    if "missing" in answers[0]:
        return answers[0]["missing"]
    if "pieces" in answers[0]:
        return answers[0]["pieces"]
    last = answers[-1]
    if "returned" in last:
        return f"stage {len(answers) - 1} {last['returned']}"
    for s, a in enumerate(answers):
        wrong = _pipe_messages(s, a["order"], a["log"])
        if wrong:
            return f"stage {s}, {wrong}"
    want, final = train_whole_pipeline()
    got = last["losses"]
    if len(got) != len(want):
        return f"stage 1 returned {len(got)} losses, expected one per step: {len(want)}"
    step = next((i for i, (g, w) in enumerate(zip(got, want)) if not _same(g, w)), None)
    if step is not None:
        said = f"step {step}'s loss: expected {want[step]:.6g}, got {got[step]:.6g}"
        unscaled = train_whole_pipeline(M)[0]
        if _same(got[step], M * want[step]) or _same(got[step], M * unscaled[step]):
            return (f"{said}, {M} times the batch's mean: divide each micro-batch's loss by the "
                    f"number of micro-batches ({M}) before its backward, and return their sum")
        if _same(got[step], unscaled[step]):
            return (f"{said}: the gradients are {M} times the whole batch's; divide each "
                    f"micro-batch's loss by the number of micro-batches ({M}) before its backward")
        if _same(got[step], train_whole_pipeline(kept=True)[0][step]):
            return (f"{said}: the gradients were not cleared after the update, so each step "
                    f"adds the earlier steps' again; set p.grad = None after p -= lr * p.grad")
        return (f"{said}: the pipeline does not train like one process on the whole batch (every "
                f"micro-batch through both stages, p -= lr * p.grad on every parameter once per "
                f"step, after the step's last action)")
    start = [{k: v.detach() for k, v in p.state_dict().items()} for p in pipeline_parts()]
    for s, a in enumerate(answers):
        for k, v in a["state"].items():
            if _same(v, start[s][k]):
                return (f"stage {s}, parameter {k} never changed: "
                        + ("run backward on stage 0's output with the gradient stage 1 sent "
                           "(out.backward(grad)), then update" if s == 0 else
                           "update every parameter after the step's backwards"))
            wrong = first_difference(v, final[s][k], f"final {k}")
            if wrong:
                return f"stage {s}, {wrong}"
    return None


def _pipe_messages(stage: int, order: list, log: list) -> str | None:
    """Each action of the stage's order, every step, moves one micro-batch's tensor: stage 0
    sends the activation in F and receives its gradient in B, stage 1 the other way round."""
    other, act = 1 - stage, (G // M, WIDTH)
    first, second = ("send", "recv") if stage == 0 else ("recv", "send")
    want = [(first if kind == "F" else second, other) for kind, _ in order] * PIPE_STEPS
    got = [(kind, peer) for kind, peer, _ in log]
    sent_back = [m for m in log if m[0] == ("send" if stage == 1 else "recv")]
    if not sent_back and want:
        return (f"{'sent' if stage == 1 else 'received'} no gradient of an activation: stage 1 "
                f"must send back, in each B, the gradient of the activation it received (receive "
                f"into a tensor, then act.requires_grad_(), so backward gives act.grad), and "
                f"stage 0 run out.backward(grad) with it; without it stage 0's parameters never "
                f"learn")
    wrong_shape = next((m for m in log if m[2] != act), None)
    if wrong_shape:
        return (f"a {wrong_shape[0]} of shape {wrong_shape[2]}: one micro-batch's activation (and "
                f"its gradient) is {act}; cut each batch into {M} micro-batches")
    if got != want:
        n = len(order)
        step = next(k for k in range(PIPE_STEPS + 1) if got[k * n:(k + 1) * n] != want[k * n:(k + 1) * n])

        def letters(seq):
            return " ".join("S" if kind == "send" else "R" for kind, _ in seq[step * n:(step + 1) * n])
        return (f"the messages of step {step} went {letters(got) or 'none'}, your "
                f"one_f_one_b({stage}, 2, {M}) gives {letters(want) or 'none'} (S: send, R: "
                f"receive; {first} in F, {second} in B, to or from stage {other}): run each "
                f"step's actions in its order, one message each, every step")
    return None
