"""A run's summary: one row per rank, read from its metrics.

Definitions: step time and tokens/s are medians over the steps after the first (the first step
pays for lazy initialisation and is reported apart as ``first_step_s``); memory is each
category's peak over the run; communication is bytes this rank sent per step and two times
per step, each a median: ``comm_busy_s_per_step``, the union of the spans in which some
collective was in flight (the network had work), and ``comm_exposed_s_per_step``, the part of
that union no computation of the rank covered (what communication added to the step). Both are
at most the step, and exposed <= busy <= the plain sum of the ops' spans, which overlapping async
collectives (DDP's buckets) push past the step and which is therefore not shown
(``dlab.core.events.comm_times``; records written before these figures show "-"). A wait that
does not go through ``Comm`` counts as the compute span around it: PyTorch's DDP reducer
(``torch-ddp``) waits for its last buckets inside backward, so its exposed time reads low. Two byte
figures, never mixed: ``comm_sent_per_step``
(the model: the ring model for the backend's collectives, the algorithm's own count for dlab's
hand-written ones) and ``comm_wire_per_step`` (measured: bytes the rank wrote to the transport in
a step, ``dlab.comm.wire``; None where not measurable, e.g. NCCL, and the table then says so).
MFU counts the model's FLOPs, HFU the hardware's: the forwards that activation recomputation
runs again are in HFU only (``dlab.worker.train``). ``busy_s_per_step`` and ``idle_s_per_step`` are
means over the same steps (a straggler slow for a few steps must not vanish under a median):
the rank's own work and its waiting (``dlab.core.events.BUSY_KINDS``); ``stragglers()`` names the
ranks the others wait for. ``skipped_steps`` counts the steps fp16's loss scaler skipped (an inf
or NaN gradient somewhere: no rank applied the step), ``nonfinite_losses`` the steps whose loss
was NaN or inf; the notes say both where they are not zero, as a run that learns nothing must
not read like one that trained (``dlab.worker.train.learned_nothing``).
"""
from __future__ import annotations

import math
import statistics

from dlab.analysis.steps import peak_memory, steady, wire_per_step
from dlab.comm.wire import NOT_MEASURABLE

MiB = 2 ** 20


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _percent(x: float | None) -> str:
    """A utilization, or "-" where the records lack it (written before HFU was recorded)."""
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def _comm_time(steady: list[dict], key: str) -> float | None:
    times = [m["comm"].get(key) for m in steady]
    return None if None in times else _median(times)


class Summary:
    def __init__(self, name: str, state: str, rows: list[dict]):
        self.name, self.state, self.rows = name, state, rows

    @classmethod
    def of(cls, run) -> Summary:
        rows = []
        for rank in run.dir.ranks():
            ms = run.metrics(rank)
            if not ms:
                rows.append({"rank": rank, "steps": 0})
                continue
            counted = steady(ms)
            memory = peak_memory(ms)
            rows.append({
                "rank": rank, "steps": len(ms), "loss": ms[-1]["loss"],
                "first_step_s": ms[0]["step_time"],
                "step_time_s": _median([m["step_time"] for m in counted]),
                "tokens_per_s": _median([m["tokens_per_s"] for m in counted]),
                "mfu": _median([m["mfu"] for m in counted]),
                "hfu": _median([m["hfu"] for m in counted if "hfu" in m]),
                "memory": memory, "memory_total": sum(memory.values()),
                "comm_sent_per_step": _median([m["comm"]["sent_bytes"] for m in counted]),
                "comm_wire_per_step": wire_per_step(ms),
                "comm_exposed_s_per_step": _comm_time(counted, "exposed_seconds"),
                "comm_busy_s_per_step": _comm_time(counted, "busy_seconds"),
                "busy_s_per_step": _mean([m["busy_s"] for m in counted if "busy_s" in m]),
                "idle_s_per_step": _mean([m["idle_s"] for m in counted if "idle_s" in m]),
                "skipped_steps": sum(bool(m.get("skipped")) for m in ms),
                "nonfinite_losses": sum(not math.isfinite(m["loss"]) for m in ms),
                "loss_scale": ms[-1].get("loss_scale"),
            })
        return cls(run.path.name, run.state, rows)

    def to_dict(self) -> dict:
        return {"name": self.name, "state": self.state, "rows": self.rows}

    def table(self) -> tuple[list[str], list[list[str]]]:
        head = ["rank", "steps", "loss", "step ms", "busy ms", "idle ms", "tok/s", "MFU", "HFU",
                "params MiB", "grads MiB", "optim MiB", "activ MiB", "model comm MiB/step",
                "wire MiB/step (measured)", "comm exposed ms", "comm busy ms"]
        body = []
        for r in self.rows:
            if not r["steps"]:
                body.append([str(r["rank"]), "0"] + ["-"] * (len(head) - 2))
                continue
            m = r["memory"]
            body.append([str(r["rank"]), str(r["steps"]), f"{r['loss']:.4f}",
                         f"{1e3 * r['step_time_s']:.1f}", _ms(r.get("busy_s_per_step")),
                         _ms(r.get("idle_s_per_step")), f"{r['tokens_per_s']:,.0f}",
                         f"{100 * r['mfu']:.1f}%", _percent(r.get("hfu")),
                         f"{m['parameters'] / MiB:.2f}",
                         f"{m['gradients'] / MiB:.2f}", f"{m['optimizer'] / MiB:.2f}",
                         f"{m['activations'] / MiB:.2f}",
                         f"{r['comm_sent_per_step'] / MiB:.3f}",
                         "-" if r["comm_wire_per_step"] is None else f"{r['comm_wire_per_step'] / MiB:.3f}",
                         _ms(r.get("comm_exposed_s_per_step")),
                         _ms(r.get("comm_busy_s_per_step"))])
        return head, body

    def __str__(self) -> str:
        head, body = self.table()
        widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
                  for i, h in enumerate(head)]
        line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([f"{self.name}: {self.state}", line(head),
                          "  ".join("-" * w for w in widths), *map(line, body), *self.notes()])

    def stragglers(self, factor: float = 1.5) -> list[str]:
        """One sentence per rank whose own work per step is over ``factor`` times the median of
        the other ranks' and whose extra work accounts for at least half of what the others
        wait: the rank synchronous training is held back by. (The second condition keeps out a
        rank that merely has more to do, such as a parameter server's optimizer step, while it
        waits as long as everyone else.)"""
        busy = {r["rank"]: r["busy_s_per_step"] for r in self.rows if r.get("busy_s_per_step")}
        idle = {r["rank"]: r["idle_s_per_step"] for r in self.rows if r.get("busy_s_per_step")}
        out = []
        for rank, b in busy.items():
            others = [v for r, v in busy.items() if r != rank]
            typical = _median(others) if others else b
            wait = _median([idle[r] for r in busy if r != rank]) if others else 0.0
            if others and b > factor * typical and b - typical >= wait / 2:
                out.append(f"rank {rank} is a straggler: busy {1e3 * b:.0f} ms/step against "
                           f"{1e3 * typical:.0f} ms on the others, who wait {1e3 * wait:.0f} "
                           f"ms/step (it waits {1e3 * idle[rank]:.0f})")
        return out

    def notes(self) -> list[str]:
        """What the byte columns are; the wire column is blank where it cannot be measured;
        which rank, if any, the others wait for."""
        out = self.stragglers() + self.precision_notes() + [
            "model comm: ring model for the backend's collectives, the algorithm's own count "
            "for dlab's; wire: measured bytes written to the transport",
            "comm busy: time some collective was in flight (union of their spans); comm exposed: "
            "the part of it no computation of the rank covered"]
        if any(r.get("steps") and r.get("comm_wire_per_step") is None for r in self.rows):
            out.append(f"wire: {NOT_MEASURABLE}")
        return out

    def precision_notes(self) -> list[str]:
        """One sentence per rank with steps the loss scaler skipped or losses that were not
        finite (ranks take one decision and log one loss, so they read alike)."""
        out = []
        for r in self.rows:
            skipped, bad = r.get("skipped_steps", 0), r.get("nonfinite_losses", 0)
            if skipped:
                out.append(f"rank {r['rank']}: {skipped} of {r['steps']} steps skipped by the "
                           f"loss scaler (an inf or NaN gradient; the last scale "
                           f"{r.get('loss_scale'):g})")
            if bad:
                out.append(f"rank {r['rank']}: the loss was not finite at {bad} of {r['steps']} "
                           f"steps")
        return out

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head, body = self.table()
        rows = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in body)
        return (f"<b>{self.name}</b>: {self.state}<table><tr>"
                + "".join(f"<th>{h}</th>" for h in head) + f"</tr>{rows}</table>"
                + "".join(f"<small>{n}</small><br>" for n in self.notes()))
