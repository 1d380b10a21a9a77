"""The per-rank step deadline: a rank stuck where no collective can time out ends anyway.

A collective that never completes raises at the process group's deadline (``timeout_s``). A
rank stuck *outside* any collective (an endless loop, a sleep, a dead lock in user code, a
hung file system) has no such deadline; its peers then time out waiting for it and report the
symptom, while the cause stays silent. So every rank runs a watchdog thread that watches the
step in progress (``state["step"]``, set by the training loop): when one step has run longer
than ``timeout_s`` it writes the rank's report, with where the main thread is stuck (its
stack), and ends the process, which makes torchrun end the run. On a hung file system those
writes block like the main thread's: they get ``LAST_WORDS_S`` in a thread of their own, and
the process ends then whether they were written or not.

When the main thread is inside torch (its innermost Python frame is torch's), it may be
waiting on a collective - explicitly, or inside backward, where DDP's reducer waits for its
bucket all-reduces with no Python frame of ``torch.distributed`` on the stack. That
collective's own deadline comes first and gives the better error, so the watchdog then waits a
second deadline as a backstop and marks its report ``in_torch`` (a symptom for
``dlab.analysis.diagnose``, not a cause). Stuck in the user's or dlab's own Python code, the rank is the
cause, and it reports at the first deadline, before the peers waiting for it.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback

from dlab.core.disk import within

POLL_S = 0.1
#: seconds a rank's last report and log lines get before it exits anyway (a hung disk)
LAST_WORDS_S = 5.0
BACKSTOP_FACTOR, BACKSTOP_EXTRA_S = 2, 5.0  # inside torch: 2 x the deadline + 5 s


class StepWatchdog:
    def __init__(self, state: dict, deadline_s: float, writer, rank: int):
        self.state, self.deadline_s, self.writer, self.rank = state, deadline_s, writer, rank
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        import torch
        self._torch_dir = os.path.dirname(torch.__file__) + os.sep

    def start(self) -> StepWatchdog:
        threading.Thread(target=self._watch, name="dlab-step-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        step, since = self.state.get("step"), time.monotonic()
        while not self._stop.wait(POLL_S):
            now = self.state.get("step")
            if now != step:
                step, since = now, time.monotonic()
                continue
            if step is None:  # not training yet (setup, rendezvous: they have deadlines of their own)
                continue
            ran = time.monotonic() - since
            frames = self._main_stack()
            in_torch = bool(frames) and frames[-1].filename.startswith(self._torch_dir)
            limit = (self.deadline_s * BACKSTOP_FACTOR + BACKSTOP_EXTRA_S if in_torch
                     else self.deadline_s)
            if ran > limit:
                self._fire(step, ran, frames, in_torch)

    def _main_stack(self) -> list[traceback.FrameSummary]:
        frame = sys._current_frames().get(self._main)
        return traceback.extract_stack(frame) if frame is not None else []

    def _fire(self, step: int, ran: float, frames, in_torch: bool) -> None:
        where = _where(frames)
        place = ("inside torch (waiting on a collective, or an operation that never returned)"
                 if in_torch else "outside any collective")
        # The message avoids the words dlab.analysis.diagnose reads as "a peer went away": this rank is
        # the cause unless it is waiting in a collective itself.
        message = (f"step {step} has run {ran:.1f} s, past the run's deadline of "
                   f"{self.deadline_s:g} s, {place}; the main thread is stuck at {where}")
        hint = (f"the step ran past the deadline (timeout_s={self.deadline_s:g} s) {place}: "
                f"look at the stack for the line that never returns; raise timeout_s if the "
                f"step is just slow.")
        stack = "".join(traceback.format_list(frames))

        def last_words() -> None:
            # the report first: it is what the launcher reads; the log after it
            try:
                self.writer.report(ok=False, step=step, exception="StepDeadline",
                                   message=message, hint=hint, in_torch=in_torch,
                                   traceback="Main thread (most recent call last):\n" + stack)
            finally:
                print(f"dlab watchdog: {message}\nmain thread:\n{stack}", file=sys.stderr,
                      flush=True)
                faulthandler.dump_traceback(all_threads=True)

        # A hung file system (the very thing that may have stuck the main thread) blocks these
        # writes too: they get LAST_WORDS_S, and the process ends at its deadline regardless.
        with contextlib.suppress(BaseException):
            within(LAST_WORDS_S, last_words)
        os._exit(1)


def _where(frames) -> str:
    """The innermost frame of the user's or dlab's code (not the standard library's)."""
    for f in reversed(frames):
        if "/lib/python" not in f.filename or "site-packages/dlab" in f.filename:
            return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
    f = frames[-1] if frames else None
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" if f else "an unknown place"
