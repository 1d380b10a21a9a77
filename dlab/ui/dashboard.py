"""The live dashboard: one widget, displayed once and updated in place while a run goes.

It reads only the run directory (metrics and timeline JSON lines, the ranks' reports), so the
same widget follows a run this kernel launched, replays a finished one, or follows a run that
torchrun or Slurm started elsewhere on a shared file system (``watch(dlab.attach(path))``).
The charts are a matplotlib figure (``dlab.ui.plots.draw_run``) rendered to PNG into an
``ipywidgets.Image``: no browser-side plotting library, and the figure is the same one
``dlab.ui.plots.plot`` draws after the fact.

``watch`` blocks the cell until the run ends (that is what ``launch(..., dashboard=True)`` does),
so the cell can raise the failing rank's error and then show the summary. The catch: while a
cell runs, the kernel does not handle the widget messages the browser sends, so a plain
button click would only arrive after the run. How the Stop button works anyway: in
ipykernel 7 (7.4 tested) a separate thread receives every shell message and asks the target comm where
to route it (``Comm._reply_subshell_for``); the dashboard hooks that question on its Stop
button's comm, so the click is noticed on that thread the moment it arrives and the watching
loop (which polls a ``threading.Event``) stops the run within one poll. The message itself is
then delivered normally once the cell ends, where a second stop is a no-op. On an older
kernel the hook is absent; the status line then says to use the kernel's interrupt (the
toolbar's stop square), which ``watch`` turns into stopping every rank.
We chose this over the two alternatives: replaying the kernel's queued shell messages by hand
(fragile: it reorders execute requests), and returning from the cell with a background thread
(the cell could no longer raise the run's error or end with its summary).
"""
from __future__ import annotations

import html
import threading
import time

import ipywidgets as widgets
from IPython.display import display

from dlab.core.rundir import JsonlTail
from dlab.ui.figure import new_figure, png
from dlab.ui.plots import as_run, draw_run, is_pipeline

STATE_COLORS = {"running": "#1f77b4", "ok": "#2ca02c", "failed": "#d62728", "stopped": "#ff7f0e",
                "timeout": "#d62728", "interrupted": "#ff7f0e", "lost": "#7f7f7f"}


def _hear_clicks_while_busy(button: widgets.Button, clicked: threading.Event) -> bool:
    """Set ``clicked`` as soon as the frontend's click message reaches the kernel, even while
    the main thread is busy in a cell (see the module docstring). False where the kernel
    offers no such hook (no kernel, or an ipykernel without it; 7.4 has it and is tested)."""
    comm = getattr(button, "comm", None)
    route = getattr(comm, "_reply_subshell_for", None)
    if route is None:
        return False

    def hear(data, default):
        if isinstance(data, dict) and data.get("method") == "custom" and \
                (data.get("content") or {}).get("event") == "click":
            clicked.set()
        return route(data, default)

    comm._reply_subshell_for = hear
    return True


class Dashboard:
    """Live charts of a run. ``update()`` reads what the ranks wrote since the last call and
    redraws; ``widget`` is what a notebook shows. Works without a kernel too (tests, replays
    in scripts): the figure is in ``figure`` and the PNG in ``image.value``."""

    def __init__(self, run, dpi: int = 72):
        self.run = as_run(run)
        self.dpi = dpi
        self.ranks = self.run.dir.ranks()
        self.metrics: dict[int, list[dict]] = {r: [] for r in self.ranks}
        self.events: list[dict] = []
        self._metric_tails = {r: JsonlTail(self.run.dir.metrics_file(r)) for r in self.ranks}
        self._event_tails = {r: JsonlTail(self.run.dir.timeline_file(r)) for r in self.ranks}
        self.started = time.monotonic()
        self.stop_requested = threading.Event()
        self.figure = new_figure(figsize=(12, 6.2))

        self.status = widgets.HTML()
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                          tooltip="end every rank of this run",
                                          layout=widgets.Layout(width="90px"))
        self.stop_button.on_click(lambda _: self.request_stop())
        self.live_stop = _hear_clicks_while_busy(self.stop_button, self.stop_requested)
        self.log_choice = widgets.Dropdown(options=[("logs: none", -1)] + [
            (f"logs: rank {r}", r) for r in self.ranks], value=-1,
            layout=widgets.Layout(width="140px"))
        self.log_choice.observe(lambda _: self.show_log(), names="value")
        self.log_view = widgets.HTML()
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.widget = widgets.VBox([widgets.HBox([self.stop_button, self.log_choice, self.status]),
                                    self.image, self.log_view])

    def _ipython_display_(self) -> None:
        display(self.widget)

    # --- reading and drawing ------------------------------------------------------------------
    def poll(self) -> bool:
        """Take in what the ranks wrote since the last call; True if anything was new."""
        new = False
        for r in self.ranks:
            records = self._metric_tails[r].read()
            events = self._event_tails[r].read()
            kept = self.metrics[r]
            for m in records:
                # After a restart the ranks redo the steps since the last checkpoint: the new
                # attempt's records replace the old ones (as ``RunDir.metrics`` keeps them).
                while kept and kept[-1]["step"] >= m["step"]:
                    kept.pop()
                kept.append(m)
            self.events += [dict(e, rank=r) for e in events]
            new = new or bool(records or events)
        return new

    def render(self) -> None:
        if is_pipeline(self.events) and self.figure.get_figheight() < 9:
            self.figure.set_figheight(9)
        draw_run(self.figure, self.metrics, self.events, self.run.path.name, self.run.config)
        self.image.value = png(self.figure, self.dpi)

    def update(self, force: bool = False) -> None:
        """Read, redraw if there is anything new (or ``force``), refresh the status line."""
        if self.poll() or force or not self.image.value:
            self.render()
        self.status.value = self.status_line()
        if self.run.state != "running" or self.run.proc is None:
            self.stop_button.disabled = True

    def status_line(self) -> str:
        state = self.run.state
        steps = self.run.config.get("steps", "?")
        latest = [m[-1] for m in self.metrics.values() if m]
        parts = [f"<b style='color:{STATE_COLORS.get(state, '#333')}'>{state}</b>",
                 html.escape(self.run.path.name)]
        if latest:
            step = min(m["step"] for m in latest) + 1
            parts += [f"step {step}/{steps}", f"loss {latest[0]['loss']:.4f}",
                      f"{sum(m['tokens_per_s'] for m in latest) / len(latest):,.0f} tok/s (mean of ranks)"]
        elif state == "running":
            parts.append("starting ranks (torchrun rendezvous, imports)")
        if state == "running":
            parts.append(f"{time.monotonic() - self.started:.0f} s")
            if self.run.proc is None:
                parts.append("started elsewhere: stop it where it was started")
            elif not self.live_stop:
                parts.append("to stop: interrupt the kernel")
        return "<span style='font-family:monospace'>" + " &nbsp;|&nbsp; ".join(parts) + "</span>"

    def show_log(self, lines: int = 40) -> None:
        r = self.log_choice.value
        if r < 0:
            self.log_view.value = ""
            return
        tail = "\n".join(self.run.logs(r).rstrip().splitlines()[-lines:]) or "(empty)"
        self.log_view.value = (f"<div>last {lines} lines of {html.escape(str(self.run.dir.log_file(r)))}"
                               f"</div><pre style='max-height:300px;overflow:auto;font-size:11px'>"
                               f"{html.escape(tail)}</pre>")

    def request_stop(self) -> None:
        self.stop_requested.set()
        if self.run.state == "running":
            self.run.stop(reason="stopped")
        self.update()


def show(run) -> Dashboard:
    """A replay: the dashboard of a finished run (or of a live one, as it is now)."""
    dash = Dashboard(run)
    dash.update(force=True)
    return dash


def watch(run, timeout: float | None = None, poll: float = 0.25, redraw: float = 1.5):
    """Show the live dashboard and block until the run ends, then show its summary.

    The run is supervised by its own ``Run.wait`` (the one loop: a failed rank, torchrun's
    restarts under ``max_restarts``, a timeout and an interrupt are handled there alike); the
    dashboard only redraws every ``redraw`` seconds and hands over its Stop button. Raises the
    run's ``RunFailed`` (the failing rank, its exception and the tail of its traceback) after
    showing the summary, and ``TimeoutError`` after ``timeout`` seconds (the run is stopped
    first). Returns the ``Run``."""
    dash = Dashboard(run)
    run = dash.run
    display(dash)
    dash.update(force=True)
    drawn = [time.monotonic()]

    def redraw_now(_records) -> None:
        if time.monotonic() - drawn[0] > redraw:
            dash.update()
            drawn[0] = time.monotonic()

    try:
        run.wait(timeout=timeout, poll=poll, on_poll=redraw_now,
                 stop_requested=dash.stop_requested.is_set)
    except (KeyboardInterrupt, TimeoutError):
        dash.update(force=True)
        raise
    except BaseException:  # the run failed: its summary, then the failure
        dash.update(force=True)
        display(run.summary())
        raise
    dash.update(force=True)
    display(run.summary())
    return run
