"""``flrep reproduce --index``: ``docs/reproduction.md`` and ``docs/reproduction/index.png``, generated
from every paper table (``conf/tables/<name>.yaml``) and its committed report
(``docs/reproduction/<name>/table.csv`` and ``table.md``), never from the runs.

Each (cell, metric) with a paper number and ours gets one verdict: *within* the table's tolerance
(points for a percentage, per cent of the paper's value otherwise), else *explained* (the paper's
number inside our 95% interval, or a reason the table's ``explained:`` declares), else *open*.
A :class:`Source` reads the files from the working tree (:class:`Files`) or from a commit
(:class:`Commit`), so a test can check the committed page against the committed tables.
"""

from __future__ import annotations

import csv
import io
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flower_app.reproduction.report import ci95_half_width, verdict
from flower_app.reproduction.tables import Table, parse_table

PAGE = "docs/reproduction.md"
FIGURE = "docs/reproduction/index.png"
COMMAND = "flrep reproduce --index"


class Source(Protocol):
    """Where the index reads the table files and reports, by path relative to the repository root."""

    def text(self, path: str) -> str | None:
        """The file's text, or None when it does not exist."""

    def tables(self) -> list[str]:
        """The names of the table files in ``conf/tables``."""


@dataclass(frozen=True)
class Files:
    """The files of a working tree under ``root``."""

    root: Path

    def text(self, path: str) -> str | None:
        file = self.root / path
        return file.read_text() if file.is_file() else None

    def tables(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "conf" / "tables").glob("*.yaml"))


@dataclass(frozen=True)
class Commit:
    """The files of commit ``rev`` of the git repository at ``root`` (untouched by the working tree)."""

    root: Path
    rev: str = "HEAD"

    def _git(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True, text=True)

    def text(self, path: str) -> str | None:
        shown = self._git("show", f"{self.rev}:{path}")
        return shown.stdout if shown.returncode == 0 else None

    def tables(self) -> list[str]:
        listed = self._git("ls-tree", "--name-only", self.rev, "conf/tables/")
        return sorted(Path(p).stem for p in listed.stdout.split() if p.endswith(".yaml"))


@dataclass(frozen=True)
class Number:
    """One (cell, metric) of a table with the paper's number and ours, and its verdict."""

    cell: str
    column: str
    percent: bool
    mean: float
    paper: float
    n: int
    ci95: float | None
    verdict: str  # "within", "interval" (the paper inside our 95% interval), "declared" or "open"

    @property
    def difference(self) -> float:
        return self.mean - self.paper


@dataclass(frozen=True)
class Row:
    """A table's line of the index."""

    table: Table
    reported: bool  # a table.csv is committed
    cells_run: int
    seeds: tuple[int, int] | None  # fewest and most completed runs of a cell that ran
    numbers: tuple[Number, ...]
    claims: tuple[int, int] | None  # claims that hold on every seed, claims checked

    def count(self, *verdicts: str) -> int:
        return sum(n.verdict in verdicts for n in self.numbers)


def numbers(table: Table, table_csv: str) -> list[Number]:
    """Every (cell, metric) of ``table_csv`` (a committed report) with both numbers, judged anew with
    the table's tolerance and ``explained:`` as they are now."""
    out = []
    for r in csv.DictReader(io.StringIO(table_csv)):
        if r["cell"] not in table.cells or not r["paper"] or not r["mean"]:
            continue
        column = table.columns.get(r["column"])
        percent = bool(column and column.percent)
        mean, paper, n = float(r["mean"]), float(r["paper"]), int(r["n"])
        ci95 = ci95_half_width(float(r["std"]), n) if r["std"] else None
        judged = verdict(table, r["cell"], r["column"], percent, mean, paper, n, ci95)
        out.append(Number(r["cell"], r["column"], percent, mean, paper, n, ci95, judged))
    return out


def claims(table_md: str) -> tuple[int, int] | None:
    """(claims that hold on every seed, claims run) from a committed ``table.md``; None without claims."""
    verdicts = re.findall(r"\| (holds|fails|not run) \((\d+)/(\d+) seeds\) \|$", table_md, re.MULTILINE)
    run = [v for v in verdicts if v[0] != "not run"]
    return (sum(v[0] == "holds" for v in run), len(run)) if verdicts else None


def row(source: Source, name: str) -> Row:
    """The index line of table ``name``."""
    table = parse_table(name, source.text(f"conf/tables/{name}.yaml") or "", f"conf/tables/{name}.yaml")
    report = source.text(f"docs/reproduction/{name}/table.csv")
    runs: dict[str, int] = {}
    for r in csv.DictReader(io.StringIO(report or "")):
        if r["cell"] in table.cells and int(r["runs"] or 0) > 0:
            runs[r["cell"]] = int(r["runs"])
    seeds = (min(runs.values()), max(runs.values())) if runs else None
    found = claims(source.text(f"docs/reproduction/{name}/table.md") or "")
    return Row(table, report is not None, len(runs), seeds, tuple(numbers(table, report or "")), found)


def rows(source: Source) -> list[Row]:
    """One row per table file, paper tables first (those with paper numbers), then by name."""
    every = [row(source, name) for name in source.tables()]
    return sorted(every, key=lambda r: (not any(c.paper for c in r.table.cells.values()), r.table.name))


def _link(r: Row, text: str = "") -> str:
    name = text or r.table.short or r.table.title
    target = f"reproduction/{r.table.name}/table.md" if r.reported else f"../conf/tables/{r.table.name}.yaml"
    return f"[{name}]({target})"


def _seeds(r: Row) -> str:
    if r.seeds is None:
        return "–"
    low, high = r.seeds
    return str(low) if low == high else f"{low}–{high}"


def _explained(r: Row) -> str:
    interval, declared = r.count("interval"), r.count("declared")
    if not interval + declared:
        return "0"
    parts = [f"{interval} CI" if interval else "", f"{declared} notes" if declared else ""]
    return f"{interval + declared} ({', '.join(p for p in parts if p)})"


def _diff(x: Number) -> str:
    if x.percent:
        return f"{x.difference:+.2f}".replace("-", "−")
    return f"{x.mean:.3g} vs {x.paper:.3g}"


def markdown(every: list[Row]) -> str:
    """The index page."""
    lines = [
        "# Reproductions: results on one screen", "",
        f"How close flrep comes to each paper table, one row per table; generated from the committed "
        f"tables by `{COMMAND}` (do not edit by hand).", "",
        "| paper table | cells run | seeds | numbers | within | explained | open | claims hold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in every:
        compared = len(r.numbers)
        counts = (f"{compared} | {r.count('within')} | {_explained(r)} | {r.count('open')}" if compared
                  else "– | – | – | –")
        held = f"{r.claims[0]}/{r.claims[1]}" if r.claims else "–"
        lines.append(f"| {_link(r)} | {r.cells_run}/{len(r.table.cells)} | {_seeds(r)} | {counts} | {held} |")
    total = [n for r in every for n in r.numbers]
    within = sum(n.verdict == "within" for n in total)
    explained = sum(n.verdict in ("interval", "declared") for n in total)
    lines += ["", f"In all: {len(total)} numbers, {within} within the tolerance, {explained} explained, "
                  f"{len(total) - within - explained} open.", "",
              "![every reproduced number against the paper's](reproduction/index.png)", "",
              "*The figure*: one point per (cell, metric) in percent with a paper number; x the paper's, "
              "y ours (mean over seeds) with its 95% interval (hollow: one seed, no interval). "
              "Shaded: within 1.5 points of the paper.", ""]
    lines += [
        "## How to read this", "",
        "- **cells run**: cells with a completed run / declared. **seeds**: runs per cell (fewest–most).",
        "- **numbers**: (cell, metric) pairs with a paper number, one verdict each.",
        "- **within**: within 1.5 points of the paper (percentages), 1.5% of its value otherwise.",
        "- **explained**, beyond it: *CI*: the paper's number inside the Student-t 95% interval of our mean "
        "(two seeds or more; not a match); *notes*: the table's `explained:` names a measured cause (another "
        "cell, an evidence script, the paper's scale) or a declared setting other than the paper's.",
        "- **open**: neither; a cause the notes only suspect stays open.",
        "- **claims hold**: pass/fail statements true on every seed run (tables of figures).",
        "- Verdicts: each committed `table.csv` with the table's tolerance and `explained:` now.", "",
    ]
    lines += ["## Beyond the tolerance", "",
              "Open, then CI, then explained by the notes (ids as in `conf/tables/<table>.yaml`; "
              "each table's page gives the notes' reasons).", ""]
    for r in every:
        beyond = [x for x in r.numbers if x.verdict != "within"]
        if not beyond:
            continue
        parts = [f"{label}: " + ", ".join(f"`{x.cell}.{x.column}` {_diff(x)}" + (" (1 seed)" if x.n == 1 else "")
                                          for x in beyond if x.verdict == verdict)
                 for verdict, label in (("open", "**open**"), ("interval", "CI"), ("declared", "notes"))
                 if r.count(verdict)]
        lines.append(f"- {_link(r, f'`{r.table.name}`')}: " + "; ".join(parts))
    lines += ["", "## Links", "",
              "- [How the tables are made](reproduction/how_it_works.md): `flrep reproduce`, resuming, "
              "what is committed, when runs go stale.",
              "- Evidence behind the notes: [reproduction/evidence/](reproduction/evidence/).",
              "- `flrep reproduce --list`: every table with its cells and cost on a 2-core CPU.",
              "- Results without a seeded table: [analyses](analyses.md).", ""]
    return "\n".join(lines)


MARKERS = "osD^vP*Xph<>"


def plot(every: list[Row], path: Path) -> None:
    """Every percentage with a paper number: ours (mean ± 95% interval) against the paper's, the
    diagonal and the ±1.5-point band; the whole range and, right, the top (70–100)."""
    import matplotlib.pyplot as plt

    from flower_app.results.plots import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(13, 6), layout="constrained")
    shown = [r for r in every if any(n.percent for n in r.numbers)]
    for ax, (low, high) in zip(axes, ((0.0, 100.0), (70.0, 100.0))):
        grid = [low, high]
        ax.fill_between(grid, [low - 1.5, high - 1.5], [low + 1.5, high + 1.5], color="tab:gray", alpha=0.25,
                        lw=0, label="within 1.5 points")
        ax.plot(grid, grid, color="k", lw=0.8, ls="--")
        for i, r in enumerate(shown):
            pts = [n for n in r.numbers if n.percent]
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


def write_index(source: Source, root: Path) -> tuple[Path, Path]:
    """Write the page and the figure under ``root`` (atomically) from ``source``; return their paths."""
    from flower_app.run.run_dir import write_atomic

    every = rows(source)
    page, figure = root / PAGE, root / FIGURE
    text = markdown(every)
    write_atomic(page, lambda tmp: Path(tmp).write_text(text))
    plot(every, figure)
    return page, figure
