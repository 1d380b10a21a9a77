"""Preemption: the scheduler's notice turned into a checkpoint and a clean, resumable exit.

A scheduler that takes the machines back (a higher-priority job, a spot instance reclaimed)
first sends SIGTERM, then SIGKILL after a grace period: Slurm sends it at the job's end or on
preemption (``#SBATCH --signal=TERM@120`` asks for it 120 s before the time limit), torchrun's
agent passes it on to every rank and waits up to 30 s for them to exit, a Kubernetes pod gets
``terminationGracePeriodSeconds``. What is lost is what was computed since the last checkpoint,
unless the job saves on the notice.

Each rank turns SIGTERM into a flag (a Python handler: it runs between bytecodes, so a rank
inside a collective notices when the collective returns). The ranks must stop after the *same*
step, or their checkpoints would not be one state, and the signal reaches them at different
moments, some in step t and some already in step t+1. So the first rank to notice, at the end
of its step t, proposes t+1 in the run's rendezvous store (compare-and-set: the first proposal
wins); every rank reads the key at the end of each step and stops after the agreed step. A rank
of synchronous training is never more than one step ahead of another (each step has
collectives all ranks join), so t+1 is not behind anyone. The check is one store round trip
per step, made after the step's measured window.

The stopping rank writes a checkpoint of the agreed step (unless the cadence just wrote it),
waits for it, meets the others at a barrier so that no rank exits while another still writes,
reports ``preempted`` and exits with ``PREEMPTED_EXIT``. Resuming (``resume="latest"`` in the
same run directory, or ``resume=<run dir>`` from another) continues bit for bit: the data of
step s is a function of s, and the checkpoint holds the RNG states.
"""
from __future__ import annotations

import signal
import time

#: a preempted rank's exit status: sysexits.h's EX_TEMPFAIL, "temporary failure; try again"
PREEMPTED_EXIT = 75
KEY = "dlab/preempt_after_step"


class Preemption:
    """SIGTERM handler and the ranks' agreement on the step to stop after."""

    def __init__(self, attempt: int = 0):
        self.noticed: float | None = None  # wall time the signal arrived
        self.agreed: int | None = None
        self.key = f"{KEY}/{attempt}"  # a restarted attempt starts without the old notice
        import torch.distributed as dist

        self.store = dist.distributed_c10d._get_default_store()
        self.previous = signal.signal(signal.SIGTERM, self._notice)

    def _notice(self, signum, frame) -> None:
        if self.noticed is None:
            self.noticed = time.time()
            print(f"SIGTERM: this rank will stop after a step agreed with the others, write a "
                  f"checkpoint and exit with {PREEMPTED_EXIT}", flush=True)

    def stop_after(self, step: int) -> bool:
        """Called at the end of every step: True when the ranks have agreed to stop after it."""
        if self.agreed is None:
            if self.noticed is not None:
                self.agreed = int(self.store.compare_set(self.key, "", str(step + 1)))
            elif self.store.check([self.key]):
                self.agreed = int(self.store.get(self.key))
        return self.agreed is not None and step >= self.agreed

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)
