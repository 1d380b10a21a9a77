"""Pictures of an algorithm from its real trace: which partial sum every rank holds after
every step (``report.holdings``), one panel per step, ranks as rows and chunks as columns.
A cell's shade is how many ranks' contributions it holds (dark: all N, the finished sum); its
label lists them; arrows of the step are listed under the panel."""
from __future__ import annotations

from dlab.comm.algorithms.report import Report, holdings, merged_trace
from dlab.ui.figure import new_figure


def _label(ranks: frozenset[int], n: int) -> str:
    if len(ranks) == n:
        return "all"
    return "+".join(str(r) for r in sorted(ranks))


def plot_holdings(reports: list[Report], title: str = "", max_panels: int = 12, width: float = 2.2):
    """The figure of ``reports`` (every rank's, of one run of an algorithm)."""
    h = holdings(reports)
    n, chunks = reports[0].world_size, reports[0].chunks
    steps = list(range(len(h)))
    if len(steps) > max_panels:  # keep the first and last steps, which show the shape
        steps = steps[:max_panels // 2] + steps[-(max_panels - max_panels // 2):]
    by_step: dict[int, list] = {}
    for t in merged_trace(reports):
        by_step.setdefault(t.step, []).append(t)
    fig = new_figure(figsize=(width * len(steps), 0.45 * n + 1.6))
    axes = fig.subplots(1, len(steps), squeeze=False)
    for ax, s in zip(axes[0], steps, strict=True):
        grid = [[len(h[s][r][c]) for c in range(chunks)] for r in range(n)]
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=n * 1.2, aspect="auto")
        if chunks <= 8:
            for r in range(n):
                for c in range(chunks):
                    ax.text(c, r, _label(h[s][r][c], n), ha="center", va="center", fontsize=7,
                            color="white" if len(h[s][r][c]) == n else "black")
        ax.set_xticks(range(chunks) if chunks <= 16 else [])
        ax.set_yticks(range(n))
        ax.set_title("start" if s == 0 else f"after step {s - 1}", fontsize=8)
        moves = sorted({(t.src, t.dst) for t in by_step.get(s - 1, [])})
        shown = ", ".join(f"{a}>{b}" for a, b in moves[:6]) + (" ..." if len(moves) > 6 else "")
        ax.set_xlabel(shown, fontsize=7)
    axes[0][0].set_ylabel("rank")
    fig.suptitle(title or reports[0].algorithm, fontsize=10)
    return fig
