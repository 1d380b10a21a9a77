"""Command line: ``python -m dlab run|bench|check|env|gpu|lab|plan|strategies|corpus|assignments``."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys

from dlab import parallel
from dlab.analysis.diagnose import RunFailed
from dlab.bench import run_bench
from dlab.cli import plan as plan_cli
from dlab.cli.env import format_report, report
from dlab.core.config import ConfigError, add_arguments, from_args
from dlab.core.disk import DISK_ERRORS, disk_error
from dlab.core.output import check_output_path, write_output
from dlab.models.corpus import make_corpus
from dlab.models.data import CORPUS
from dlab.procs.launch import launch
from dlab.runtime.preemption import PREEMPTED_EXIT
from dlab.tools.assignments import DEFAULT_OUT
from dlab.tools.assignments import main as assignments
from dlab.tools.check import main as check
from dlab.tools.gpu import schema as gpu_schema
from dlab.tools.gpu.session import STEPS as GPU_STEPS
from dlab.tools.gpu.session import run_session
from dlab.tools.jupyter import main as lab


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached the CLI; ``Run.wait`` stops the run on its way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, _frame) -> None:
    raise Interrupted(signum)


def _run(args) -> int:
    cfg = from_args(args)
    # A terminal's Ctrl-C, coreutils' timeout (SIGTERM), Slurm's cancel (SIGTERM) and a closed
    # terminal (SIGHUP) all stop the run the same way: no process is left behind.
    previous = {sig: signal.signal(sig, _raise_interrupted)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    run = None
    try:
        run = launch(**cfg.to_dict(), runs_dir=args.runs_dir, timeout=args.deadline)
        run.wait(timeout=args.deadline, progress=True)
    except RunFailed as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"\nFAILED: {e}; raise --deadline if the run needs longer", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if run is None or run.state != "preempted":
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(run.summary())
    if args.json:
        write_output(args.json, json.dumps(run.summary().to_dict(), indent=1))
    if run.state == "preempted":
        # a scheduler's wrapper requeues on this status (docs/reliability.md's Slurm recipe)
        step = next(iter(run.status().get("ranks", {}).values()), {}).get("resume_from")
        print(f"\npreempted: every rank checkpointed step {step} and stopped; go on with "
              f"--resume {run.path} (exit status {PREEMPTED_EXIT}: try again)", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


def _bench(args) -> int:
    return run_bench(args.name, args.json, args.quick)


def _check(args) -> int:
    return check([*(["--quick"] if args.quick else []), *(["--json", args.json] if args.json else []),
                  *(["--strategies", args.strategies] if args.strategies is not None else []),
                  "--runs-dir", args.runs_dir])


def _env(args) -> int:
    info = report(measure=not args.no_measure, ranks=tuple(args.ranks))
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0


def _gpu(args) -> int:
    if args.validate:
        gpu_schema.validate(args.validate)
        print(f"{args.validate}: a valid GPU session folder")
        return 0
    only = [s.strip() for s in args.steps.split(",") if s.strip()] if args.steps else None
    names = [s.name for s in GPU_STEPS]
    unknown = [s for s in only or () if s not in names]
    if unknown or only == []:
        raise ConfigError(f"--steps {args.steps!r}: name steps from {', '.join(names)}")
    if args.budget_s is not None and args.budget_s <= 0:
        raise ConfigError(f"--budget-s {args.budget_s}: give the session's seconds, > 0")
    command = "python -m dlab gpu" + "".join(
        f" {flag}" for flag, on in (("--cpu", args.cpu), ("--quick", args.quick)) if on) + (
        f" --steps {','.join(only)}" if only else "") + (
        f" --budget-s {args.budget_s:g}" if args.budget_s else "")
    folder, index = run_session(args.out, cpu=args.cpu, quick=args.quick, only=only,
                                budget_s=args.budget_s, command=command)
    problems = gpu_schema.problems(folder)
    bad = [r for r in index["steps"] if r["status"] in ("failed", "timeout")]
    print(f"\nwrote {folder}: " + ("valid" if not problems else "INVALID:\n  - " + "\n  - ".join(problems)))
    if index["cuda"]:
        print(f"commit it whole: git add {folder} && git commit -m 'GPU session: {index['device']}'")
    print(f"{len(index['steps']) - len(bad)} steps ok or skipped, {len(bad)} failed or timed out"
          + "".join(f"\n  {r['name']}: {r['why']}" for r in bad))
    return 1 if bad or problems else 0


def _lab(args) -> int:
    return lab(args.port, args.ip, args.jupyter_args)


def _assignments(args) -> int:
    return assignments(["--out", args.out])


def _strategies(args) -> int:
    for name in parallel.names():
        strategy = parallel.get(name)
        doc = " ".join((strategy.__doc__ or "").split("\n\n")[0].split())
        print(f"{name:21s} {doc}")
        for key, option in strategy.OPTIONS.items():
            print(f"{'':21s}   option {key}: {option.describe()}; {option.help}")
    return 0


def _corpus(args) -> int:
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
    r.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="wall-clock limit for the whole run (launch(timeout=)); the run is "
                        "stopped and the command fails when it passes")
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
    c.add_argument("--strategies", help="comma-separated strategies to check instead (e.g. ddp,zero3)")
    c.set_defaults(func=_check)
    g = sub.add_parser("gpu", help="a prepared session for a lent GPU: calibration, a profiled "
                                   "step, attention, matmul, the allocator, NCCL, check; writes "
                                   "data/gpu/<device>-<date>/")
    g.add_argument("--out", help="the session's folder (default data/gpu/<device>-<date>; with "
                                 "--cpu or no GPU a temporary folder)")
    g.add_argument("--cpu", action="store_true",
                   help="CPU mode even where CUDA is present: every step at CPU sizes, what needs "
                        "CUDA recorded as not measured")
    g.add_argument("--quick", action="store_true", help="fewer shapes and lengths (a smoke test)")
    g.add_argument("--steps", help=f"only these steps, comma-separated, rerun into --out keeping "
                                   f"the others' rows: {', '.join(s.name for s in GPU_STEPS)}")
    g.add_argument("--budget-s", type=float, default=None,
                   help="seconds for the whole session (default 540 on a GPU, 300 on the CPU)")
    g.add_argument("--validate", metavar="FOLDER", help="only check FOLDER against the schema")
    g.set_defaults(func=_gpu)
    e = sub.add_parser("env", help="backends, devices, versions and the CPU's matmul peak")
    e.add_argument("--json", action="store_true")
    e.add_argument("--no-measure", action="store_true", help="skip the matmul peak measurement")
    e.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8],
                   help="say what these numbers of ranks do to timings here (default 2 4 8)")
    e.set_defaults(func=_env)
    lab = sub.add_parser("lab", help="JupyterLab on notebooks/ (as root and headless too); "
                                     "prints the URL with its token")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--ip", default="127.0.0.1",
                     help="address to serve on (0.0.0.0 to reach it from outside a container)")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER,
                     help="further JupyterLab arguments, after --")
    lab.set_defaults(func=_lab)
    pl = sub.add_parser("plan", help="predict memory, step time and MFU of layouts at any scale; "
                                     "rank them")
    plan_cli.add_arguments(pl)
    pl.set_defaults(func=plan_cli.run)
    sub.add_parser("strategies", help="list the registered strategies").set_defaults(func=_strategies)
    sub.add_parser("corpus", help="write data/corpus.txt again").set_defaults(func=_corpus)
    a = sub.add_parser("assignments", help="the checked exercises as an nbgrader course: source/ "
                                           "with the solutions, release/ without (the grading extra)")
    a.add_argument("--out", default=DEFAULT_OUT, help=f"the course folder (default {DEFAULT_OUT})")
    a.set_defaults(func=_assignments)
    for command in (r, b, c, pl):  # each writes a file at --json (env's --json is a flag)
        command.set_defaults(json_is_a_path=True)
    args = p.parse_args(argv)
    try:
        if getattr(args, "json_is_a_path", False) and args.json:
            check_output_path(args.json)  # before the work, not after it
        return args.func(args)
    except (ConfigError, gpu_schema.InvalidSession) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Whoever read the output went away (``| head -1``): end quietly with the status of a
        # process that SIGPIPE ended, as other Unix tools do (a run was stopped on the way out,
        # ``Run.wait``, and reads "stopped"). Python ignores SIGPIPE, so the write raised;
        # stdout goes to /dev/null so that its flush at exit does not raise again.
        with contextlib.suppress(OSError, ValueError):  # a stdout that is no file has no flush to fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            raise
        # a full, over-quota, read-only or failing disk: said in one line, whatever wrote (what
        # was set up is removed again, and a run that had started has recorded how it ended:
        # dlab.core.disk.reserve)
        print(f"error: {disk_error(e, e.filename or 'the disk')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"\ninterrupted by {signal.Signals(signum).name}: the run was stopped and no "
              f"process is left", file=sys.stderr)
        return 128 + signum

