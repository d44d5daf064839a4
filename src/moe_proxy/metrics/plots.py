"""PNG plots of training curves, several runs overlaid per metric, failure onsets marked.
Takes plain data (anything shaped like `Curves`, e.g. compare.Run); matplotlib loads on use."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol


class Curves(Protocol):
    """One run's curves: per step, metric -> value; and the step of each failure onset."""

    name: str
    rows: dict[int, dict[str, float]]
    onsets: dict[str, int]


def log_scale(values: list[float]) -> bool:
    """A curve that spans more than two decades, all positive, reads on a log scale."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > 100


def plot_curves(runs: list[Curves], metrics: list[str], out_dir: Path, name: str = "curves.png",
                notes: dict[str, str] | None = None) -> list[Path]:
    """One panel per metric (`notes`: metric -> a word on its title, e.g. its unit)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    if not metrics:
        return []
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes.flat, metrics):
        shown: list[float] = []
        for i, run in enumerate(runs):
            steps = [s for s, m in run.rows.items() if metric in m]
            values = [run.rows[s][metric] for s in steps]
            shown += [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            colour = colours[i % len(colours)]
            style = ("-", "--", "-.")[(i // len(colours)) % 3]  # more runs than colours: vary the line
            ax.plot(steps, values, label=run.name, color=colour, ls=style, lw=2.2 if i == 0 else 1.2,
                    alpha=1.0 if i == 0 else 0.85)
            for sig, step in run.onsets.items():  # dotted line at each failure onset, named in the legend
                ax.axvline(step, color=colour, ls=":", lw=1, label=f"{sig} onset ({run.name})")
        ax.set_title(metric + (f" ({notes[metric]})" if metric in (notes or {}) else ""), fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if log_scale(shown):
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # a flat curve reads 0.5, not 1e-9 + 0.4999
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    legend: dict[str, object] = {}  # every run and onset line once, from whichever panel has it
    for ax in axes.flat[:len(metrics)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    columns = min(len(legend), 4)
    fig.legend(list(legend.values()), list(legend), loc="upper center", ncol=columns, fontsize=8)
    # Leave the legend its own band: about 0.2 inch per legend row, whatever the number of entries.
    legend_inches = 0.15 + 0.2 * math.ceil(len(legend) / columns)
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_inches / fig.get_figheight()))
    path = out_dir / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


# A run's state in a diagnosis matrix, and each candidate's verdict: colours a reader knows
# (amber: no failure asked for, but another one or an early stop; light grey: not run).
STATE_COLOURS = {"failed": "#d62728", "clean": "#2ca02c", "other": "#ff7f0e", "error": "#444444", "none": "#cccccc"}
VERDICT_COLOURS = {"fixed": "#2ca02c", "fixed-but": "#ff7f0e", "reproduced": "#d62728", "no-change": "#7f7f7f",
                   "inconclusive": "#999999", "error": "#444444", "not-run": "#bbbbbb", "baseline": "#1f77b4"}


def plot_matrix(rows: list[tuple[str, dict[int, tuple[str, str]], str]], seeds: list[int], path: Path,
                title: str) -> Path:
    """Candidates x seeds: each cell a run (red: the failure at the step written in it, amber:
    another failure or an early stop, as written, green: clean, dark grey: error, light grey:
    not run), each row labelled with its verdict in the verdict's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(seeds) + 1.6, 0.9 + 0.42 * len(rows)))
    for r, (name, cells, verdict) in enumerate(rows):
        y = len(rows) - 1 - r
        for c, seed in enumerate(seeds):
            state, text = cells.get(seed, ("none", "-"))
            ax.add_patch(Rectangle((c, y), 0.95, 0.9, color=STATE_COLOURS[state], alpha=0.85))
            ax.text(c + 0.475, y + 0.45, text, ha="center", va="center", color="white", fontsize=8)
        ax.text(len(seeds) + 0.1, y + 0.45, verdict, va="center", fontsize=9, fontweight="bold",
                color=VERDICT_COLOURS.get(verdict, "black"))
    ax.set_xlim(0, len(seeds) + 1.5)
    ax.set_ylim(0, len(rows))
    ax.set_xticks([c + 0.475 for c in range(len(seeds))], [f"seed {s}" for s in seeds], fontsize=8)
    ax.set_yticks([len(rows) - 1 - r + 0.45 for r in range(len(rows))], [name for name, _, _ in rows], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
