"""What a resume restores, looked at on the ranks right after the load, before any step: every
parameter and every optimizer moment equal to the checkpoint's (the parameters a ZeRO shard
boundary cuts included), the 16-bit working copy equal to those fp32 values rounded once, and
fp16's loss scaler as it was saved, for every ZeRO stage of ``zero1..3`` and of ``nd``, in
every precision, and for ``single``.

One checkpoint serves every case: ``nd`` dp2 ZeRO-1 in fp16 with Adam, three steps at a rate
that overflows once (so its scaler's state is not the initial one), written on the ranks by the
``Checkpointer`` the training loop uses. Each case then builds its strategy on the same two
ranks and resumes through the worker's own ``_resume``; its state, saved again
(``checkpoint_state``) and put together from both ranks (``merge``), must hold the checkpoint's
tensors bit for bit. The oracle is the checkpoint as written by another strategy, not the
loader's own save: a loader that drops a cut parameter's moments, or a working copy not derived
from the masters, shows as a difference. This module imports nothing from the tests' helpers,
so its function can run on the ranks."""
from __future__ import annotations

import torch

import dlab
from dlab.core.config import RunConfig

GPT = {"model": "gpt", "batch_size": 8, "optimizer": "adam", "lr": 0.3, "steps": 6,
       "model_options": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}}
WRITER = ("nd", {"dp": 2, "zero": 1, "precision": "fp16"})
SAVED_AT = 3
#: (strategy, options): every ZeRO stage of both families, each precision, and single
CASES = [
    ("zero1", {}),
    ("zero2", {"mixed_precision": True}),
    ("zero3", {"mixed_precision": True}),
    ("nd", {"dp": 2, "zero": 0, "precision": "bf16"}),
    ("nd", {"dp": 2, "zero": 1, "precision": "fp16"}),
    ("nd", {"dp": 2, "zero": 2, "precision": "bf16-fp32-grads"}),
    ("nd", {"dp": 2, "zero": 3, "precision": "bf16"}),
    ("single", {"precision": "bf16"}),
]


def _build(name: str, options: dict, **fields):
    import torch.distributed as dist

    from dlab import parallel
    from dlab.comm.instrumented import Comm
    from dlab.core.events import Timeline
    from dlab.parallel.base import Context

    cfg = RunConfig(strategy=name, world_size=dist.get_world_size(), options=options,
                    **{**GPT, **fields})
    ctx = Context(cfg, dist.get_rank(), cfg.world_size, 0, torch.device("cpu"), Timeline(), Comm())
    strategy = parallel.get(name)(ctx)
    strategy.setup()
    return cfg, strategy


def working_pieces(strategy) -> list[tuple[str, int, torch.Tensor]]:
    """``(parameter name, flat offset, run of elements)`` of the copy the model computes with,
    wherever this rank holds it: whole parameters (``single``, ``nd`` ZeRO 0, the replica
    ZeRO 1-2 keep between steps) and owned chunks (every ZeRO stage's shard)."""
    if hasattr(strategy, "shardings"):  # nd
        out = []
        for s in strategy.shardings:
            out += [(n, 0, p.detach().reshape(-1)) for n, p in s.named] if not s.units else []
            out += _unit_pieces(s.units)
        return out
    if hasattr(strategy, "units"):  # zero1..3
        return _unit_pieces(strategy.units)
    return [(n, 0, p.detach().reshape(-1)) for n, p in strategy.model.named_parameters()]


def _unit_pieces(units) -> list[tuple[str, int, torch.Tensor]]:
    out = []
    for u in units:
        out += [(s.name, start, u.shard[at:at + n]) for s, start, at, n in u.owned_cuts()]
        if u.gathered:
            out += [(s.name, 0, u.flat[s.offset:s.offset + s.numel]) for s in u.slots]
    return out


def resumed_state(root: str) -> dict:
    """On each rank: write the checkpoint (``WRITER`` for ``SAVED_AT`` steps), then for every
    case build the strategy, resume it and compare what it holds with the checkpoint; returns
    ``{"cut": names the shard boundary cuts, "problems": {case: [what differs]}}``."""
    import torch.distributed as dist

    from dlab.core.rundir import RunDir
    from dlab.models.data import make_data
    from dlab.runtime import checkpoint, checkpoint_load
    from dlab.worker.main import _resume

    rank = dist.get_rank()
    cfg, writer = _build(*WRITER)
    data = make_data(cfg)
    for step in range(SAVED_AT):
        writer.step(data.global_batch(step))
    run = RunDir(root)
    checkpoint.Checkpointer(run / "checkpoints", rank, cfg.world_size,
                            meta=checkpoint.run_meta(cfg)).save(writer, SAVED_AT)
    dist.barrier()
    path = checkpoint.latest(run / "checkpoints")
    saved = checkpoint_load.Reader(path)
    both = [set(s["params"]) for s in saved.states.values()]
    cut = sorted(set.intersection(*both)) if len(both) > 1 else []
    problems = {}
    for name, options in CASES:
        cfg, strategy = _build(name, options, resume=str(path))
        found = []
        if _resume(cfg, run, strategy, rank, 0) != SAVED_AT:
            found.append("resumed at another step")
        found += _differences(strategy, saved)
        if strategy.scaler is not None and strategy.scaler.state_dict() != saved.scaler():
            found.append(f"loss scaler {strategy.scaler.state_dict()} != saved {saved.scaler()}")
        problems[f"{name} {options}"] = found
    return {"cut": cut, "scaler": saved.scaler(), "problems": problems}


def _differences(strategy, saved) -> list[str]:
    """What ``strategy`` holds that is not the checkpoint's: its state saved again from every
    rank, put together, against the saved tensors (bit for bit), and its working copy against
    the saved fp32 values rounded to the working dtype."""
    import torch.distributed as dist

    from dlab.runtime import checkpoint

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, strategy.checkpoint_state())
    held = checkpoint.merge(gathered)
    out = []
    for name in sorted(held["params"]):
        if not torch.equal(held["params"][name]["data"], saved.tensor("params", name).reshape(-1)):
            out.append(f"parameter (fp32 master) {name}")
        for key, value in held["optim"][name].items():
            want = saved.tensor("optim", name, key)
            got = value if isinstance(value, torch.Tensor) else value["data"]
            if not torch.equal(got.reshape(-1), want.reshape(-1).to(got.dtype)):
                worst = (got.reshape(-1).double() - want.reshape(-1).double()).abs().max().item()
                out.append(f"optimizer {name}/{key} (off by up to {worst:.3g})")
    for name, start, run in working_pieces(strategy):
        want = saved.tensor("params", name).reshape(-1)[start:start + run.numel()].to(run.dtype)
        if not torch.equal(run, want):
            out.append(f"working copy ({run.dtype}) of {name}[{start}:{start + run.numel()}] is "
                       f"not the saved fp32 value rounded")
    return out


def test_a_resume_restores_every_moment_master_working_copy_and_scale(runs_dir, tmp_path):
    """Every case, on both ranks: nothing differs from the checkpoint. The checkpoint has
    parameters a shard boundary cuts (pieces in both ranks' files) and a loss scale the run
    lowered, so the cases look at what a careless loader loses."""
    results = dlab.spawn(resumed_state, 2, str(tmp_path / "written"), runs_dir=runs_dir,
                         timeout_s=120)
    first = results[0]
    assert first["cut"], "no parameter straddles the two ranks' chunks: the case tests no cut"
    assert first["scaler"]["scale"] < 2.0 ** 16 and first["scaler"]["skipped"] >= 1, first["scaler"]
    assert set(first["problems"]) == {f"{n} {o}" for n, o in CASES}
    for rank, result in enumerate(results):
        bad = {case: found for case, found in result["problems"].items() if found}
        assert not bad, f"rank {rank}: " + "; ".join(f"{c}: {f[:4]}" for c, f in bad.items())

