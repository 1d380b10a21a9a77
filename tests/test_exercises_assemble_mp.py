"""The assembled model-parallel exercises (``dlab.exercises.tp_assembled`` and ``pipeline_assembled``): a
tensor-parallel MLP block from the learner's ``column_parallel_linear`` and
``row_parallel_linear`` (07), a 2-stage 1F1B pipeline from their ``one_f_one_b`` (06). Their
reference solutions and one typical mistake each are ``tests/test_exercises.py``'s; here, the
other typical wrong assemblies, each rejected with a message that says what to change, and right
ones written another way, which pass. Each wrong answer is the reference with one edit."""
from __future__ import annotations

import pytest
from test_exercises import MISTAKES, SOLUTIONS, with_pieces

from dlab.exercises import check


def edited(name: str, *edits: tuple[str, str]) -> str:
    """The reference solution of ``name`` with each (text, replacement) made, each text found
    once, after the reference solutions of its pieces."""
    source = (SOLUTIONS / f"{name}.py").read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return with_pieces(name, source)


def piece_replaced(name: str, piece: str) -> str:
    """``name``'s reference assembled from the reference pieces, ``piece`` replaced by its
    typical mistake (tests/test_exercises.py's MISTAKES), defined after the reference's."""
    return with_pieces(name, f"{MISTAKES[piece][0]}\n\n{(SOLUTIONS / f'{name}.py').read_text()}")


def line(text: str) -> str:
    """A line of the loops' bodies in the reference solutions (16 spaces in)."""
    return " " * 16 + text + "\n"


TP = "train_tp_mlp"
PIPE = "train_pipeline_1f1b"
FORWARD = 'h = column_parallel_linear(x @ held["w0"].T, held["w1"], held["b1"])'
OUTPUT = 'z = row_parallel_linear(torch.nn.functional.gelu(h), held["w2"], held["b2"])'
UPDATE = "                p -= lr * p.grad\n"

TP_WRONG = {  # id: (edits or a whole source, what the report must say), default ones first
    "input-detached": (  # the update skips a missing gradient: the collectives tell
        [(FORWARD, FORWARD.replace('x @ held["w0"].T', '(x @ held["w0"].T).detach()')),
         (UPDATE, line("if p.grad is not None:") + "    " + UPDATE)],
        "rank 0, no all-reduce in backward over 4 steps: f's backward never ran, so w0"),
    "input-detached-raises": (  # the update meets w0's missing gradient: the error is explained
        [(FORWARD, FORWARD.replace('x @ held["w0"].T', '(x @ held["w0"].T).detach()'))],
        "no all-reduce ran in backward: f's backward never ran, so w0"),
    "piece-wrong": (
        piece_replaced(TP, "row_parallel_linear"),
        "your row_parallel_linear does not pass its own check yet (rank 0, output (is b added "
        "once, after the sum?)"),
    "weights-uncut": (
        [('"w1": params["w1"][mine], "b1": params["b1"][mine]', '"w1": params["w1"], "b1": params["b1"]'),
         ('"w2": params["w2"][:, mine]', '"w2": params["w2"]')],
        "step 0's loss: expected 1.96503, got 3.63915: every rank used the whole w1, b1 and w2"),
    "w2-cut-by-rows": (
        [('"w2": params["w2"][:, mine]', '"w2": params["w2"][mine]')],
        "each rank holds rows r*8/t to (r+1)*8/t of w1 and b1 (its hidden units), the same "
        "columns of w2"),
    "grads-all-reduced": (
        [(UPDATE, "                dist.all_reduce(p.grad)\n" + UPDATE)],
        "rank 0, all-reduced a tensor of shape (4, 4) outside backward, besides g's partial sums"),
    "b2-twice": (
        [(OUTPUT, OUTPUT + ' + held["b2"]')],
        "b2 added 2 times (on every rank before the sum, or again after your row_parallel_linear)"),
    "w0-not-updated": (
        [("            for p in held.values():\n",
          "            for p in [v for k, v in held.items() if k != 'w0']:\n")],
        "rank 0, w0 never changed: update every tensor the rank holds, w0 too"),
    "rank1-no-b2": (
        [(OUTPUT, 'z = row_parallel_linear(torch.nn.functional.gelu(h), held["w2"], held["b2"] '
                  'if rank == 0 else 0 * held["b2"])')],
        "rank 1, step 0's loss: expected 1.96503"),
    "pieces-not-passed": (
        (SOLUTIONS / f"{TP}.py").read_text(),
        "train_tp_mlp calls column_parallel_linear, which was not sent with it: pass it to check "
        "after train_tp_mlp"),
}
# in the default run: a collective count and a piece; the others (slow) take the same path,
# the spawn and the judge, to a message of their own
DEFAULT_TP = ("input-detached", "piece-wrong")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[] if c in DEFAULT_TP else [pytest.mark.slow]) for c in TP_WRONG])
def test_a_wrong_tensor_parallel_block_is_named(case, runs_dir):
    edits, says = TP_WRONG[case]
    source = edits if isinstance(edits, str) else edited(TP, *edits)
    report = check(TP, source, runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report


SEND = line("sends.append(dist.isend(out.detach(), dst=1))  # posted, not waited for")
BACK = line("sends.append(dist.isend(act.grad, dst=0))")
RECV_GRAD = "                dist.recv(grad, src=1)\n"
ORDER = "        for kind, i in one_f_one_b(stage, 2, microbatches):\n"

PIPE_WRONG = {  # id: (edits or a whole source, what the report must say), default ones first
    "no-gradient-back": (
        [(line("act.requires_grad_()  # so that backward gives the gradient stage 0 waits for"), ""),
         (BACK, ""), (RECV_GRAD, ""), (line("kept.pop(i).backward(grad)"), line("kept.pop(i)")),
         (UPDATE, line("if p.grad is not None:") + "    " + UPDATE)],
        "stage 0, received no gradient of an activation: stage 1 must send back"),
    "gpipe-order": (
        [(ORDER, "        for kind, i in [(k, i) for k in 'FB' for i in range(microbatches)]:\n")],
        "stage 0, the messages of step 0 went S S S S R R R R, your one_f_one_b(0, 2, 4) gives "
        "S S R S R S R R"),
    "blocking-sends-deadlock": (
        [(SEND, line("dist.send(out.detach(), dst=1)")), (BACK, line("dist.send(act.grad, dst=0)"))],
        "to receive what it sent, and it did not: the stages wait on each other (a deadlock). A "
        "blocking dist.send waits for its receive"),
    "orders-swapped-deadlock": (
        [(ORDER, ORDER.replace("one_f_one_b(stage,", "one_f_one_b(1 - stage,"))],
        "waited 5 s to receive from stage"),
    "loss-scaled-late": (
        [("                loss = ((part(act) - ys[i]) ** 2).mean() / microbatches  # a share of the mean\n",
          "                loss = ((part(act) - ys[i]) ** 2).mean()\n"),
         ("                total += loss.item()\n", "                total += loss.item() / microbatches\n")],
        "step 1's loss: expected 1.14048, got 1.17119: the gradients are 4 times the whole batch's"),
    "piece-wrong": (
        piece_replaced(PIPE, "one_f_one_b"),
        "your one_f_one_b does not pass its own check yet (4 stages, 6 micro-batches, stage 0"),
    "all-reduce": (
        [(UPDATE, "                dist.all_reduce(p.grad)\n" + UPDATE)],
        "raised RuntimeError: dist.all_reduce is off limits"),
}
# in the default run: the message log and the deadline; the others (slow) take the same path
DEFAULT_PIPE = ("no-gradient-back", "blocking-sends-deadlock")


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=[] if c in DEFAULT_PIPE else [pytest.mark.slow]) for c in PIPE_WRONG])
def test_a_wrong_pipeline_is_named(case, runs_dir):
    edits, says = PIPE_WRONG[case]
    source = edits if isinstance(edits, str) else edited(PIPE, *edits)
    report = check(PIPE, source, runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report


def test_a_pipeline_with_isend_irecv_and_a_batched_exchange_passes(runs_dir):
    """The deadline and the message log wrap isend, irecv and the P2POps of
    batch_isend_irecv too: a right answer written with them is judged like one with send/recv."""
    source = edited(PIPE, (SEND, line("sends += dist.batch_isend_irecv([dist.P2POp(dist.isend, "
                                      "out.detach(), 1)])")),
                    (line("dist.recv(act, src=0)"), line("dist.irecv(act, 0).wait()")),
                    (BACK, line("sends.append(dist.isend(act.grad, 0))")))
    report = check(PIPE, source, runs_dir=str(runs_dir))
    assert report.ok, report


def test_an_unwritten_piece_is_named_before_any_rank_starts():
    def column_parallel_linear(x, w_shard, b_shard):
        raise NotImplementedError

    def row_parallel_linear(y_shard, w_shard, b):
        return y_shard @ w_shard.T + b

    def train_tp_mlp(params, batches, lr, rank, world_size):
        return column_parallel_linear, row_parallel_linear

    report = check(TP, train_tp_mlp, column_parallel_linear, row_parallel_linear)
    assert not report.ok and report.message.startswith(
        "not written yet: column_parallel_linear, which train_tp_mlp uses, still raises "
        "NotImplementedError; write and check it first, then train_tp_mlp("), report
