"""Plots of a run: accuracy curves, the per-client accuracy spread and the federation's partition."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from flower_app.run.run_dir import write_atomic  # noqa: E402


def round_axis(ax) -> None:
    """Label ``ax``'s x axis "round", with whole rounds only as ticks (a 3-round run has no 1.5)."""
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(fig, path: Path, dpi: float = 120) -> None:
    """Write ``fig`` to ``path`` (and its folder) atomically (a reader never sees half a PNG; a
    failed write leaves no file and names ``path``)."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight"))


def plot_run(records: list[dict], plots_dir: Path, title: str) -> list[Path]:
    """Write ``accuracy.png`` and ``client_spread.png`` from the eval records; return paths."""
    evals = [r for r in records if r.get("phase") == "eval"]
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("personalized_accuracy", "personalized (mean over clients)"), ("global_accuracy", "global model, global test set")):
        pts = [(r["round"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label)
    ax.set(ylabel="test accuracy", title=title)
    round_axis(ax)
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
    ax.set(ylabel="local test accuracy per client", title=f"{title}: spread over clients")
    round_axis(ax)
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


#: Up to this many clients (or classes) every one gets its own tick label.
LABELLED_TICKS = 30


def plot_partition(counts: np.ndarray | None, sizes: np.ndarray, path: Path, title: str,
                   held_out: dict[int, str] | None = None) -> Path:
    """The federation's partition: a clients x classes heatmap of the training labels each client
    holds (``counts``, white where none; absent for regression data) beside each client's
    training-set size (``sizes``). Up to :data:`LABELLED_TICKS` clients are rows in partition-id
    order, each with its id; more are sorted by their most frequent label (then by its share), so the
    picture shows how labels spread over the federation. ``held_out`` names the clients that never
    train (partition id -> role: new client, online device): their bars get their own colour."""
    n, held_out = len(sizes), held_out or {}
    order = np.arange(n)
    many = n > LABELLED_TICKS
    if counts is not None and many:
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        order = np.lexsort((-share.max(axis=1), share.argmax(axis=1)))
    client_axis = "clients, sorted by their most frequent label" if counts is not None and many else "client (partition id)"
    height = min(9.0, max(3.0, 1.5 + 0.3 * n))
    if counts is None:
        fig, ax_size = plt.subplots(figsize=(6, height), layout="constrained")
    else:
        fig, (ax_map, ax_size) = plt.subplots(1, 2, figsize=(12, height), sharey=True,
                                              gridspec_kw={"width_ratios": [3, 1]}, layout="constrained")
        fig.get_layout_engine().set(wspace=0.06)
        cmap = plt.get_cmap("viridis").with_extremes(bad="white")
        image = ax_map.imshow(np.ma.masked_equal(counts[order], 0), aspect="auto", cmap=cmap, interpolation="nearest")
        fig.colorbar(image, ax=ax_map, label="training samples of the class", pad=0.01)
        ax_map.set(xlabel="class", ylabel=client_axis, title="training labels per client")
        ax_map.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(counts.shape[1], LABELLED_TICKS)))
    roles = sorted(set(held_out.values()))
    color = {role: f"C{1 + i}" for i, role in enumerate(roles)}
    rows, shown = np.arange(n), np.asarray(sizes)[order]
    if many:  # one outline for every client, the held-out ones drawn over it
        ax_size.fill_betweenx(rows, 0, shown, step="mid", color="tab:blue", linewidth=0)
        marked = [i for i, p in enumerate(order) if p in held_out]
        ax_size.barh(marked, shown[marked], height=1.0, color=[color[held_out[order[i]]] for i in marked])
    else:
        ax_size.barh(rows, shown, height=0.8, color=[color.get(held_out.get(p), "tab:blue") for p in order])
    if roles:
        ax_size.legend(handles=[Patch(color=color[role], label=role) for role in roles], fontsize=8)
    ax_size.set(xlabel="training samples", title="training-set size")
    ax_size.set_ylim(n - 0.5, -0.5)  # the first client on top, as in the heatmap
    if counts is not None and many:
        ax_size.set_yticks([])  # sorted rows: an id tick would name the wrong client
    else:
        ax_size.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n, LABELLED_TICKS)))
    if counts is None:
        ax_size.set_ylabel(client_axis)
    ax_size.grid(alpha=0.3, axis="x")
    what = "" if counts is not None else " (regression data: no classes)"
    fig.suptitle(f"{title}: {n:,} clients, {int(np.sum(sizes)):,} training samples{what}")
    save_figure(fig, path)
    plt.close(fig)
    return path


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
    ax_d.set(ylabel="dist(B, B*)", title="distance to the true representation")
    ax_g.set(ylabel="‖∇ global loss‖", title="global-loss gradient norm (global models)")
    round_axis(ax_d)
    round_axis(ax_g)
    ax_n.set(xlabel="samples n of a new client", ylabel="‖Bw − B*w*‖²", title="new client: least-squares head on learned B")
    for ax in (ax_d, ax_g, ax_n):
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
    return path


TABLE_PNG_MAX_PX = 6000  # widest table picture, in pixels


def plot_table(table, table_rows: list[dict], path: Path) -> None:
    """One panel per column of a reproduced table (two per row): ours (mean ± std over seeds, each bar labelled
    with its value) beside the paper's. Cells not run yet are left out (their rows say so in table.md)."""
    columns = list(table.columns.values())
    table_rows = [r for r in table_rows if r["mean"] is not None]
    shown = {r["label"] for r in table_rows}
    width = max(5.0, 1.2 * max((sum(r["column"] == c.name for r in table_rows) for c in columns), default=0))
    ncols = min(2, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    labels = {cell.label: textwrap.fill(cell.label, 32) for cell in table.cells.values() if cell.label in shown}
    label_lines = max((label.count("\n") + 1 for label in labels.values()), default=1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, (3.5 + 0.5 * label_lines) * nrows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(columns):]:
        ax.set_visible(False)
    for ax, col in zip(axes.flat, columns):
        mine = [r for r in table_rows if r["column"] == col.name]
        x = range(len(mine))
        ours = ax.bar([i - 0.2 for i in x], [r["mean"] for r in mine], width=0.4,
                      yerr=[r["std"] or 0 for r in mine], capsize=3, label="ours (mean ± std over seeds)")
        ax.bar_label(ours, labels=[f"{r['mean']:.1f}" if col.percent else f"{r['mean']:.3g}" for r in mine], fontsize=7)
        paper = [(i + 0.2, r["paper"]) for i, r in zip(x, mine) if r["paper"] is not None]
        if paper:
            ax.bar(*zip(*paper), width=0.4, color="tab:gray", label="paper")
        ax.set_xticks(list(x), [labels.get(r["label"], r["label"]) for r in mine], rotation=30, ha="right", fontsize=8)
        ax.set_title(textwrap.fill(col.label, int(width * 9)), fontsize=9)
        ax.set_ylabel("%" if col.percent else col.name)
        means = [r["mean"] for r in mine]
        if not col.percent and means and min(means) > 0:
            ax.set_yscale("log")
        if col.percent and means:  # bars from just below the lowest value, not from 0: the differences show
            low = min([r["mean"] - (r["std"] or 0) for r in mine] + [p for _, p in paper])
            high = max([r["mean"] + (r["std"] or 0) for r in mine] + [p for _, p in paper])
            ax.set_ylim(max(0.0, math.floor(low / 5) * 5 - 5), min(100.0, math.ceil(high / 5) * 5 + 5))
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=2, fontsize=8)  # once, clear of every panel's bars
    fig.suptitle(textwrap.fill(table.title, int(width * ncols * 9)), fontsize=10)
    save_figure(fig, path, dpi=min(120, TABLE_PNG_MAX_PX / (width * ncols)))  # a table of many cells stays < 1 MB
    plt.close(fig)
