"""Notebook 06's assembled exercise, ``train_pipeline_1f1b``: a 2-stage pipeline run in the order
of the learner's ``one_f_one_b``, with send/recv only, trained on 2 ranks against one process
(``dlab.exercises.assembly``); the judge checks each stage's messages against that order, and a
send or receive that waits past ``P2P_TIMEOUT_S`` ends the run as a deadlock."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dlab.exercises.assembly import LR, RANKS, find_pieces, own_check, run_piece, same
from dlab.exercises.local import judge_one_f_one_b, run_one_f_one_b
from dlab.exercises.registry import exercise, first_difference

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
    pieces, missing = find_pieces(fn, ("one_f_one_b",), PIPE_CALL)
    if missing:
        return {"missing": missing}
    schedule = pieces["one_f_one_b"]
    own = own_check("one_f_one_b", judge_one_f_one_b(run_piece("one_f_one_b", run_one_f_one_b,
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
    step = next((i for i, (g, w) in enumerate(zip(got, want)) if not same(g, w)), None)
    if step is not None:
        said = f"step {step}'s loss: expected {want[step]:.6g}, got {got[step]:.6g}"
        unscaled = train_whole_pipeline(M)[0]
        if same(got[step], M * want[step]) or same(got[step], M * unscaled[step]):
            return (f"{said}, {M} times the batch's mean: divide each micro-batch's loss by the "
                    f"number of micro-batches ({M}) before its backward, and return their sum")
        if same(got[step], unscaled[step]):
            return (f"{said}: the gradients are {M} times the whole batch's; divide each "
                    f"micro-batch's loss by the number of micro-batches ({M}) before its backward")
        if same(got[step], train_whole_pipeline(kept=True)[0][step]):
            return (f"{said}: the gradients were not cleared after the update, so each step "
                    f"adds the earlier steps' again; set p.grad = None after p -= lr * p.grad")
        return (f"{said}: the pipeline does not train like one process on the whole batch (every "
                f"micro-batch through both stages, p -= lr * p.grad on every parameter once per "
                f"step, after the step's last action)")
    start = [{k: v.detach() for k, v in p.state_dict().items()} for p in pipeline_parts()]
    for s, a in enumerate(answers):
        for k, v in a["state"].items():
            if same(v, start[s][k]):
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
