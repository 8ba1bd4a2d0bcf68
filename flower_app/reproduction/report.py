"""A paper table's report from its completed runs: one row per (cell, column) with ours (mean ±
std over seeds, 95% interval) beside the paper's, the claims checked seed by seed, as Markdown and CSV."""

from __future__ import annotations

import csv
import io
import statistics

from flower_app.reproduction.ranking import ranking_lines
from flower_app.reproduction.seed_stats import ci95_half_width
from flower_app.reproduction.table_model import Table


def cell_values(table: Table, cell: str, summaries: dict[int, dict], column: str) -> dict[int, float]:
    """seed -> the column's value in ``cell``'s runs (×100 for percent columns); seeds without the
    key are left out."""
    col = table.columns[column]
    values = {seed: col.value(s, table.cells[cell].keys.get(column)) for seed, s in summaries.items()}
    return {seed: v for seed, v in values.items() if v is not None}


def rows(table: Table, done: dict[str, dict[int, dict]], scale: str, tunings: dict[str, dict] | None = None,
         failed: dict[str, tuple[int, ...]] | None = None) -> list[dict]:
    """One row per (cell, column): ours (mean, std, n), the paper's, difference, within tolerance,
    and, for a primary's paper number, its verdict at ``scale`` (``tunings``: the tuning records of
    the cells whose tuning ran)."""
    out = []
    for cell in table.cells.values():
        summaries = done.get(cell.name, {})
        walls = [s["wall_time_s"] for s in summaries.values() if isinstance(s.get("wall_time_s"), (int, float))]
        for col in (table.columns[c] for c in cell.columns):
            values = cell_values(table, cell.name, summaries, col.name)
            mean = statistics.fmean(values.values()) if values else None
            std = statistics.stdev(values.values()) if len(values) > 1 else (0.0 if values else None)
            paper = table.paper_value(cell.name, col.name)
            diff = mean - paper if mean is not None and paper is not None else None
            within = (abs(diff) <= table.tolerance if diff is not None and table.tolerance is not None and col.percent
                      else None)
            half = ci95_half_width(std, len(values)) if diff is not None else None
            metric = f"{col.label} (`{cell.keys[col.name]}`)" if col.name in cell.keys else col.label
            number = cell.paper.get(col.name)
            judged = (judge(table, number, mean, len(values), half, table.at_paper_scale(cell.name, scale),
                            (tunings or {}).get(cell.name), (failed or {}).get(cell.name, ()))
                      if cell.primary and number else ("", ""))
            out.append({"cell": cell.name, "label": cell.label, "column": col.name, "metric": metric,
                        "number": number or "", "role": "primary" if cell.primary else "sensitivity",
                        "verdict": judged[0], "why": judged[1],
                        "runs": len(summaries), "n": len(values), "mean": mean, "std": std, "seeds": sorted(values),
                        "paper": paper, "difference": diff, "within_tolerance": within,
                        "ci95": half, "paper_in_ci95": None if half is None else abs(diff) <= half,
                        "wall_s_per_seed": statistics.fmean(walls) if walls else None})
    return out


AGREES, DIAGNOSED, DIFFERS, INCONCLUSIVE, NOT_ATTEMPTED = (
    "agrees", "differs, diagnosed", "differs", "inconclusive", "not attempted")
VERDICTS = (AGREES, DIAGNOSED, DIFFERS, INCONCLUSIVE, NOT_ATTEMPTED)
MIN_SEEDS = 3  # every primary runs seeds 0-2
MORE_SEEDS = 5  # a primary whose interval is wider than the tolerance runs seeds 3 and 4 as well


def judge(table: Table, number: str, mean: float | None, n: int, ci95: float | None,
          at_paper_scale: bool, tuning: dict | None = None, failed: tuple[int, ...] = ()) -> tuple[str, str]:
    """(verdict, why) of paper number ``number`` from its primary's ``n`` seeds (mean, 95% half-width):
    *not attempted* (its reason; or its primary ran only at a reduced scale, or not yet), else
    *inconclusive* (fewer than 3 seeds, or a half-width above twice the tolerance while the interval
    still reaches the tolerance band: too few seeds to tell), else *agrees*
    (the mean within the tolerance), else *differs, diagnosed* (the table's ``diagnosed:``: paired
    evidence), else *differs*. The paper's number inside our interval is not agreement. ``tuning``:
    the record of the primary's ``tune:`` (None: not run yet; its choice null: every value failed, so
    the number *differs*); ``failed``: the seeds whose runs failed (a primary with failed runs and no
    completed one *differs*: the paper's setting did not run through)."""
    spec = table.numbers[number]
    if spec.not_attempted is not None:
        return NOT_ATTEMPTED, spec.not_attempted
    cell = table.cells[table.primary_of(number)[0]]
    if cell.tune is not None and tuning is None:
        where = f"--out docs/reproduction/{table.name}" if at_paper_scale else "--scale paper --out DIR"
        why = (f"awaits tuning: {cell.tune.key} over {list(cell.tune.grid)} on validation data "
               f"(flrep tune {table.name} {cell.name} {where})")
        needs = None if at_paper_scale else table.scales["paper"].get("needs")
        return NOT_ATTEMPTED, why + (f"; the paper's scale needs {needs}" if needs else "")
    if cell.tune is not None and tuning["choice"] is None:
        return DIFFERS, f"every value of its tuning of {cell.tune.key} failed (tuning/{cell.name}.json): nothing to run"
    if not at_paper_scale:
        return NOT_ATTEMPTED, "needs " + table.scales["paper"].get("needs", "the paper's scale")
    if (mean is None or n == 0) and failed:
        return DIFFERS, f"its runs failed (seed {', '.join(map(str, failed))}; see their logs)"
    if mean is None or n == 0:
        return NOT_ATTEMPTED, "declared, not run yet"
    tol = table.tolerance if table.tolerance is not None else 1.5
    percent = next(table.columns[col].percent for cell in table.cells.values() if cell.primary
                   for col, ref in cell.paper.items() if ref == number)
    allowed = tol if percent else tol / 100 * abs(spec.value)
    if n < MIN_SEEDS:
        return INCONCLUSIVE, f"{n} of {MIN_SEEDS} seeds"
    if ci95 is not None and ci95 > 2 * allowed + 1e-9 and abs(mean - spec.value) - ci95 <= allowed + 1e-9:
        return INCONCLUSIVE, f"95% interval ± {ci95:.3g}, wider than ± {2 * allowed:.3g}"
    if abs(mean - spec.value) <= allowed + 1e-9:
        return AGREES, ""
    if number in table.diagnosed:
        return DIAGNOSED, table.diagnosed[number].reason
    return DIFFERS, table.suspected.get(number, "")


def failed_seeds(manifest: dict) -> dict[str, tuple[int, ...]]:
    """cell -> the seeds whose runs ``manifest`` (a ``reproduce.json``) records as failed."""
    out: dict[str, list[int]] = {}
    for key, record in manifest.get("runs", {}).items():
        cell, _, seed = key.partition("/seed")
        if record.get("status") == "failed" and seed.isdigit():
            out.setdefault(cell, []).append(int(seed))
    return {cell: tuple(sorted(seeds)) for cell, seeds in out.items()}


def seeds_owed(table: Table, n: int, ci95: float | None, percent: bool, paper: float) -> int:
    """Seeds the seed rule still asks of a primary with ``n`` seeds: 3 for every primary, 5 for one
    whose 95% interval is wider than the tolerance."""
    tol = table.tolerance if table.tolerance is not None else 1.5
    allowed = tol if percent else tol / 100 * abs(paper)
    wide = ci95 is not None and ci95 > allowed + 1e-9
    return max(0, (MORE_SEEDS if wide else MIN_SEEDS) - n)


def claim_results(table: Table, done: dict[str, dict[int, dict]]) -> list[dict]:
    """Each claim checked on every seed both its cells completed."""
    results = []
    for claim in table.claims:
        mine = cell_values(table, claim.cell, done.get(claim.cell, {}), claim.column)
        theirs = (cell_values(table, claim.other, done.get(claim.other, {}), claim.column) if claim.other
                  else {seed: claim.value for seed in mine})
        seeds = sorted(set(mine) & set(theirs))
        holds = sum(claim.holds(mine[s], theirs[s]) for s in seeds)
        verdict = "not run" if not seeds else ("holds" if holds == len(seeds) else "fails")
        results.append({"text": claim.text, "verdict": verdict, "holds_in": holds, "seeds": len(seeds),
                        "statement": f"{claim.cell}.{claim.column} {claim.op} "
                                     f"{claim.other + '.' + claim.column if claim.other else claim.value}"
                                     + (f" (within {claim.within:g})" if claim.within is not None else "")})
    return results


def _fmt(value: float | None, percent: bool) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if percent else f"{value:.3g}"


def _fmt_difference(difference: float | None, paper: float | None, percent: bool) -> str:
    """Points for a percentage; otherwise three digits and the per cent of the paper's value."""
    if difference is None:
        return "–"
    if percent:
        return f"{difference:+.2f}"
    return f"{difference:+.3g}" + (f" ({100 * difference / paper:+.0f}%)" if paper else "")


def markdown(table: Table, scale: str, manifest: dict, table_rows: list[dict], claims: list[dict],
             left_out: list[str], tunings: dict[str, dict] | None = None) -> str:
    """The generated table with its header: setting, machine, commits, differences."""
    runs = {k: r for k, r in manifest.get("runs", {}).items() if r["status"] not in ("started", "interrupted")}
    parts = [p for r in runs.values() for p in (r, *r.get("earlier_parts", [])) if "machine" in p]
    machines = sorted({f"{p['machine'].get('processor')} × {p['machine'].get('cpu_count')} CPUs"
                       + (f", {p['machine']['cuda']}" if p['machine'].get('cuda') else "") for p in parts})
    commits = sorted({str(p.get("commit")) for p in parts})
    dates = sorted(p["date"][:10] for p in parts if "date" in p)
    lines = [f"# {table.title}", "",
             f"Generated by `flrep reproduce {table.name} --scale {scale}`; paper numbers from {table.source}.",
             f"Scale `{scale}`: {table.scales[scale]['note']}.",
             f"Runs: {len(runs)} recorded" + (f", {dates[0]} to {dates[-1]}" if dates else "")
             + (f", on {'; '.join(machines)}" if machines else "") + (f", commits {', '.join(commits)}" if commits else "")
             + ".", ""]
    if left_out:
        lines += [f"**Not counted** ({len(left_out)} completed runs; running the table again replaces them): "
                  + "; ".join(left_out) + ".", ""]
    tol = table.tolerance
    primaries = [r for r in table_rows if r["role"] == "primary"]
    if table.numbers:
        counts = {v: sum(r["verdict"] == v for r in primaries if r["number"]) for v in VERDICTS}
        lost = [n for n in table.numbers.values() if n.not_attempted is not None]
        lines.append(f"**The paper's {len(table.numbers)} numbers**: " + ", ".join(
            f"{counts[v] + (len(lost) if v == NOT_ATTEMPTED else 0)} {v}" for v in VERDICTS)
            + ". Each is judged on its one primary cell; sensitivity rows (below) are never counted.")
        lines.append("")
    if table.says:
        lines += ["## What our primaries say about the paper's claims", ""]
        lines += [f"- {said}" for said in table.says]
        lines += ["", "## Notes", ""]
    for note in table.notes:
        lines.append(f"- {note}")
    if table.notes:
        lines.append("")
    if table.numbers:
        lines += ["## The paper's numbers, each on its primary cell", "",
                  "| number | primary cell | metric | ours (mean ± std over seeds) | seeds | paper | difference "
                  "| 95% interval | verdict |", "|---|---|---|---|---|---|---|---|---|"]
        by_number = {r["number"]: r for r in primaries if r["number"]}
        for number in table.numbers.values():
            r = by_number.get(number.id)
            if r is None:
                lines.append(f"| {_cell(number.what)} | – | – | – | 0 | {_fmt(number.value, True)} | – | – "
                             f"| not attempted: {_cell(number.not_attempted or '')} |")
                continue
            percent = table.columns[r["column"]].percent
            why = f": {r['why']}" if r["why"] else ""
            lines.append(f"| {_cell(number.what)} | `{r['cell']}` | {_cell(r['metric'])} | {_ours(r, percent)} "
                         f"| {r['n']} | {_fmt(r['paper'], percent)} | "
                         f"{_fmt_difference(r['difference'], r['paper'], percent)} | "
                         f"{'–' if r['ci95'] is None else '± ' + _fmt(r['ci95'], percent)} | "
                         f"**{r['verdict']}**{_cell(why)} |")
        lines.append("")
        evidence = [(ref, d) for ref, d in table.diagnosed.items()]
        if evidence:
            lines.append("**Paired evidence** (`diagnosed:`):")
            lines += [f"- `{ref}`: {d.reason} ([evidence](../../../{d.evidence}))" for ref, d in evidence]
            lines.append("")
        if table.suspected:
            lines.append("**Suspected causes** (`suspected:`; without paired evidence, the verdict stays *differs*):")
            lines += [f"- `{ref}`: {why}" for ref, why in table.suspected.items()]
            lines.append("")
    lines += ranking_lines(table, table_rows)
    for cell, record in (tunings or {}).items():
        scores = ", ".join(f"{value}: " + ("failed" if mean is None else f"{mean:.4f}")
                           for value, mean in record["mean"].items())
        held = f"{record['fraction']:g} of each client's training data held out; test accuracy not read"
        if record["choice"] is None:
            lines += [f"**Tuning found no value** (`flrep tune`): `{cell}` {record['key']}: every value failed "
                      f"over seeds {record['seeds']} ({scores}; {held}).", ""]
            continue
        lines += [f"**Tuned on validation** (`flrep tune`): `{cell}` {record['key']} = **{record['choice']}**, "
                  f"the highest mean {record['metric']} over seeds {record['seeds']} ({scores}; {held}).", ""]
    shown = [r for r in table_rows if r["role"] == "sensitivity" or not table.numbers]
    if shown:
        if table.numbers:
            lines += ["## Sensitivity rows (never counted)", "",
                      "Other settings, run to bracket or test a cause, and cells whose paper number our copy "
                      "lost; a paper number beside them is for reading only.", ""]
        header = "| cell | metric | ours (mean ± std over seeds) | seeds | paper | difference |" + (
            f" within {tol:g} |" if tol is not None else "") + " 95% interval | wall time per seed |"
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for r in shown:
            percent = table.columns[r["column"]].percent
            within = {True: "yes", False: "**no**", None: "–"}[r["within_tolerance"]]
            wall = "–" if r["wall_s_per_seed"] is None else f"{r['wall_s_per_seed'] / 60:.1f} min"
            diff = _fmt_difference(r["difference"], r["paper"], percent)
            interval = "–" if r["ci95"] is None else f"± {_fmt(r['ci95'], percent)}"
            lines.append(f"| {_cell(r['label'])} | {_cell(r['metric'])} | {_ours(r, percent)} | {r['n']} | "
                         f"{_fmt(r['paper'], percent)} | {diff} |" + (f" {within} |" if tol is not None else "")
                         + f" {interval} | {wall} |")
        lines.append("")
    lines += [("*95% interval*: the half-width of the Student-t 95% confidence interval of our mean over seeds; "
               "the paper's own run-to-run spread is not counted. A paper number inside it is not agreement.")]
    if claims:
        lines += ["", "| claim | check | verdict |", "|---|---|---|"]
        for c in claims:
            lines.append(f"| {_cell(c['text'])} | `{c['statement']}` | {c['verdict']} ({c['holds_in']}/{c['seeds']} seeds) |")
    if table.findings:
        lines += ["", "| finding (an analysis of the runs' models) | verdict | evidence |", "|---|---|---|"]
        lines += [f"| {_cell(f.text)} | {f.verdict} | [{f.evidence}](../../../{f.evidence}) |" for f in table.findings]
    lines += ["", "![ours vs the paper](table.png)", ""]
    return "\n".join(lines)


def _ours(r: dict, percent: bool) -> str:
    if r["mean"] is None:
        return "n/a (not reported)" if r["runs"] else "not run"
    return _fmt(r["mean"], percent) + (f" ± {_fmt(r['std'], percent)}" if r["n"] > 1 else "")


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell (a ``|`` would end the cell)."""
    return str(text).replace("|", "\\|")


def table_csv(table_rows: list[dict]) -> str:
    """The report's rows as CSV (one line per cell and column)."""
    buf = io.StringIO()
    fields = ["cell", "label", "column", "metric", "role", "number", "verdict", "why", "runs", "n", "mean", "std", "paper", "difference", "within_tolerance",
              "ci95", "paper_in_ci95", "wall_s_per_seed", "seeds"]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for r in table_rows:
        writer.writerow({**r, "seeds": " ".join(map(str, r["seeds"]))})
    return buf.getvalue()
