"""Command line: ``python -m dlab run|bench|check|env|strategies|corpus``."""
from __future__ import annotations

import argparse
import json
import sys

from dlab.config import ConfigError, add_arguments, from_args


def _run(args) -> int:
    from dlab.diagnose import RunFailed
    from dlab.launch import launch
    cfg = from_args(args)
    try:
        run = launch(**{k: v for k, v in cfg.to_dict().items()}, runs_dir=args.runs_dir,
                     wait=True, progress=True)
    except RunFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        return 1
    print(run.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run.summary().to_dict(), f, indent=1)
    return 0


def _bench(args) -> int:
    from dlab.bench import run_bench
    return run_bench(args.name, args.json, args.quick)


def _check(args) -> int:
    from dlab.check import main as check
    return check([*(["--quick"] if args.quick else []), *(["--json", args.json] if args.json else []),
                  "--runs-dir", args.runs_dir])


def _env(args) -> int:
    from dlab.env import format_report, report
    info = report(measure=not args.no_measure)
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0


def _strategies(args) -> int:
    from dlab import parallel
    for name in parallel.names():
        doc = " ".join((parallel.get(name).__doc__ or "").split("\n\n")[0].split())
        print(f"{name:21s} {doc}")
    return 0


def _corpus(args) -> int:
    from dlab.corpus import make_corpus
    from dlab.data import CORPUS
    CORPUS.parent.mkdir(exist_ok=True)
    CORPUS.write_text(make_corpus())
    print(f"wrote {CORPUS}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlab", description="dlab: distributed training lab")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="launch a training run and print its summary")
    add_arguments(r)
    r.add_argument("--runs-dir", default="runs")
    r.add_argument("--json", help="also write the summary to this file")
    r.set_defaults(func=_run)
    b = sub.add_parser("bench", help="run a benchmark against PyTorch's own implementation")
    b.add_argument("name", help="benchmark name (launch, ...)")
    b.add_argument("--json", help="write the rows to this file")
    b.add_argument("--quick", action="store_true", help="fewer repeats (for a smoke test)")
    b.set_defaults(func=_bench)
    c = sub.add_parser("check", help="every strategy against single on this machine's devices (GPU or CPU)")
    c.add_argument("--quick", action="store_true", help="one strategy per family, 2 ranks")
    c.add_argument("--json", help="write the rows to this file")
    c.add_argument("--runs-dir", default="runs/check")
    c.set_defaults(func=_check)
    e = sub.add_parser("env", help="backends, devices, versions and the CPU's matmul peak")
    e.add_argument("--json", action="store_true")
    e.add_argument("--no-measure", action="store_true", help="skip the matmul peak measurement")
    e.set_defaults(func=_env)
    sub.add_parser("strategies", help="list the registered strategies").set_defaults(func=_strategies)
    sub.add_parser("corpus", help="write data/corpus.txt again").set_defaults(func=_corpus)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
