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


def plot_curves(runs: list[Curves], metrics: list[str], out_dir: Path, name: str = "curves.png") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    if not metrics:
        return []
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes.flat, metrics):
        for i, run in enumerate(runs):
            steps = [s for s, m in run.rows.items() if metric in m]
            values = [run.rows[s][metric] for s in steps]
            colour = colours[i % len(colours)]
            style = ("-", "--", "-.")[(i // len(colours)) % 3]  # more runs than colours: vary the line
            ax.plot(steps, values, label=run.name, color=colour, ls=style, lw=2.2 if i == 0 else 1.2,
                    alpha=1.0 if i == 0 else 0.85)
            for sig, step in run.onsets.items():  # dotted line at each failure onset
                ax.axvline(step, color=colour, ls=":", lw=1)
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    columns = min(len(runs), 4)
    fig.legend(handles, labels, loc="upper center", ncol=columns, fontsize=8)
    # Leave the legend its own band: about 0.2 inch per legend row, whatever the number of runs.
    legend_inches = 0.15 + 0.2 * math.ceil(len(runs) / columns)
    fig.tight_layout(rect=(0, 0, 1, 1 - legend_inches / fig.get_figheight()))
    path = out_dir / name
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
