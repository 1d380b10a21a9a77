"""What the assembled exercises share: a strategy trained from the learner's own checked pieces
(``Exercise.pieces``), each for a few SGD steps on 2 ranks against one process training the whole
model on the whole batch (every step's loss and the final weights, 1e-5).

The pieces are found in the learner's function's scope (``check`` sends them as helpers) and
pass their own checks first, so a report about the assembly is about the assembly. A wrong
result is named, where it can be, by the one-process variant of a typical mistake it equals
(GeLU after the sum, unscaled micro-batch losses, ...). The assemblies: ``tp_assembled``
(``train_tp_mlp``, 07), ``pipeline_assembled`` (``train_pipeline_1f1b``, 06), and
``zero``'s ``train_zero1`` (05)."""
from __future__ import annotations

from dlab.exercises.registry import first_difference

RANKS = 2
LR = 0.1  # plain SGD: a gradient off by a factor moves the weights by that factor (docs/testing.md)


def find_pieces(fn, names: tuple[str, ...], call: str) -> tuple[dict, str | None]:
    """The learner's pieces, from the scope ``check`` defined ``fn`` in, or what is missing."""
    scope = getattr(fn, "__globals__", {})
    missing = [n for n in names if not callable(scope.get(n))]
    if missing:
        return {}, (f"{', '.join(missing)} not found: pass your own with the function, as the "
                    f"cell does: {call}")
    return {n: scope[n] for n in names}, None


def run_piece(name: str, run, *args):
    """Run a piece's own check on this rank, naming the piece if it raises."""
    try:
        return run(*args)
    except Exception as e:  # noqa: BLE001 - re-raised, saying which piece raised
        raise RuntimeError(f"your {name} raised {type(e).__name__}: {e}") from e


def own_check(name: str, wrong: str | None) -> str | None:
    if wrong is None:
        return None
    return (f"your {name} does not pass its own check yet ({wrong}): fix it in its cell above and "
            f"check it there, then assemble")


def same(got, want) -> bool:
    return first_difference(got, want) is None
