"""The figures a run and a table write: whole rounds as ticks, every line named, a table's bars
readable (not from 0, one legend clear of the bars)."""

from types import SimpleNamespace

import pytest

from flower_app.results import comparison, plots


@pytest.fixture
def figures(monkeypatch):
    """The figures drawn, instead of written."""
    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, dpi=120: drawn.append(fig))
    monkeypatch.setattr(comparison, "save_figure", lambda fig, path, dpi=120: drawn.append(fig))
    monkeypatch.setattr(plots.plt, "close", lambda fig: None)
    return drawn


def _evals(accuracy: float) -> list[dict]:
    return [{"phase": "eval", "round": t, "personalized_accuracy": accuracy + t / 100, "global_accuracy": accuracy,
             "client_accuracy": {"0": accuracy, "1": accuracy}} for t in (1, 2, 3)]


def _whole_round_ticks(ax) -> bool:
    low, high = ax.get_xlim()
    return all(float(t).is_integer() for t in ax.get_xticks() if low <= t <= high)


def test_a_short_comparison_has_whole_round_ticks_and_names_each_line(figures, tmp_path):
    comparison.plot_comparison({"fedrep": _evals(0.8), "fedavg": _evals(0.7)}, tmp_path / "c.png", "t")
    ax = figures[0].axes[0]
    assert _whole_round_ticks(ax)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "fedrep (personalized)", "fedrep (global)", "fedavg (personalized)", "fedavg (global)"]


def test_a_short_runs_plots_have_whole_round_ticks(figures, tmp_path):
    plots.plot_run(_evals(0.8), tmp_path, "t")
    assert _whole_round_ticks(figures[0].axes[0]) and _whole_round_ticks(figures[1].axes[0])


def test_a_tables_bars_start_below_their_lowest_value_with_one_legend(figures, tmp_path):
    column = SimpleNamespace(name="acc", label="accuracy", percent=True)
    cells = {n: SimpleNamespace(label=n) for n in ("A", "B")}
    table = SimpleNamespace(columns={"acc": column}, cells=cells, title="T")
    rows = [{"label": "A", "column": "acc", "mean": 84.0, "std": 0.5, "paper": 83.0, "n": 3},
            {"label": "B", "column": "acc", "mean": 88.0, "std": 1.0, "paper": 90.0, "n": 3}]
    plots.plot_table(table, rows, tmp_path / "table.png")
    fig = figures[0]
    assert fig.axes[0].get_ylim() == (75.0, 95.0)  # the lowest (83) down to 80, less 5; the highest (90) plus 5
    assert fig.axes[0].get_legend() is None and len(fig.legends) == 1
