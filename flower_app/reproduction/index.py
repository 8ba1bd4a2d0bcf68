"""``flrep reproduce --index``: ``docs/reproduction.md`` and ``docs/reproduction/index.png``, generated
from every paper table (``conf/tables/<name>.yaml``), its committed report (``table.csv``,
``table.md``, ``reproduce.json`` under ``docs/reproduction/<name>/``) and the inventory of what the
papers print (``conf/papers.yaml``), never from the runs.

Each paper number gets one verdict from its one primary cell (:func:`report.judge`): *agrees*,
*differs, diagnosed*, *differs*, *inconclusive* or *not attempted*, and the flags of its runs.
A :class:`Source` reads the files from the working tree (:class:`Files`) or from a commit
(:class:`Commit`), so a test can check the committed page against the committed tables.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from flower_app.reproduction.run_flags import run_flags
from flower_app.reproduction.report import (AGREES, DIAGNOSED, DIFFERS, INCONCLUSIVE, NOT_ATTEMPTED, VERDICTS,
                                            failed_seeds, judge, seeds_owed)
from flower_app.reproduction.seed_stats import ci95_half_width
from flower_app.reproduction.index_figure import plot
from flower_app.reproduction.tables import Table, parse_table

PAGE = "docs/reproduction.md"
PAPERS = "conf/papers.yaml"
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
    _read: dict[str, str | None] = field(default_factory=dict, compare=False, repr=False)  # path -> text, read once

    def _git(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True, text=True)

    def text(self, path: str) -> str | None:
        if path not in self._read:  # every run's flags hash the same modules: one git call per file
            shown = self._git("show", f"{self.rev}:{path}")
            self._read[path] = shown.stdout if shown.returncode == 0 else None
        return self._read[path]

    def tables(self) -> list[str]:
        listed = self._git("ls-tree", "--name-only", self.rev, "conf/tables/")
        return sorted(Path(p).stem for p in listed.stdout.split() if p.endswith(".yaml"))


@dataclass(frozen=True)
class Number:
    """One number the paper prints in a table: its primary's result (if run) and its verdict."""

    id: str
    what: str
    paper: float | None
    verdict: str  # one of report.VERDICTS
    why: str = ""
    cell: str = ""  # its primary cell and column ("" when it has none)
    column: str = ""
    percent: bool = True
    mean: float | None = None
    n: int = 0
    ci95: float | None = None
    owed: int = 0  # seeds the seed rule still asks for
    flags: tuple[str, ...] = ()  # what a reviewer should know about its runs

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
    claim_list: tuple[tuple[str, str, str], ...] = ()  # (claim, verdict, seeds held) as its page gives them
    top: str = ""  # a ranked table's cells not significantly below the first, as its page names them

    def count(self, *verdicts: str) -> int:
        return sum(n.verdict in verdicts for n in self.numbers)


def numbers(table: Table, table_csv: str, manifest: dict | None = None,
            source: Source | None = None) -> list[Number]:
    """Every paper number of ``table``, judged anew on its primary's row of ``table_csv`` (a committed
    report) with the table as it is now; ``manifest`` (its ``reproduce.json``) gives the scale and
    each run's record, from which the flags are made."""
    manifest = manifest or {}
    scale = manifest.get("scale", "cpu")
    found = {(r["cell"], r["column"]): r for r in csv.DictReader(io.StringIO(table_csv))}
    out = []
    for ref, spec in table.numbers.items():
        primary = table.primary_of(ref)
        if primary is None:
            out.append(Number(ref, spec.what, spec.value, NOT_ATTEMPTED, spec.not_attempted or ""))
            continue
        cell, column = primary
        percent = table.columns[column].percent
        r = found.get(primary)
        mean = float(r["mean"]) if r and r["mean"] else None
        n = int(r["n"]) if r and r["mean"] else 0
        ci95 = ci95_half_width(float(r["std"]), n) if r and r["std"] else None
        record = tuning(source, table, cell)
        failed = failed_seeds(manifest).get(cell, ())
        verdict, why = judge(table, ref, mean, n, ci95, table.at_paper_scale(cell, scale), record, failed)
        seeds = [int(x) for x in (r["seeds"].split() if r else [])]
        # a seed whose run failed was run: the rule does not ask for it again
        owed = seeds_owed(table, n + len(failed), ci95, percent, spec.value) if verdict != NOT_ATTEMPTED else 0
        tuned = (f"{table.cells[cell].tune.key}={json.dumps(record['choice'])}",) if record and record["choice"] is not None else ()
        flags = run_flags(table, cell, scale, seeds, manifest, source.text if source else None, tuned) if seeds else ()
        out.append(Number(ref, spec.what, spec.value, verdict, why, cell, column, percent, mean, n, ci95, owed,
                          flags))
    return out


def tuning(source: Source | None, table: Table, cell: str) -> dict | None:
    """The ``flrep tune`` record of a cell with ``tune:`` (None: none yet, or no tune)."""
    if source is None or table.cells[cell].tune is None:
        return None
    text = source.text(f"docs/reproduction/{table.name}/tuning/{cell}.json")
    return json.loads(text) if text else None


def claims(table_md: str) -> list[tuple[str, str, str]]:
    """(claim, verdict, "held/seeds seeds") of each claim in a committed ``table.md``."""
    found = re.findall(r"^\| (.+?) \| `[^`]*` \| (holds|fails|not run) \((\d+)/(\d+) seeds\) \|$", table_md,
                       re.MULTILINE)
    return [(text, verdict, f"{held}/{seeds} seeds") for text, verdict, held, seeds in found]


def row(source: Source, name: str) -> Row:
    """The index line of table ``name``."""
    table = parse_table(name, source.text(f"conf/tables/{name}.yaml") or "", f"conf/tables/{name}.yaml")
    report = source.text(f"docs/reproduction/{name}/table.csv")
    manifest = json.loads(source.text(f"docs/reproduction/{name}/reproduce.json") or "{}")
    runs: dict[str, int] = {}
    for r in csv.DictReader(io.StringIO(report or "")):
        if r["cell"] in table.cells and int(r["runs"] or 0) > 0:
            runs[r["cell"]] = int(r["runs"])
    seeds = (min(runs.values()), max(runs.values())) if runs else None
    page = source.text(f"docs/reproduction/{name}/table.md") or ""
    listed = claims(page)
    top = re.search(r"^Not significantly below the first: (.+)\.$", page, re.MULTILINE)
    run = [c for c in listed if c[1] != "not run"]
    found = (sum(c[1] == "holds" for c in run), len(run)) if listed else None
    return Row(table, report is not None, len(runs), seeds, tuple(numbers(table, report or "", manifest, source)),
               found, tuple(listed), top.group(1) if top else "")


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


def _diff(x: Number) -> str:
    if x.mean is None:
        return "(runs failed)"
    if x.percent:
        return f"{x.difference:+.2f}".replace("-", "−")
    return f"{x.mean:.3g} vs {x.paper:.3g}"


@dataclass(frozen=True)
class PaperPart:
    """A part of a paper that prints result numbers, from ``conf/papers.yaml``: covered by a table
    file (its numbers are that table's), or counted and not attempted, with why."""

    paper: str
    where: str
    table: str | None
    count: int
    not_attempted: str


def inventory(source: Source, every: list[Row]) -> list[PaperPart]:
    """Every part of the five papers that prints result numbers (``conf/papers.yaml``), each table
    file's count taken from its ``numbers:``."""
    import yaml

    raw = yaml.safe_load(source.text(PAPERS) or "") or {}
    counts = {r.table.name: len(r.numbers) for r in every}
    parts = []
    for paper in raw.get("papers", []):
        for part in paper["tables"]:
            table = part.get("table")
            parts.append(PaperPart(paper["paper"], part["where"], table,
                                   counts.get(table, 0) if table else int(part["count"]),
                                   "" if table else str(part["not_attempted"])))
    return parts


def markdown(every: list[Row], parts: list[PaperPart] = ()) -> str:
    """The index page."""
    total = [n for r in every for n in r.numbers]
    uncovered = [p for p in parts if p.table is None]
    printed = len(total) + sum(p.count for p in uncovered)
    counts = {v: sum(n.verdict == v for n in total) for v in VERDICTS}
    counts[NOT_ATTEMPTED] += sum(p.count for p in uncovered)
    attempted = printed - counts[NOT_ATTEMPTED]
    reasons: dict[str, int] = {}
    for n in total:
        if n.verdict == NOT_ATTEMPTED:
            key = _reason(n.why)
            reasons[key] = reasons.get(key, 0) + 1
    for p in uncovered:
        key = _reason(p.not_attempted)
        reasons[key] = reasons.get(key, 0) + p.count
    lines = [
        "# Reproductions: results on one screen", "",
        f"Every result number the papers print, judged on one primary cell each; generated from the committed "
        f"tables by `{COMMAND}` (do not edit by hand). The protocol: "
        "[how the tables are made](reproduction/how_it_works.md).", "",
        f"**{printed} printed numbers** ([inventory](#what-the-papers-print)): {attempted} attempted, of which "
        f"**{counts[AGREES]} agree**, {counts[DIAGNOSED]} differ with a diagnosis, {counts[DIFFERS]} differ, "
        f"{counts[INCONCLUSIVE]} are inconclusive; {counts[NOT_ATTEMPTED]} not attempted ("
        + "; ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) + ").", "",
        "| paper table | numbers | agrees | differs, diagnosed | differs | inconclusive | not attempted "
        "| seeds owed | flagged | claims hold |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in every if r.table.rank is None):
        found = [f.verdict == "holds" for f in r.table.findings]
        held = (f"{(r.claims or (0, 0))[0] + sum(found)}/{(r.claims or (0, 0))[1] + len(found)}"
                if r.claims or found else "–")
        owed = sum(n.owed for n in r.numbers)
        flagged = sum(bool(n.flags) for n in r.numbers)
        lines.append(f"| {_link(r)} | {len(r.numbers) or '–'} | " + " | ".join(
            str(r.count(v)) if r.numbers else "–" for v in VERDICTS) + f" | {owed if r.numbers else '–'} | "
            f"{flagged if r.numbers else '–'} | {held} |")
    lines += ["", "![every attempted number against the paper's](reproduction/index.png)", "",
              "*The figure*: one point per attempted paper number in percent; x the paper's, y our primary's mean "
              "over seeds with its 95% interval (hollow: fewer than two seeds). Shaded: within 1.5 points.", ""]
    benchmarks = [r for r in every if r.table.rank is not None]
    if benchmarks:
        lines += ["## Benchmarks", "",
                  "Methods under one budget, no paper numbers: each page ranks the cells with their 95% "
                  "intervals and says which differences are not significant. The newer methods' own papers, and "
                  "what the offline data allows of them: [compared methods](reproduction/compared_methods.md).", "",
                  "| benchmark | cells run | seeds per cell | not significantly below the first |", "|---|---|---|---|"]
        lines += [f"| {_link(r)} | {r.cells_run} of {len(r.table.cells)} | {_seeds(r)} | {r.top or '–'} |"
                  for r in benchmarks]
        lines.append("")
    lines += [
        "## How to read this", "",
        "- Each paper number is attached to exactly one **primary** cell, declared before it ran: the "
        "paper's settings, where silent the official script's (named in the cell). Every other cell is a "
        "sensitivity row on its table's page, never counted here.",
        "- **agrees**: the primary's mean over 3 or more seeds within 1.5 points of the paper's (1.5% of "
        "its value for other units). **differs, diagnosed**: beyond it, with paired evidence (the "
        "official code on our data gives our number). **differs**: beyond it, without such evidence (a "
        "suspected cause is written on the table's page; it does not change the verdict). "
        "**inconclusive**: fewer than 3 seeds, or a 95% interval wider than ± 3 points. **not attempted**: "
        "with its reason. The paper's number inside our interval is not agreement.",
        "- **seeds owed**: what the seed rule (seeds 0-2 for every primary; 3 and 4 too when its interval "
        "is wider than ± 1.5) still asks. **flagged**: primaries whose runs come from a changed tree, "
        "from several code versions, from another definition of the cell, or whose code changed since; "
        "a commit that the behaviour baseline shows giving the numbers of the code now for the run's "
        "algorithm counts as the code now ([same_numbers.json](reproduction/same_numbers.json)).",
        "- **claims hold**: pass/fail statements of the figure tables, true on every seed run; each claim "
        "and its verdict is listed below.", "",
    ]
    lines += ["## Beyond agreement", "",
              "Per table: the numbers that differ or are inconclusive, then the flags (ids as in "
              "`conf/tables/<table>.yaml`; each table's page gives the reasons).", ""]
    for r in every:
        parts_of = []
        for verdict in (DIFFERS, DIAGNOSED, INCONCLUSIVE):
            shown = [x for x in r.numbers if x.verdict == verdict]
            if shown:
                parts_of.append(f"{verdict}: " + ", ".join(
                    f"`{x.id}` {_diff(x)}" + (f" ({x.n} seed{'s' if x.n > 1 else ''})" if 0 < x.n < 3 else "")
                    for x in shown))
        flagged = [x for x in r.numbers if x.flags]
        if flagged:
            kinds: dict[str, int] = {}
            for x in flagged:
                for f in x.flags:
                    kind = f.split(":")[0]
                    kinds[kind] = kinds.get(kind, 0) + 1
            parts_of.append("flags: " + ", ".join(f"{k} ({v})" for k, v in kinds.items()))
        if parts_of:
            lines.append(f"- {_link(r, f'`{r.table.name}`')}: " + "; ".join(parts_of))
    claimed = [(r, c) for r in every for c in r.claim_list]
    claimed += [(r, (f"{f.text} (an analysis of the runs' models: {f.evidence})", f.verdict, "analysis")) for r in every
                for f in r.table.findings]
    if claimed:
        lines += ["", "## Claims of the figure tables", "", "| table | claim | verdict |", "|---|---|---|"]
        lines += [f"| {_link(r, f'`{r.table.name}`')} | {text} | **{verdict}** ({held}) |"
                  for r, (text, verdict, held) in claimed]
    lines += ["", "## What the papers print", "",
              "Every part of the five papers with result numbers (`conf/papers.yaml`), and where ours are. "
              "What counts as a printed number, table by table: [the inventory](reproduction/inventory.md).", "",
              "| paper | part | numbers | ours |", "|---|---|---|---|"]
    for p in parts:
        target = next((_link(r) for r in every if r.table.name == p.table), "")
        lines.append(f"| {p.paper} | {p.where} | {p.count} | {target or 'not attempted: ' + p.not_attempted} |")
    lines += ["", "## Links", "",
              "- [How the tables are made](reproduction/how_it_works.md): the protocol, `flrep reproduce`, "
              "`flrep tune`, resuming, what is committed, when runs go stale.",
              "- [The inventory](reproduction/inventory.md): how the printed numbers are counted.",
              "- Evidence behind the diagnoses: [reproduction/evidence/](reproduction/evidence/).",
              "- `flrep reproduce --list`: every table with its cells and cost on a 2-core CPU.",
              "- Results without a seeded table: [analyses](analyses.md).", ""]
    return "\n".join(lines)


def _reason(text: str) -> str:
    """The kind of a not-attempted reason: its words before the first colon."""
    return (text or "no reason given").split(":")[0].strip()


def write_index(source: Source, root: Path) -> tuple[Path, Path]:
    """Write the page and the figure under ``root`` (atomically) from ``source``; return their paths."""
    from flower_app.run.run_dir import write_atomic

    every = rows(source)
    page, figure = root / PAGE, root / FIGURE
    text = markdown(every, inventory(source, every))
    write_atomic(page, lambda tmp: Path(tmp).write_text(text))
    plot(every, figure)
    return page, figure
