"""A table page's ranking: means with 95% intervals, Welch tests for which differences are not significant."""

from __future__ import annotations

import json
import math

import pytest

from flower_app.reproduction.ranking import rank
from flower_app.reproduction.runner import write_report
from flower_app.reproduction.seed_stats import differ
from flower_app.reproduction.tables import load_table, parse_table
from task.errors import ConfigError

BENCH = """
title: Tiny benchmark
source: no paper
columns:
  acc: {key: personalized_accuracy, label: accuracy, percent: true}
rank: {column: acc, better: higher}
scales:
  paper: {note: the setting, overrides: []}
  cpu: {note: the same, overrides: []}
cells:
  a: {label: A, experiment: quickstart, overrides: [algorithm=fedavg]}
  b: {label: B, experiment: quickstart, overrides: [algorithm=fedrep]}
  c: {label: C, experiment: quickstart, overrides: [algorithm=fedper]}
  d: {label: D, experiment: quickstart, overrides: [algorithm=ditto]}
"""


def row(cell: str, mean: float, std: float, n: int) -> dict:
    return {"cell": cell, "label": cell.upper(), "column": "acc", "mean": mean, "std": std, "n": n}


def welch_p(a: tuple[float, float, int], b: tuple[float, float, int]) -> float:
    """Welch's two-sided p-value by hand: t, the Welch-Satterthwaite degrees of freedom, the t tail."""
    from scipy.stats import t as student

    (ma, sa, na), (mb, sb, nb) = a, b
    va, vb = sa**2 / na, sb**2 / nb
    t = (ma - mb) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    return 2 * student.sf(abs(t), df)


@pytest.mark.parametrize("other, significant", [((12.0, 1.0, 3), False), ((13.0, 1.0, 3), True),
                                                ((10.0, 0.0, 3), False), ((10.5, 0.0, 3), True)])
def test_a_difference_is_significant_when_welchs_p_is_below_5_percent(other, significant):
    mine = (10.0, 1.0 if other[1] else 0.0, 3)
    assert differ(row("a", *mine), row("b", *other)) is significant
    if other[1]:  # 12 vs 10: p = 0.0705; 13 vs 10: p = 0.0213 (t = 2.45 and 3.67, 4 degrees of freedom)
        assert bool(welch_p(mine, other) < 0.05) is significant


def test_cells_are_ranked_by_how_many_are_significantly_better():
    rows = [row("c", 70.0, 0.5, 3), row("b", 79.8, 0.5, 3), row("a", 80.0, 0.5, 3), row("d", 99.0, 0.0, 1)]
    ranked, unranked = rank(rows, "acc")
    assert [(r.cell, r.rank, r.ties) for r in ranked] == [("a", 1, ("b",)), ("b", 1, ("a",)), ("c", 3, ())]
    assert unranked == ["d"]  # one seed: no interval, no test
    assert ranked[0].ci95 == pytest.approx(4.302653 * 0.5 / math.sqrt(3), rel=1e-5)
    lower, _ = rank(rows, "acc", higher=False)  # an error column: the smallest first
    assert [(r.cell, r.rank) for r in lower] == [("c", 1), ("b", 2), ("a", 2)]


def test_the_page_ranks_the_cells_with_intervals_and_names_the_ties(tmp_path, monkeypatch):
    from flower_app.reproduction import tables

    monkeypatch.setattr(tables, "TABLES_DIR", tmp_path)
    (tmp_path / "bench.yaml").write_text(BENCH)
    table = load_table("bench")
    for cell, accs in {"a": [0.80, 0.81, 0.79], "b": [0.795, 0.80, 0.805], "c": [0.60, 0.61, 0.62],
                       "d": [0.9]}.items():
        for seed, acc in enumerate(accs):
            folder = tmp_path / "out" / "runs" / cell / f"seed{seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"status": "completed", "personalized_accuracy": acc}))
    write_report(table, "cpu", tmp_path / "out", {"table": "bench", "scale": "cpu", "runs": {}})
    md = (tmp_path / "out" / "table.md").read_text()
    assert "## Ranking by accuracy (higher is better)" in md
    # a: 80 ± t(0.975, 2) × 1 / sqrt(3) = 2.48; b: 80 ± 1.24; c: 61 ± 2.48
    assert "| 1 | `a`: A | 80.00 ± 2.48 | 3 | `b` |" in md
    assert "| 1 | `b`: B | 80.00 ± 1.24 | 3 | `a` |" in md
    assert "| 3 | `c`: C | 61.00 ± 2.48 | 3 | – |" in md
    assert "Not significantly below the first: `a`, `b`." in md
    assert "Not ranked (fewer than 2 seeds): `d`." in md


@pytest.mark.parametrize("rank_spec", ["{column: loss}", "{column: acc, better: up}", "acc"])
def test_a_bad_rank_is_refused_naming_the_key(rank_spec):
    with pytest.raises(ConfigError, match=r"bench.yaml: rank is .*expected \{column: <one of acc>"):
        parse_table("bench", BENCH.replace("{column: acc, better: higher}", rank_spec), "bench.yaml")


def test_the_benchmark_table_ranks_by_personalized_accuracy():
    table = load_table("pfl_benchmark")
    assert table.rank is not None and table.columns[table.rank.column].key == "personalized_accuracy"
    assert table.rank.higher
