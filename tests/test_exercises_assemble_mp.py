"""The assembled model-parallel exercise (``dlab.exercises.model_parallel_assembled``): a
tensor-parallel MLP block from the learner's ``column_parallel_linear`` and
``row_parallel_linear`` (07). Its reference solution and one typical mistake are
``tests/test_exercises.py``'s; here, the other typical wrong assemblies, each rejected with a
message that says what to change. Each wrong answer is the reference with one edit."""
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
FORWARD = 'h = column_parallel_linear(x @ held["w0"].T, held["w1"], held["b1"])'
OUTPUT = 'z = row_parallel_linear(torch.nn.functional.gelu(h), held["w2"], held["b2"])'
UPDATE = "                p -= lr * p.grad\n"

TP_WRONG = {  # id: (edits or a whole source, what the report must say), default ones first
    "input-detached": (
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
        "column_parallel_linear, row_parallel_linear not found: pass your own with the function"),
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
