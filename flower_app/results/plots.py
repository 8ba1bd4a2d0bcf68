"""Plots of a run: accuracy curves and the per-client accuracy spread."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from flower_app.run.run_dir import write_atomic  # noqa: E402


def save_figure(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` (and its folder) atomically (a reader never sees half a PNG; a
    failed write leaves no file and names ``path``)."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight"))


def plot_run(records: list[dict], plots_dir: Path, title: str) -> list[Path]:
    """Write ``accuracy.png`` and ``client_spread.png`` from the eval records; return paths."""
    evals = [r for r in records if r.get("phase") == "eval"]
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("personalized_accuracy", "personalized (mean over clients)"), ("global_accuracy", "global model, global test set")):
        pts = [(r["round"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label)
    ax.set(xlabel="round", ylabel="test accuracy", title=title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    written.append(plots_dir / "accuracy.png")
    save_figure(fig, written[-1])
    plt.close(fig)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    spread = [r for r in evals if r.get("client_accuracy")]
    if spread:
        ax.boxplot([list(r["client_accuracy"].values()) for r in spread], positions=[r["round"] for r in spread],
                   widths=max(1, spread[-1]["round"] // max(len(spread), 1)) * 0.6, showfliers=False, manage_ticks=False)
        last = spread[-1]
        ax2.hist(list(last["client_accuracy"].values()), bins=10, color="tab:orange")
        ax2.set(xlabel="local test accuracy", ylabel="clients", title=f"round {last['round']}")
        ax2.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of clients
    ax.set(xlabel="round", ylabel="local test accuracy per client", title=f"{title}: spread over clients")
    ax.grid(alpha=0.3)
    written.append(plots_dir / "client_spread.png")
    save_figure(fig, written[-1])
    plt.close(fig)

    if any(r.get("representation_distance") is not None for r in records):
        written.append(plot_linear({title: records}, plots_dir / "linear.png", title))

    curves = [r["newclient_accuracy_by_epoch"] for r in records if r.get("newclient_accuracy_by_epoch")]
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(range(len(curves[-1])), curves[-1], marker="o")
        ax.set(xlabel="head epochs on the new client", ylabel="new-client test accuracy",
               title=f"{title}: new clients, head only")
        ax.grid(alpha=0.3)
        written.append(plots_dir / "newclients.png")
        save_figure(fig, written[-1])
        plt.close(fig)
    return written


def plot_linear(records: dict[str, list[dict]], path: Path, title: str) -> Path:
    """Linear representation runs: dist(B, B*) and global-loss gradient norm per round, and
    the new-client error against the number of samples n (one line per variant)."""
    fig, (ax_d, ax_g, ax_n) = plt.subplots(1, 3, figsize=(17, 4.5))
    alone = None
    for i, (label, recs) in enumerate(records.items()):
        color = f"C{i}"
        evals = [r for r in recs if r.get("phase") == "eval"]
        for ax, key in ((ax_d, "representation_distance"), (ax_g, "global_grad_norm")):
            pts = [(r["round"], r[key]) for r in evals if r.get(key) is not None]
            if pts:
                ax.semilogy(*zip(*pts), color=color, label=label)
        new = next((r for r in recs if r.get("newclient_error")), None)
        if new:
            ns = sorted(new["newclient_error"], key=int)
            ax_n.loglog([int(n) for n in ns], [new["newclient_error"][n] for n in ns], marker="o", color=color, label=label)
            alone = new["newclient_error_local_only"]
    if alone:
        ns = sorted(alone, key=int)
        ax_n.loglog([int(n) for n in ns], [alone[n] for n in ns], "k--", marker="x", label="local only")
    fig.suptitle(title)
    ax_d.set(xlabel="round", ylabel="dist(B, B*)", title="distance to the true representation")
    ax_g.set(xlabel="round", ylabel="‖∇ global loss‖", title="global-loss gradient norm (global models)")
    ax_n.set(xlabel="samples n of a new client", ylabel="‖Bw − B*w*‖²", title="new client: least-squares head on learned B")
    for ax in (ax_d, ax_g, ax_n):
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_table(table, table_rows: list[dict], path: Path) -> None:
    """One panel per column of a reproduced table (two per row): ours (mean ± std over seeds, each bar labelled
    with its value) beside the paper's."""
    columns = list(table.columns.values())
    width = max(5.0, 1.2 * len(table.cells))
    ncols = min(2, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    labels = {cell.label: textwrap.fill(cell.label, 32) for cell in table.cells.values()}
    label_lines = max((label.count("\n") + 1 for label in labels.values()), default=1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, (3.5 + 0.5 * label_lines) * nrows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(columns):]:
        ax.set_visible(False)
    for ax, col in zip(axes.flat, columns):
        mine = [r for r in table_rows if r["column"] == col.name]
        x = range(len(mine))
        ours = ax.bar([i - 0.2 for i in x], [r["mean"] if r["mean"] is not None else 0 for r in mine], width=0.4,
                      yerr=[r["std"] or 0 for r in mine], capsize=3, label="ours (mean ± std over seeds)")
        ax.bar_label(ours, labels=["" if r["mean"] is None else f"{r['mean']:.1f}" if col.percent else f"{r['mean']:.3g}"
                                  for r in mine], fontsize=7)
        paper = [(i + 0.2, r["paper"]) for i, r in zip(x, mine) if r["paper"] is not None]
        if paper:
            ax.bar(*zip(*paper), width=0.4, color="tab:gray", label="paper")
        ax.set_xticks(list(x), [labels.get(r["label"], r["label"]) for r in mine], rotation=30, ha="right", fontsize=8)
        ax.set_title(textwrap.fill(col.label, int(width * 9)), fontsize=9)
        ax.set_ylabel("%" if col.percent else col.name)
        means = [r["mean"] for r in mine if r["mean"] is not None]
        if not col.percent and means and min(means) > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(table.title, int(width * ncols * 9)), fontsize=10)
    save_figure(fig, path)
    plt.close(fig)
