"""A table's cells ranked by one column: each mean with its 95% interval, and the differences that a
Welch t-test at 5% does not call significant."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.reproduction.seed_stats import ALPHA, ci95_half_width, differ
from flower_app.reproduction.table_model import Table


@dataclass(frozen=True)
class Ranked:
    """One ranked cell: 1 + the number of cells significantly better, and the cells it ties with."""

    cell: str
    label: str
    mean: float
    std: float
    n: int
    ci95: float
    rank: int
    ties: tuple[str, ...]  # the cells not significantly different from this one


def rank(table_rows: list[dict], column: str, higher: bool = True) -> tuple[list[Ranked], list[str]]:
    """The cells reporting ``column`` with two or more seeds, best first (``higher``: a larger mean is
    better), and the cells left unranked for fewer seeds."""
    rows = [r for r in table_rows if r["column"] == column and r["mean"] is not None]
    ranked = sorted((r for r in rows if r["n"] >= 2), key=lambda r: r["mean"], reverse=higher)
    unranked = [r["cell"] for r in table_rows if r["column"] == column and r not in ranked]

    def better(b: dict, a: dict) -> bool:
        return (b["mean"] > a["mean"]) == higher and b["mean"] != a["mean"] and differ(a, b)

    out = [Ranked(a["cell"], a["label"], a["mean"], a["std"], a["n"], ci95_half_width(a["std"], a["n"]),
                  1 + sum(better(b, a) for b in ranked),
                  tuple(b["cell"] for b in ranked if b is not a and not differ(a, b)))
           for a in ranked]
    return out, unranked


def ranking_lines(table: Table, table_rows: list[dict]) -> list[str]:
    """The page's ranking section (none when the table declares no ``rank:``)."""
    if table.rank is None:
        return []
    column = table.columns[table.rank.column]
    ranked, unranked = rank(table_rows, column.name, table.rank.higher)
    fmt = (lambda v: f"{v:.2f}") if column.percent else (lambda v: f"{v:.3g}")
    lines = [f"## Ranking by {column.label} ({'higher' if table.rank.higher else 'lower'} is better)", "",
             "Rank: 1 + the number of cells significantly better, by Welch's two-sided t-test on the seeds' "
             f"values at {ALPHA:.0%} (each pair tested alone, no correction for the many comparisons). Cells "
             "that share a rank, or that the last column names, are not significantly different: the "
             "order between them is not evidence.", "",
             "| rank | cell | mean ± 95% interval | seeds | not significantly different from |",
             "|---|---|---|---|---|"]
    for r in ranked:
        ties = ", ".join(f"`{c}`" for c in r.ties) or "–"
        lines.append(f"| {r.rank} | `{r.cell}`: {r.label.replace('|', chr(92) + '|')} | {fmt(r.mean)} ± "
                     f"{fmt(r.ci95)} | {r.n} | {ties} |")
    if ranked:
        top = [f"`{r.cell}`" for r in ranked if r.rank == 1]
        lines += ["", f"Not significantly below the first: {', '.join(top)}."]
    if unranked:
        lines += ["", f"Not ranked (fewer than 2 seeds): {', '.join(f'`{c}`' for c in unranked)}."]
    return lines + [""]
