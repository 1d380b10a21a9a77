"""``python -m dlab plan``: one layout's breakdown, or every layout ranked; the published rows;
a calibration of this machine.

    python -m dlab plan --model llama3-70b --cluster h100-sxm --gpus 1024 --seq 8192 --batch 1024
    python -m dlab plan --model llama3-70b --gpus 1024 --stack torchtitan-fsdp2 \
        --layout tp=8,pp=8,zero=1,virtual_stages=5,schedule=interleaved
    python -m dlab plan --model config.json --cluster profile.json --gpus 8 --layout zero=3
    python -m dlab plan --published     # the published configurations beside their predictions
    python -m dlab plan calibrate --out profile.json   # measure this machine (CPU or GPU)

Every number it is given is checked before any work (``check_arguments``): a batch, a
sequence, a GPU count, a degree or a row count below 1 is refused with what to change.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

from dlab.core.config import ConfigError
from dlab.core.output import write_output
from dlab.theory.plan import clusters, models, published, stacks
from dlab.theory.plan.layout import PlanLayout
from dlab.theory.plan.predict import PlanError, plan
from dlab.theory.plan.ranges import step_range
from dlab.theory.plan.search import pareto, search
from dlab.tools import device_profile

GB = 1e9


def add_arguments(p) -> None:
    p.add_argument("action", nargs="?", choices=("calibrate",),
                   help="calibrate: measure this machine's kernels and collectives into a cluster "
                        "profile (--out) that --cluster reads")
    p.add_argument("--model", default="llama3-70b",
                   help=f"a preset ({', '.join(models.PRESETS)}) or a Hugging Face style config.json")
    p.add_argument("--cluster", default="h100-sxm",
                   help=f"a preset ({', '.join([*clusters.PRESETS, 'this-machine'])}) or a cluster "
                        f"profile (JSON) written by python -m dlab plan calibrate")
    p.add_argument("--stack", default=stacks.DEFAULT,
                   help=f"the software stack: {', '.join(stacks.PRESETS)}")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to lay out (default: the layout's product)")
    p.add_argument("--seq", type=int, default=8192, help="sequence length")
    p.add_argument("--batch", type=int, default=1024, help="global batch in sequences")
    p.add_argument("--layout", help="one layout, e.g. tp=8,pp=4,zero=1,sequence_parallel=1,"
                                    "recompute=selective (nd's option names); "
                                    "its breakdown instead of the ranked table")
    p.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    p.add_argument("--pareto", action="store_true", help="print the memory/time Pareto front too")
    p.add_argument("--json", help="write the rows (or the profile's fields) to this file")
    p.add_argument("--published", action="store_true",
                   help="instead: every published configuration (dlab.plan.published) beside its "
                        "prediction, scored leave-one-source-out")
    p.add_argument("--record-blind", metavar="KEYS",
                   help="with --published: write these sources' scores (comma-separated keys) as "
                        "their blind scores at the checkout's commit (once per source; the "
                        "checkout must be committed)")
    p.add_argument("--out", default="cluster-profile.json",
                   help="calibrate: where to write the cluster profile")
    p.add_argument("--quick", action="store_true", help="calibrate: fewer shapes and repeats")
    p.add_argument("--ranks", type=int, default=2,
                   help="calibrate: ranks to time the collectives over (1: none)")


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: the layout fields that are degrees or counts: each a whole number >= 1
COUNTS = ("dp", "pp", "tp", "cp", "ep", "micro_batch", "virtual_stages", "recompute_every", "ulysses")


def parse_layout(text: str) -> PlanLayout:
    # microbatches follows from --batch (PlanLayout.for_batch)
    fields = {f.name: f.type for f in dataclasses.fields(PlanLayout) if f.name != "microbatches"}
    values = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ConfigError(f"--layout item {item!r}: use key=value with key one of {', '.join(fields)}")
        kind, val = fields[key], val.strip()
        if kind in ("bool", bool):
            if val.lower() not in TRUE + FALSE:
                raise ConfigError(f"--layout {key}={val!r}: {key} is on or off; write {key}=1 or {key}=0")
            values[key] = val.lower() in TRUE
            continue
        try:
            values[key] = int(val) if kind in ("int", int) else val
        except ValueError:
            raise ConfigError(f"--layout {key}={val!r}: {key} takes a whole number") from None
        if key in COUNTS and values[key] < 1:
            raise ConfigError(f"--layout {key}={values[key]}: {key} is a degree or a count; give a "
                              f"whole number >= 1 ({key}=1 leaves that dimension out)")
        if key in ("zero", "zero_group") and values[key] < 0:
            raise ConfigError(f"--layout {key}={values[key]}: give 0 or more")
    return PlanLayout(**values)


def check_arguments(args) -> None:
    """Refuse nonsense before any work: what is a count must be one."""
    for flag, value in (("--seq", args.seq), ("--batch", args.batch), ("--top", args.top),
                        ("--ranks", args.ranks)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: give a whole number >= 1")
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: give the number of GPUs, a whole number >= 1")
    if args.stack not in stacks.PRESETS:
        raise ConfigError(f"--stack {args.stack!r}: choose one of {', '.join(stacks.PRESETS)}")
    if args.action == "calibrate":
        folder = Path(args.out).resolve().parent
        if Path(args.out).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"--out {args.out}: give a file in a folder that exists and can be "
                              f"written, e.g. --out profile.json")


def _presets(args):
    try:
        return models.preset(args.model), clusters.preset(args.cluster), stacks.preset(args.stack)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _line(p) -> str:
    t = p.time
    comm = sum(v for k, v in t.items() if k.endswith("_comm"))
    return (f"{p.layout.describe():<52} {t['total']:8.2f} {p.mfu:6.1%} {p.memory['total'] / GB:7.1f} "
            f"{'yes' if p.fits else 'no':>4} {t['compute'] + t['recompute']:8.2f} {comm:7.2f} "
            f"{t['bubble'] + t.get('idle_cores', 0.0):7.2f}")


def _ranged(p) -> str:
    low, high = step_range(p)
    return f"{_line(p)}   {low:6.2f}-{high:<6.2f}"


HEADER = (f"{'layout':<52} {'step s':>8} {'MFU':>6} {'mem GB':>7} {'fits':>4} "
          f"{'compute':>8} {'comm':>7} {'idle':>7}   {'step range s':>13}")


def run(args) -> int:
    check_arguments(args)
    if args.action == "calibrate":
        return _calibrate(args)
    if args.published:
        results = published.check()
        print(published.table(results))
        if args.record_blind:
            _record_blind(results, args.record_blind)
        print("\nblind (each source's first score, before anything was changed with it in view) "
              "and now:")
        print(published.blind_table(results))
        rows = results
    else:
        try:
            rows = _plan(args)
        except PlanError as e:  # a model or layout the planner cannot take: one line, exit 2
            raise ConfigError(str(e)) from None
    if args.json:
        write_output(args.json, json.dumps(rows, indent=1))
    return 0


def _record_blind(results, keys: str) -> None:
    """Record ``keys``' scores as blind at HEAD, refusing a checkout whose planner differs from
    HEAD (the commit must be what was scored)."""
    root = Path(published.__file__).resolve().parents[3]
    changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "dlab"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if changed:
        raise ConfigError(f"--record-blind: dlab/ has uncommitted changes ({changed.splitlines()[0]} "
                          f"...); commit them first so that the recorded commit is what was scored")
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    try:
        published.record_blind(results, [k.strip() for k in keys.split(",") if k.strip()], commit)
    except ValueError as e:
        raise ConfigError(f"--record-blind: {e}") from None
    print(f"recorded {keys} as blind at {commit[:12]} in {published.BLIND}")


def _calibrate(args) -> int:
    measured = device_profile.profile(args.out, quick=args.quick, ranks=args.ranks)
    print(device_profile.describe(measured))
    if args.json:
        write_output(args.json, json.dumps(measured, indent=1))
    print(f"wrote {args.out}: python -m dlab plan --cluster {args.out} --model ... reads it")
    return 0


def _plan(args) -> list[dict]:
    spec, cluster, stack = _presets(args)
    print(f"stack {stack.describe()}")
    if args.layout:
        lay = parse_layout(args.layout)
        if args.gpus and "dp=" not in args.layout:  # dp takes what the others leave
            rest = lay.tp * lay.pp * lay.cp
            if args.gpus % rest:
                raise ConfigError(f"tp x pp x cp = {rest} does not divide --gpus {args.gpus}")
            lay = dataclasses.replace(lay, dp=args.gpus // rest)
        if args.gpus and lay.world != args.gpus:
            raise ConfigError(f"the layout takes {lay.world} GPUs, not --gpus {args.gpus}; leave dp "
                              f"out to let it take the rest")
        p = plan(spec, cluster, lay, args.batch, args.seq, stack)
        low, high = step_range(p)
        print(f"{spec.name} on {lay.world} x {cluster.name}, batch {args.batch} x {args.seq} tokens")
        print(f"layout {lay.describe()}: {p.step_s:.3f} s/step (range {low:.3f}-{high:.3f}), "
              f"{p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%} ({p.mfu * p.step_s / high:.1%}-"
              f"{p.mfu * p.step_s / low:.1%}), HFU {p.hfu:.1%}")
        print("memory per GPU: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in p.memory.items()
                                             if k != "pp_rank")
              + f" ({'fits' if p.fits else 'does not fit'} in {p.capacity / GB:.0f} GB)")
        print("time per step:  " + ", ".join(f"{k} {v:.3f} s" for k, v in p.time.items()))
        print("sent per step:  " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in p.sent.items()))
        print("assumed: " + "; ".join(p.assumptions))
        rows = [{**p.row(), "step_low_s": low, "step_high_s": high}]
    else:
        if not args.gpus:
            raise ConfigError("--gpus N is needed to search (or give one --layout)")
        start = time.perf_counter()
        preds = search(spec, cluster, args.gpus, args.batch, args.seq, stack=stack)
        took = time.perf_counter() - start
        if not preds:
            raise ConfigError(f"no layout of {spec.name} takes {args.gpus} GPUs at batch {args.batch}; "
                              f"try a batch that is a multiple of the GPU count")
        fit = [p for p in preds if p.fits]
        print(f"{spec.name} on {args.gpus} x {cluster.name}, batch {args.batch} x {args.seq} tokens: "
              f"{len(preds)} layouts in {took:.2f} s, {len(fit)} fit")
        if cluster.notes:
            print("assumed: " + "; ".join(cluster.notes))
        print(HEADER)
        for p in preds[:args.top]:
            print(_ranged(p))
        if args.pareto:
            print("\nPareto front (memory against time, among those that fit):")
            for p in pareto(fit):
                print(_line(p))
        rows = [p.row() for p in preds]
    return rows
