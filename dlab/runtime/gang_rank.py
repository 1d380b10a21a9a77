"""The rank side of the gang drill (``dlab.procs.gang``): ``python -m dlab.runtime.gang_rank
--run-dir R --port P --rank r --world N --timeout T``.

It does what every rank of a statically sized job does first: it joins the rendezvous store,
counts itself in (``ARRIVED``, the roll call torch's own store-based barrier and torchrun's
rendezvous keep), and calls ``init_process_group`` for a world of N with a timeout of T
seconds. If a rank of the N never comes, the group cannot form: Gloo reads its peers' addresses
from the store one at a time, waiting up to T seconds for each, and raises at the missing one.
The rank then writes what it saw to ``R/gang/rank{r}.json`` (when it entered, how long it
waited, how many ranks the store counted, torch's own error) and exits with status 1; a rank
whose group formed reports that and exits 0.
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from dlab.core.disk import write_json
from dlab.core.rundir import RunDir

#: the store key every rank adds 1 to before it asks for the process group
ARRIVED = "gang/arrived"


def join(store: dist.Store, rank: int, world: int, timeout_s: float) -> dict:
    """Count this rank in, ask for the process group, and say what happened."""
    entered = time.time()
    store.add(ARRIVED, 1)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the drill's lesson is this error: it is the report
        failed = time.time()
        arrived = store.add(ARRIVED, 0)  # adding 0 reads the count
        return {"rank": rank, "entered": entered, "ended": failed, "formed": False,
                "arrived": arrived,
                "error": (f"{arrived} of {world} ranks arrived, {world - arrived} missing; torch "
                          f"said: {type(e).__name__}: {str(e).splitlines()[0]}")}
    formed = time.time()
    dist.destroy_process_group()
    return {"rank": rank, "entered": entered, "ended": formed, "formed": True,
            "arrived": store.add(ARRIVED, 0), "error": ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlab.runtime.gang_rank", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--port", type=int, required=True, help="the rendezvous store's port (127.0.0.1)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="the job's size: every rank it waits for")
    p.add_argument("--timeout", type=float, required=True, help="seconds to wait for the group")
    args = p.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False,
                          timeout=timedelta(seconds=args.timeout))
    report = join(store, args.rank, args.world, args.timeout)
    run = RunDir(args.run_dir)
    (run / "gang").mkdir(exist_ok=True)
    write_json(run / f"gang/rank{args.rank}.json", report)
    waited = report["ended"] - report["entered"]
    print(f"rank {args.rank}: " + (f"no process group after {waited:.1f} s: {report['error']}"
                                   if report["error"] else f"the process group formed after {waited:.1f} s"),
          flush=True)
    return 0 if report["formed"] else 1


if __name__ == "__main__":
    sys.exit(main())
