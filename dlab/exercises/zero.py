"""Notebook 05's exercises: a ZeRO-1 step, a training loop assembled from the learner's own ZeRO-1
step, and a ZeRO-3 forward that gathers and frees. The judges watch the collectives each answer
calls: ZeRO-1's reduce-scatter and all-gather (every step of the loop, with the rows each rank's
forward took), the gathered parameters ZeRO-3 holds at once."""
from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from dlab.exercises.assembly import own_check, run_piece
from dlab.exercises.registry import exercise, first_difference
from dlab.exercises.watch import flat, log_collectives, outermost, per_rank, values

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


# --- 05: assemble: ZeRO-1 training built from the learner's own zero1_step ---------------------
TRAIN_LR, TRAIN_STEPS, TRAIN_ROWS = 0.2, 4, 8  # G = 8 rows a step: 4 a rank on 2 ranks


def _train_model():
    """Two linear layers, 4 -> 6 -> 2: 44 parameters, 22 a rank on 2 ranks (no padding); drawn
    from a generator of its own, nn.Linear's bounds, so the global one is left as it was."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own draws
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = layer.in_features ** -0.5
            for p in (layer.weight, layer.bias):
                p.uniform_(-bound, bound, generator=g)
    return model


def _train_batches():
    """The global batches (x, y), one a step, the same on every rank."""
    g = torch.Generator().manual_seed(55)
    return [(torch.randn(TRAIN_ROWS, 4, generator=g), torch.randn(TRAIN_ROWS, 2, generator=g))
            for _ in range(TRAIN_STEPS)]


def _mse(params, x, y):
    """The model's mean squared error on (x, y) with ``params`` (in ``parameters()`` order)."""
    model = _train_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
        return torch.nn.functional.mse_loss(model(x), y).item()


def _train_single(scale: float = 1.0, accumulate: bool = False, update: bool = True):
    """One process on the whole batch with plain SGD: the parameters before each step and after
    the last, and each step's loss. ``scale``, ``accumulate`` (.grad never cleared) and
    ``update`` (False: the parameters never change) make the mistakes the judge recognises."""
    model = _train_model()
    states, losses = [], []
    for x, y in _train_batches():
        states.append([p.detach().clone() for p in model.parameters()])
        if not accumulate:
            model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if update:
            with torch.no_grad():
                for p in model.parameters():
                    p -= scale * TRAIN_LR * p.grad
    states.append([p.detach().clone() for p in model.parameters()])
    return states, losses


def run_train_zero1(fn, rank, world):
    scope = getattr(fn, "__globals__", {})
    piece_calls = 0
    if callable(scope.get("zero1_step")):
        wrong, piece_calls = _own_zero1_step(scope["zero1_step"], scope.get("dist", dist), rank, world)
        if wrong:
            return {"pieces": wrong}  # trained with a wrong step, the loop's report would mislead
    model = _train_model()
    inputs = []  # what each forward took: the rows a rank trained on
    model.register_forward_pre_hook(lambda _, args: inputs.append(args[0].detach().clone()))
    try:
        losses = fn(model, _train_batches(), TRAIN_LR, rank, world)
    except NameError as e:
        if "zero1_step" not in str(e):
            raise
        raise NameError(f"{e}: pass your zero1_step to check after train_zero1, "
                        f"check('train_zero1', train_zero1, zero1_step)") from None
    return {"losses": None if losses is None else [float(v) for v in losses], "inputs": inputs,
            "params": [p.detach().clone() for p in model.parameters()], "piece_calls": piece_calls}


def _own_zero1_step(step, comm, rank, world) -> tuple[str | None, int]:
    """The learner's zero1_step through its own check on this rank, its collectives logged apart
    (``comm``: the ``dist`` it calls), judged on every rank's answer so that all ranks go on or
    stop alike; and how many collectives it called (the loop's log holds them too)."""
    log: dict = {}
    wrappers = log_collectives(log)
    taken = {op: getattr(comm, op) for op in wrappers if hasattr(comm, op)}
    for op, original in taken.items():
        setattr(comm, op, wrappers[op](original))
    try:
        own = run_piece("zero1_step", run_zero1_step, step, rank, world)
    finally:
        for op, original in taken.items():
            setattr(comm, op, original)
    every: list = [None] * world
    comm.all_gather_object(every, (own, log))
    return own_check("zero1_step", judge_zero1_step(every)), len(log["calls"])


def _rows_of(x_in, x) -> list[int] | None:
    """Which rows of the batch ``x`` the forward's input ``x_in`` holds, or None if it holds
    anything else."""
    if x_in.dim() != 2 or x_in.shape[1] != x.shape[1]:
        return None
    rows = []
    for row in x_in:
        hit = (x == row).all(dim=1).nonzero()
        if len(hit) == 0:
            return None
        rows.append(int(hit[0]))
    return rows


def _said(rows: list[int]) -> str:
    return (f"rows {rows[0]} to {rows[-1]}" if rows == list(range(rows[0], rows[-1] + 1))
            else f"rows {rows}")


def _mistaken(n: int):
    """Known mistakes, each as (how one process reproduces it, what it is and what to change):
    a rank whose every loss is one of theirs made that mistake."""
    return (
        (dict(scale=n), f"its steps are N = {n} times too large: the gradients were summed over "
                        f"the ranks, not averaged; divide the reduced gradient by world_size once"),
        (dict(scale=1 / n), f"its steps are N = {n} times too small: the gradient was divided by "
                            f"world_size twice (before zero1_step, and again in it); the mean of "
                            f"the ranks' mean-loss gradients is the whole batch's, so zero1_step's "
                            f"one division is all it takes"),
        (dict(accumulate=True), "its gradients pile up from step to step: backward adds to what "
                                ".grad holds, so clear every p.grad (p.grad = None) before each "
                                "backward"),
        (dict(update=False), "its model never changes: write the full parameters zero1_step "
                             "returns back into the model's parameters every step (under "
                             "torch.no_grad(), p.copy_(...))"),
    )


@exercise(name="train_zero1", notebook="05_zero_fsdp", ranks=2,
          task="train_zero1(model, batches, lr, rank, world_size): for each global batch (x, y), "
               "run this rank's G/N rows through the model, the MSE loss and backward, pass the "
               "flattened gradient to your zero1_step and write the full parameters it returns "
               "back into the model; return this rank's losses, one a step",
          run=run_train_zero1, watch=log_collectives, pieces=("zero1_step",))
def judge_train_zero1(answers):
    wrong = next((got["pieces"] for got, _ in answers if "pieces" in got), None)
    if wrong:
        return wrong
    n = len(answers)
    batches = _train_batches()
    names = [name for name, _ in _train_model().named_parameters()]
    numel = sum(p.numel() for p in _train_model().parameters())
    share, shard = TRAIN_ROWS // n, numel // n
    # 1. data parallelism: each rank its own G/N rows of every step's batch
    for k, (x, _) in enumerate(batches):
        taken = {}
        for r, (got, _) in enumerate(answers):
            if len(got["inputs"]) != TRAIN_STEPS:
                return (f"rank {r} ran the model's forward {len(got['inputs'])} times in "
                        f"{TRAIN_STEPS} steps: once a step, on this rank's rows of the step's batch")
            rows = _rows_of(got["inputs"][k], x)
            if rows is None:
                return (f"rank {r}, step {k}: the model's input is not rows of the step's batch "
                        f"x; give it this rank's G/N = {share} rows, x[rank * {share}:(rank + 1) "
                        f"* {share}]")
            if len(rows) == TRAIN_ROWS:
                return (f"rank {r}, step {k}: the model's forward took all {TRAIN_ROWS} rows of "
                        f"the global batch. With every rank on the whole batch the ranks compute "
                        f"the same gradient and nothing is parallel: each rank takes its own G/N "
                        f"= {share} rows, x[rank * {share}:(rank + 1) * {share}] (and the same "
                        f"rows of y)")
            if len(rows) != share:
                return (f"rank {r}, step {k}: the model's forward took {len(rows)} rows; each "
                        f"of the {n} ranks takes G/N = {share} of the {TRAIN_ROWS}")
            for s, theirs in taken.items():
                if set(rows) & set(theirs):
                    return (f"ranks {s} and {r} both trained on {_said(sorted(set(rows) & set(theirs)))} "
                            f"of step {k}'s batch: each rank takes its own rows, "
                            f"x[rank * {share}:(rank + 1) * {share}], so that together they "
                            f"cover the batch once")
            taken[r] = rows
    # 2. ZeRO-1: one reduce-scatter of the whole flat gradient and one all-gather a step
    for r, (got, log) in enumerate(answers):
        # a one-element all-reduce is the loss averaged for the log: harmless; the calls before
        # the loop's are zero1_step's own check
        calls = [c for c in log["calls"][got["piece_calls"]:]
                 if not (c["kind"] == "all_reduce" and c["in_numel"] == 1)]
        kinds = [c["kind"] for c in calls]
        if "all_reduce" in kinds:
            return (f"rank {r} all-reduced the gradient: every rank then holds the whole mean "
                    f"gradient and updates every parameter, which is data parallelism (DDP), "
                    f"not ZeRO-1. Pass the flat gradient to your zero1_step instead: it "
                    f"reduce-scatters, updates this rank's shard and all-gathers")
        if not kinds:
            return (f"rank {r} called no collective in {TRAIN_STEPS} steps: each rank stepped "
                    f"on its own rows' gradient alone, so the replicas drift apart and none "
                    f"follows the whole batch. Every step, pass the flattened gradient to your "
                    f"zero1_step, which averages it over the ranks")
        if kinds != ["reduce_scatter", "all_gather"] * TRAIN_STEPS:
            return (f"rank {r} called {kinds.count('reduce_scatter')} reduce-scatters and "
                    f"{kinds.count('all_gather')} all-gathers in {TRAIN_STEPS} steps; ZeRO-1 "
                    f"calls one of each a step: flatten every parameter's gradient into one "
                    f"vector of {numel} and call zero1_step once a step")
        for k, (rs, ag) in enumerate(zip(calls[::2], calls[1::2])):
            if rs["in_numel"] != numel or flat(rs["out"]).numel() != shard or ag["in_numel"] != shard:
                return (f"rank {r}, step {k}: the reduce-scatter took {rs['in_numel']} elements "
                        f"and the all-gather {ag['in_numel']}; the model has {numel} parameters, "
                        f"so the flat gradient is {numel} elements and a rank's shard {numel} / "
                        f"{n} = {shard}: flatten every gradient, all of them, into one vector")
    # 3. every step's loss on every rank, against one process training on the whole batch
    states, whole = _train_single()

    def expected(r, k, states=states, whole=whole):
        """The loss rank r may report at step k: its own rows', or the whole batch's."""
        x, y = batches[k]
        rows = _rows_of(answers[r][0]["inputs"][k], x)
        return _mse(states[k], x[rows], y[rows]), whole[k]

    def matches(r, states, whole):
        losses = answers[r][0]["losses"]
        return all(any(first_difference(got, want) is None for want in expected(r, k, states, whole))
                   for k, got in enumerate(losses))

    for r, (got, _) in enumerate(answers):
        losses = got["losses"]
        if losses is None or len(losses) != TRAIN_STEPS:
            return (f"rank {r} returned {'None' if losses is None else f'{len(losses)} losses'}: "
                    f"return this rank's losses, one a step ({TRAIN_STEPS})")
        if matches(r, states, whole):
            continue
        for variant, what in _mistaken(n):
            if matches(r, *_train_single(**variant)):
                return f"rank {r}'s losses are those of a model trained wrong: {what}"
        k = next(k for k, v in enumerate(losses)
                 if all(first_difference(v, want) is not None for want in expected(r, k)))
        mine, _ = expected(r, k)
        scaled = {n: f"N = {n} times the mean squared error of this rank's rows: the loss was "
                     f"multiplied by world_size, so the gradient zero1_step averages is N times "
                     f"too large; take the plain mean over the rows",
                  1 / n: f"1/N = 1/{n} of the mean squared error of this rank's rows: the loss was "
                         f"divided by world_size, and zero1_step divides the gradient by N again; "
                         f"the mean of the ranks' mean losses is already the whole batch's",
                  share * batches[0][1].shape[1]: "the sum of the squared errors, not their mean: "
                                                  "use mse_loss's mean (its default)"}
        ratio = next((what for f, what in scaled.items()
                      if first_difference(losses[k], f * mine) is None), None)
        if ratio:
            return f"rank {r}, step {k}: the loss is {ratio}"
        hint = ("; step 0 runs the model as given, so look at the rows and the loss" if k == 0 else
                "; the steps before it were right, so look at the update: cut zero1_step's "
                "flat result back into the parameters in the order and shapes the gradients "
                "were flattened in (model.parameters(), p.numel() each)")
        return (f"rank {r}, step {k}: loss expected {mine:g} (this rank's rows, at the "
                f"parameters one process reaches training on the whole batch), got "
                f"{losses[k]:g}{hint}")
    # 4. the final parameters on every rank: the last step's update is seen by no loss
    for r, (got, _) in enumerate(answers):
        final = got["params"]
        if all(first_difference(p, want) is None for p, want in zip(final, states[-2])):
            return (f"rank {r}'s final parameters are those before the last step: its update "
                    f"never reached the model. Write zero1_step's result back after every "
                    f"step, the last one too")
        for name, p, want in zip(names, final, states[-1]):
            wrong = first_difference(p, want, f"the final {name}")
            if wrong:
                return f"rank {r}, {wrong} (one process training on the whole batch gives the expected)"
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
