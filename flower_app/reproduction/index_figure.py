"""The index's figure (``docs/reproduction/index.png``): every attempted percentage against the paper's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flower_app.reproduction.report import NOT_ATTEMPTED

if TYPE_CHECKING:
    from flower_app.reproduction.index import Row

MARKERS = "osD^vP*Xph<>"


def plot(every: list[Row], path: Path) -> None:
    """Every percentage with a paper number: ours (mean ± 95% interval) against the paper's, the
    diagonal and the ±1.5-point band; the whole range and, right, the top (70–100)."""
    import matplotlib.pyplot as plt

    from flower_app.results.plots import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(13, 6), layout="constrained")
    shown = [r for r in every if any(n.percent and n.mean is not None and n.verdict != NOT_ATTEMPTED
                                     for n in r.numbers)]
    for ax, (low, high) in zip(axes, ((0.0, 100.0), (70.0, 100.0))):
        grid = [low, high]
        ax.fill_between(grid, [low - 1.5, high - 1.5], [low + 1.5, high + 1.5], color="tab:gray", alpha=0.25,
                        lw=0, label="within 1.5 points")
        ax.plot(grid, grid, color="k", lw=0.8, ls="--")
        for i, r in enumerate(shown):
            pts = [n for n in r.numbers if n.percent and n.mean is not None and n.verdict != NOT_ATTEMPTED]
            colour, marker = f"C{i % 10}", MARKERS[i % len(MARKERS)]
            for one_seed in (False, True):
                sel = [n for n in pts if (n.ci95 is None) == one_seed]
                if not sel:
                    continue
                ax.errorbar([n.paper for n in sel], [n.mean for n in sel],
                            yerr=None if one_seed else [n.ci95 or 0.0 for n in sel], fmt=marker, color=colour,
                            mfc="none" if one_seed else colour, ms=6, capsize=2, lw=0.8,
                            label=None if one_seed and any(n.ci95 is not None for n in pts)
                            else (r.table.short or r.table.name))
        ax.set(xlim=(low, high), ylim=(low, high), xlabel="paper (%)", ylabel="ours, mean over seeds (%)",
               aspect="equal")
        ax.grid(alpha=0.3)
    axes[0].set_title("every reproduced percentage against the paper's")
    axes[1].set_title("the top of the range")
    axes[1].legend(fontsize=7, loc="lower right")
    save_figure(fig, path)
    plt.close(fig)
