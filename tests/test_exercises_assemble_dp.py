"""The data-parallel part's assembled exercise, ``train_zero1`` (notebook 05): the learner's own
``zero1_step`` trained end to end. The checker passes the reference (tests/test_exercises.py)
and answers that split the batch or log the loss another right way, and fails each way of
getting there wrong with a message that says what to change: a right result without data
parallelism or without ZeRO-1, a training loop that breaks the numbers (summed or twice-divided
gradients, a scaled or summed loss, gradients never cleared, parameters never or not last
written back, a flat vector cut back in another order), and a mistake made on one rank only.

Every case runs in the default run on two threads of this process, each a rank with a
stand-in for ``dist`` (the exercise's own run, watch and judge; a second): what the judge
decides. A few run on real ranks through ``check`` as a learner's would (a spawn each,
seconds); the rest of those are slow."""
from __future__ import annotations

import math
import threading

import pytest
import torch
from test_exercises import MISTAKES, SOLUTIONS, with_pieces

from dlab.exercises import EXERCISES, check


def loop(*, rows="x[mine], y[mine]", clear="        for p in params:\n            p.grad = None\n",
         loss="torch.nn.functional.mse_loss(model(X), Y)", step=None, back=None,
         extra="") -> str:
    """A train_zero1 in the reference's shape with one part replaced: the mistakes below."""
    x, y = rows.split(", ")
    step = step or ("            new = zero1_step(torch.cat([p.reshape(-1) for p in params]),\n"
                    "                             torch.cat([p.grad.reshape(-1) for p in params]),\n"
                    "                             lr, rank, world_size)\n")
    back = back or ("            for p, part in zip(params, new.split([p.numel() for p in params])):\n"
                    "                p.copy_(part.view_as(p))\n")
    return ("def train_zero1(model, batches, lr, rank, world_size):\n"
            "    params, losses = list(model.parameters()), []\n"
            "    for i, (x, y) in enumerate(batches):\n"
            "        n = len(x) // world_size\n        mine = slice(rank * n, (rank + 1) * n)\n"
            f"{clear}"
            f"        loss = {loss.replace('X', x).replace('Y', y)}\n"
            "        loss.backward()\n"
            f"{extra}"
            "        losses.append(loss.item())\n"
            "        with torch.no_grad():\n"
            f"{step}{back}"
            "    return losses\n")


# right answers written otherwise: DistributedSampler's strided rows, the loss all-reduced for the log
RIGHT = {
    "strided": loop(rows="x[rank::world_size], y[rank::world_size]"),
    "logged-mean": loop(extra="        loss = loss.detach().clone()\n        dist.all_reduce(loss)\n"
                              "        loss /= world_size\n"),
}

WRONG = {  # name: (answer, what the report must say)
    "last-not-written": (  # "no forward follows the last step": its update never reaches the model
        loop(back="            if i < len(batches) - 1:\n"
                  "                for p, part in zip(params, new.split([p.numel() for p in params])):\n"
                  "                    p.copy_(part.view_as(p))\n"),
        "rank 0's final parameters are those before the last step"),
    "ddp": (  # the whole gradient all-reduced: right numbers, data parallelism, not ZeRO-1
        loop(step="            g = torch.cat([p.grad.reshape(-1) for p in params])\n"
                  "            dist.all_reduce(g)\n"
                  "            new = torch.cat([p.reshape(-1) for p in params]) - lr * g / world_size\n"),
        "rank 0 all-reduced the gradient: every rank then holds the whole mean gradient"),
    "alone": (  # autograd's gradients used as they are: no averaging, no collective
        loop(step="            new = torch.cat([p.reshape(-1) for p in params])"
                  " - lr * torch.cat([p.grad.reshape(-1) for p in params])\n"),
        "rank 0 called no collective in 4 steps"),
    "per-tensor": (  # zero1_step on each parameter tensor: nothing flattened
        loop(step="            new = torch.cat([zero1_step(p.reshape(-1), p.grad.reshape(-1), lr, rank,"
                  " world_size) for p in params])\n"),
        "rank 0 called 16 reduce-scatters and 16 all-gathers in 4 steps"),
    "same-rows": (  # every rank on the first G/N rows
        loop(rows="x[:n], y[:n]"), "ranks 0 and 1 both trained on rows 0 to 3 of step 0's batch"),
    "summed": (  # ZeRO-1 written out, the reduce-scattered gradient never divided by N
        loop(step="            g = torch.cat([p.grad.reshape(-1) for p in params])\n"
                  "            mine = torch.empty(g.numel() // world_size)\n"
                  "            dist.reduce_scatter_tensor(mine, g)\n"
                  "            own = torch.cat([p.reshape(-1) for p in params]).chunk(world_size)[rank]"
                  " - lr * mine\n"
                  "            new = torch.empty(g.numel())\n"
                  "            dist.all_gather_into_tensor(new, own)\n"),
        "rank 0's losses are those of a model trained wrong: its steps are N = 2 times too large"),
    "loss-times-n": (  # the loss multiplied by N "to undo the mean"
        loop(loss="torch.nn.functional.mse_loss(model(X), Y) * world_size"),
        "rank 0, step 0: the loss is N = 2 times the mean squared error of this rank's rows"),
    "halved": (  # the loss divided by N as well as zero1_step's mean
        loop(loss="torch.nn.functional.mse_loss(model(X), Y) / world_size"),
        "rank 0, step 0: the loss is 1/N = 1/2 of the mean squared error"),
    "sum-loss": (  # the squared errors summed
        loop(loss="torch.nn.functional.mse_loss(model(X), Y, reduction='sum')"),
        "the sum of the squared errors, not their mean"),
    "divided-twice": (  # the gradient divided by N before zero1_step, which divides it again
        loop(step="            g = torch.cat([p.grad.reshape(-1) for p in params]) / world_size\n"
                  "            new = zero1_step(torch.cat([p.reshape(-1) for p in params]), g,"
                  " lr, rank, world_size)\n"),
        "its steps are N = 2 times too small"),
    "accumulated": (  # .grad never cleared
        loop(clear=""), "its gradients pile up from step to step"),
    "never-written": (  # zero1_step's result dropped
        loop(back="            pass\n"), "its model never changes"),
    "reversed": (  # cut back in the reverse order of the flattening
        loop(back="            ps = params[::-1]\n"
                  "            for p, part in zip(ps, new.split([p.numel() for p in ps])):\n"
                  "                p.copy_(part.view_as(p))\n"),
        "rank 0, step 1: loss expected"),
    "rank1-whole-batch": (  # rank 1 forgets to slice
        loop(rows="x[mine] if rank == 0 else x, y[mine] if rank == 0 else y"),
        "rank 1, step 0: the model's forward took all 8 rows of the global batch"),
}


ON_RANKS = {"last-not-written"}  # default on real ranks: the final parameters (the planted bug)


class _Dist:
    """The collectives zero1_step and its mistakes call, between threads: each rank puts its
    tensor in, all wait, each reads everyone's."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier):
        self.rank, self.world, self.slots, self.barrier = rank, world, slots, barrier

    def _everyone(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = t.detach().clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world

    def reduce_scatter_tensor(self, out, inp, op=None, async_op=False):
        out.copy_(sum(self._everyone(inp)).reshape(-1).chunk(self.world)[self.rank].view_as(out))

    def all_gather_into_tensor(self, out, inp, async_op=False):
        out.copy_(torch.cat([t.reshape(-1) for t in self._everyone(inp)]).view_as(out))

    def all_reduce(self, t, op=None, async_op=False):
        t.copy_(sum(self._everyone(t)))

    def all_gather_object(self, out, obj):
        self.slots[self.rank] = obj
        self.barrier.wait()
        out[:] = list(self.slots)
        self.barrier.wait()


def on_threads(answer: str, world: int = 2) -> str | None:
    """What the judge says of ``answer`` (source text) run on ``world`` threads."""
    ex = EXERCISES["train_zero1"]
    slots, barrier = [None] * world, threading.Barrier(world, timeout=30)
    answers, errors = [None] * world, []

    def rank(r):
        fake, log = _Dist(r, world, slots, barrier), {}
        for op, wrap in ex.watch(log).items():
            if hasattr(fake, op):
                setattr(fake, op, wrap(getattr(fake, op)))
        source = "\n".join(line for line in answer.splitlines() if "import torch.distributed" not in line)
        scope = {"torch": torch, "dist": fake, "math": math}
        try:
            exec(compile(source, f"<rank {r}>", "exec"), scope)  # noqa: S102 - the test's own answers
            answers[r] = (ex.run(scope["train_zero1"], r, world), log)
        except Exception as e:  # noqa: BLE001 - said in the assertion
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return ex.judge(answers)


def test_the_reference_and_answers_written_otherwise_are_right():
    assert on_threads(with_pieces("train_zero1", (SOLUTIONS / "train_zero1.py").read_text())) is None
    for name, answer in RIGHT.items():
        assert on_threads(with_pieces("train_zero1", answer)) is None, name


@pytest.mark.parametrize("name", sorted(WRONG))
def test_each_mistake_is_named_with_what_to_change(name):
    wrong, says = WRONG[name]
    said = on_threads(with_pieces("train_zero1", wrong))
    assert said is not None and says in said, said


def test_a_wrong_zero1_step_is_named_before_the_loop_is_judged():
    """The loop's report would blame the loop for its step's mistake (an all-reduce reads as
    "not ZeRO-1", a wrong update as a loss off at step 1): zero1_step passes its own check first,
    and the answer's collectives are then the loop's alone."""
    wrong, says = MISTAKES["zero1_step"]
    said = on_threads(f"{wrong}\n\n{(SOLUTIONS / 'train_zero1.py').read_text()}")
    assert said and said.startswith("your zero1_step does not pass its own check yet") and says in said, said


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RIGHT))
def test_on_ranks_an_answer_written_otherwise_is_right(name, runs_dir):
    report = check("train_zero1", with_pieces("train_zero1", RIGHT[name]), runs_dir=str(runs_dir))
    assert report.ok, report


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in ON_RANKS else [pytest.mark.slow])
                                  for n in sorted(WRONG)])
def test_on_ranks_each_mistake_fails_saying_what_to_change(name, runs_dir):
    wrong, says = WRONG[name]
    report = check("train_zero1", with_pieces("train_zero1", wrong), runs_dir=str(runs_dir))
    assert not report.ok and says in report.message, report


def test_it_says_when_zero1_step_is_missing_or_unwritten():
    """No rank starts: check reads the source it would send."""
    assert EXERCISES["train_zero1"].pieces == ("zero1_step",)
    body = (SOLUTIONS / "train_zero1.py").read_text()
    report = check("train_zero1", body)
    assert not report.ok and "calls zero1_step, which was not sent with it: pass it to check " \
        "after train_zero1" in report.message, report

    def zero1_step(params, grads, lr, rank, world_size):
        raise NotImplementedError

    def train_zero1(model, batches, lr, rank, world_size):
        return zero1_step(model, batches, lr, rank, world_size)

    report = check("train_zero1", train_zero1, zero1_step)
    assert report.message.startswith("not written yet: zero1_step, which train_zero1 uses"), report
