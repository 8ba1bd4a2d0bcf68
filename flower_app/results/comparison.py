"""Results of a run with several variants (``compare``): one table, one summary, one plot.

Each variant writes its own results contract under ``<out>/<label>/``; the run directory
gets ``summary.json`` (the comparison's own: status, the variants and every variant's
headline numbers), ``comparison.md``, ``plots/comparison.png`` and, for linear representation
runs, ``plots/linear.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from flower_app.results.plots import plot_linear, round_axis, save_figure  # noqa: E402
from flower_app.results.contract import clean_json  # noqa: E402
from flower_app.run.run_dir import write_text_atomic  # noqa: E402
from task.files import WriteFailed  # noqa: E402

#: (summary key, column title) of the comparison table, shown when any variant has a value.
COLUMNS = (
    ("personalized_accuracy", "personalized acc (final-window mean)"),
    ("personalized_accuracy_worst10", "worst 10% clients"),
    ("official_local_accuracy", "official-code local acc"),
    ("local_test_best_over_rounds", "best-round local acc"),
    ("global_accuracy", "global acc"),
    ("new_test_accuracy", "New Test acc"),
    ("finetune_accuracy_after", "+FT acc"),
    ("newclient_accuracy", "new-client acc"),
    ("personalized_loss", "personalized loss"),
    ("representation_distance", "dist(B, B*)"),
    ("params_up", "params up"),
    ("wall_time_s", "wall s"),
)


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a"
    if key.startswith("params"):
        return f"{value:.3g}"
    if key == "wall_time_s":
        return f"{value:.0f}"
    return f"{value:.4g}" if key in ("personalized_loss", "representation_distance") else f"{value:.4f}"


def comparison_table(summaries: dict[str, dict]) -> str:
    """A Markdown table: one row per variant, the COLUMNS any variant reports."""
    cols = [(k, t) for k, t in COLUMNS if any(s.get(k) is not None for s in summaries.values())]
    lines = ["| variant | " + " | ".join(t for _, t in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for label, s in summaries.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(k, s.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines) + "\n"


def plot_comparison(records: dict[str, list[dict]], path: Path, title: str) -> Path:
    """Accuracy per round of every variant (personalized solid, global dashed; the loss for
    regression), plus the new-client curves when present."""
    has_new = any(r.get("newclient_accuracy_by_epoch") for recs in records.values() for r in recs)
    fig, axes = plt.subplots(1, 1 + has_new, figsize=(7 + 6 * has_new, 4.5), squeeze=False)
    ax = axes[0][0]
    plotted: set[str] = set()  # what the y axis shows, per variant
    for i, (label, recs) in enumerate(records.items()):
        evals = [r for r in recs if r.get("phase") == "eval"]
        regression = all(r.get("personalized_accuracy") is None for r in evals)
        plotted.add("test loss" if regression else "test accuracy")
        keys = (("personalized_loss", "-", " (loss)"),) if regression else (
            ("personalized_accuracy", "-", " (personalized)"), ("global_accuracy", "--", " (global)"))
        for key, style, suffix in keys:
            pts = [(r["round"], r[key]) for r in evals if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i}", label=label + suffix)
    ax.set(ylabel=" / ".join(sorted(plotted)), title=title)
    round_axis(ax)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    if has_new:
        ax3 = axes[0][1]
        for i, (label, recs) in enumerate(records.items()):
            curve = next((r["newclient_accuracy_by_epoch"] for r in recs if r.get("newclient_accuracy_by_epoch")), None)
            if curve:
                ax3.plot(range(len(curve)), curve, marker="o", color=f"C{i}", label=label)
        ax3.set(xlabel="head epochs on the new client", ylabel="new-client test accuracy",
                title="new clients: fresh head on the frozen representation")
        ax3.grid(alpha=0.3)
        ax3.legend(fontsize=8)
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_comparison(out_dir: Path, summaries: dict[str, dict], records: dict[str, list[dict]], title: str) -> dict:
    """Write summary.json, comparison.md and plots/comparison.png; return the summary.

    The summary is the comparison's own, naming no variant's algorithm: its status (completed
    only when every variant completed), the variants in order, each one's headline numbers
    and folder, and the time spent (training and evaluation; with start-up).
    """
    first = next(iter(summaries.values()))
    summary = {
        "kind": "comparison",
        "status": "completed" if all(s.get("status") == "completed" for s in summaries.values()) else "failed",
        "title": title,
        "experiment": first.get("experiment"),
        "variants": list(summaries),
        "comparison": {label: {"algorithm": s.get("algorithm"), "status": s.get("status")}
                       | {k: s.get(k) for k, _ in COLUMNS} | {"out_dir": s.get("out_dir")}
                       for label, s in summaries.items()},
        "wall_time_s": sum(s.get("wall_time_s") or 0.0 for s in summaries.values()),
        "out_dir": str(out_dir),
    }
    failed = [label for label, s in summaries.items() if s.get("status") != "completed"]
    if failed:
        summary["failure_reason"] = "; ".join(f"{label}: {summaries[label].get('failure_reason')}" for label in failed)
    try:
        write_text_atomic(out_dir / "comparison.md", f"# {title}\n\n" + comparison_table(summaries))
        plot_comparison(records, out_dir / "plots" / "comparison.png", title)
        if any(r.get("representation_distance") is not None for recs in records.values() for r in recs):
            plot_linear(records, out_dir / "plots" / "linear.png", title)
    except WriteFailed as err:  # a result is missing: the comparison failed, and says which file
        summary.update(status="failed", failure_reason=str(err))
        _write_summary(out_dir, summary)
        raise
    _write_summary(out_dir, summary)
    return summary


def _write_summary(out_dir: Path, summary: dict) -> None:
    """The comparison's ``summary.json``."""
    write_text_atomic(out_dir / "summary.json", json.dumps(clean_json(summary), indent=2) + "\n")
