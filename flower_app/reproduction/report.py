"""A paper table's report from its completed runs: one row per (cell, column) with ours (mean ±
std over seeds, 95% interval) beside the paper's, the claims checked seed by seed, as Markdown and CSV."""

from __future__ import annotations

import csv
import io
import statistics

from flower_app.reproduction.tables import Table


def cell_values(table: Table, cell: str, summaries: dict[int, dict], column: str) -> dict[int, float]:
    """seed -> the column's value in ``cell``'s runs (×100 for percent columns); seeds without the
    key are left out."""
    col = table.columns[column]
    values = {seed: col.value(s, table.cells[cell].keys.get(column)) for seed, s in summaries.items()}
    return {seed: v for seed, v in values.items() if v is not None}


def rows(table: Table, done: dict[str, dict[int, dict]]) -> list[dict]:
    """One row per (cell, column): ours (mean, std, n), the paper's, difference, within tolerance."""
    out = []
    for cell in table.cells.values():
        summaries = done.get(cell.name, {})
        walls = [s["wall_time_s"] for s in summaries.values() if isinstance(s.get("wall_time_s"), (int, float))]
        for col in (table.columns[c] for c in cell.columns):
            values = cell_values(table, cell.name, summaries, col.name)
            mean = statistics.fmean(values.values()) if values else None
            std = statistics.stdev(values.values()) if len(values) > 1 else (0.0 if values else None)
            paper = cell.paper.get(col.name)
            diff = mean - paper if mean is not None and paper is not None else None
            within = (abs(diff) <= table.tolerance if diff is not None and table.tolerance is not None and col.percent
                      else None)
            half = ci95_half_width(std, len(values)) if diff is not None else None
            metric = f"{col.label} (`{cell.keys[col.name]}`)" if col.name in cell.keys else col.label
            out.append({"cell": cell.name, "label": cell.label, "column": col.name, "metric": metric,
                        "runs": len(summaries), "n": len(values), "mean": mean, "std": std, "seeds": sorted(values),
                        "paper": paper, "difference": diff, "within_tolerance": within,
                        "ci95": half, "paper_in_ci95": None if half is None else abs(diff) <= half,
                        "wall_s_per_seed": statistics.fmean(walls) if walls else None})
    return out


def ci95_half_width(std: float | None, n: int) -> float | None:
    """Half-width of the 95% Student-t interval of a mean of ``n`` values with sample std ``std``
    (None below two values)."""
    if std is None or n < 2:
        return None
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1)) * std / n**0.5


def verdict(table: Table, cell: str, column: str, percent: bool, mean: float, paper: float,
            n: int, ci95: float | None) -> str:
    """The verdict of one number: ``within`` the table's tolerance (points for a percentage, per
    cent of the paper's value otherwise), else ``interval`` (the paper's number inside our 95%
    interval, two seeds or more), else ``declared`` (a reason in the table's ``explained:``), else ``open``."""
    tol = table.tolerance
    diff = abs(mean - paper)
    if tol is not None and diff <= (tol if percent else tol / 100 * abs(paper)) + 1e-9:
        return "within"
    if n >= 2 and ci95 is not None and diff <= ci95:
        return "interval"
    if (cell, column) in table.explained:
        return "declared"
    return "open"


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
                                     f"{claim.other + '.' + claim.column if claim.other else claim.value}"})
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
             left_out: list[str]) -> str:
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
    beyond = [r for r in table_rows if r["within_tolerance"] is False]
    if beyond:
        lines.append(f"**Differences beyond {tol:g} points**: " + "; ".join(
            f"{r['label']} {r['metric']} {r['difference']:+.2f}"
            + {True: " (the paper's number lies inside our 95% interval)",
               False: " (outside our 95% interval)", None: ""}[r["paper_in_ci95"]]
            for r in beyond) + ". Why: see the notes.")
        lines.append("")
    declared = [r for r in table_rows if r["difference"] is not None and (r["cell"], r["column"]) in table.explained
                and verdict(table, r["cell"], r["column"], table.columns[r["column"]].percent, r["mean"], r["paper"],
                            r["n"], r["ci95"]) != "within"]
    if declared:
        lines.append("**Explained by the notes** (the table's `explained:`):")
        lines += [f"- `{r['cell']}.{r['column']}`: {table.explained[(r['cell'], r['column'])]}" for r in declared]
        lines.append("")
    for note in table.notes:
        lines.append(f"- {note}")
    if table.notes:
        lines.append("")
    header = "| cell | metric | ours (mean ± std over seeds) | seeds | paper | difference |" + (
        f" within {tol:g} |" if tol is not None else "") + " paper in our 95% interval | wall time per seed |"
    lines += [header, "|" + "---|" * (header.count("|") - 1)]
    for r in table_rows:
        percent = table.columns[r["column"]].percent
        if r["mean"] is None:
            ours = "n/a (not reported)" if r["runs"] else "not run"
        else:
            ours = _fmt(r["mean"], percent) + (f" ± {_fmt(r['std'], percent)}" if r["n"] > 1 else "")
        within = {True: "yes", False: "**no**", None: "–"}[r["within_tolerance"]]
        wall = "–" if r["wall_s_per_seed"] is None else f"{r['wall_s_per_seed'] / 60:.1f} min"
        diff = _fmt_difference(r["difference"], r["paper"], percent)
        interval = "–" if r["ci95"] is None else (
            f"{'yes' if r['paper_in_ci95'] else 'no'} (± {_fmt(r['ci95'], percent)})")
        lines.append(f"| {_cell(r['label'])} | {_cell(r['metric'])} | {ours} | {r['n']} | {_fmt(r['paper'], percent)} | {diff} |"
                     + (f" {within} |" if tol is not None else "") + f" {interval} | {wall} |")
    if any(r["ci95"] is not None for r in table_rows):
        lines += ["", ("*Paper in our 95% interval*: whether the paper's number lies inside the Student-t 95% "
                       "confidence interval of our mean over seeds (± its half-width); the paper's own run-to-run "
                       "spread is not counted.")]
    if claims:
        lines += ["", "| claim | check | verdict |", "|---|---|---|"]
        for c in claims:
            lines.append(f"| {_cell(c['text'])} | `{c['statement']}` | {c['verdict']} ({c['holds_in']}/{c['seeds']} seeds) |")
    lines += ["", "![ours vs the paper](table.png)", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell (a ``|`` would end the cell)."""
    return str(text).replace("|", "\\|")


def table_csv(table_rows: list[dict]) -> str:
    """The report's rows as CSV (one line per cell and column)."""
    buf = io.StringIO()
    fields = ["cell", "label", "column", "metric", "runs", "n", "mean", "std", "paper", "difference", "within_tolerance",
              "ci95", "paper_in_ci95", "wall_s_per_seed", "seeds"]
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for r in table_rows:
        writer.writerow({**r, "seeds": " ".join(map(str, r["seeds"]))})
    return buf.getvalue()
