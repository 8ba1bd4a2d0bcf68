"""The flags of a primary's counted runs on the index and its table's page: what a reviewer should know
before trusting them (a changed tree, several code versions, another definition, code changed since)."""

from __future__ import annotations

import json
from collections.abc import Callable

from flower_app.reproduction import code_versions
from flower_app.reproduction.table_model import Table
from flower_app.results.provenance import source_hash


def run_flags(table: Table, cell: str, scale: str, seeds: list[int], manifest: dict,
              text: Callable[[str], str | None] | None, tuned: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What a reviewer should know about a primary's counted runs: a seed from a changed tree, seeds
    from more than one code version, a cell definition other than the one now, code that changed
    since (for runs that recorded their modules), records missing. Code versions whose commits the
    behaviour baseline shows giving the numbers of now (:mod:`code_versions`) count as the code now."""
    records = [manifest.get("runs", {}).get(f"{cell}/seed{s}") for s in seeds]
    if not all(records):
        return ("no run record",)
    flags = []
    dirty = [s for s, rec in zip(seeds, records) if str(rec.get("commit")).endswith("+changes")
             or rec.get("clean") is False]
    if dirty:
        flags.append("changed tree: seed " + ", ".join(map(str, dirty)))
    record = code_versions.load(text) if text is not None else {}
    now = [_code_of_now(table, cell, s, rec, record, text) for s, rec in zip(seeds, records)]
    versions = {(rec.get("source") or {}).get("hash") or rec.get("commit") for rec in records}
    if len(versions) > 1 and not all(now):
        flags.append(f"seeds from {len(versions)} code versions")
    definition = table.definition(cell, scale, tuned)
    defined = [rec.get("definition") for rec in records]
    if any(d is None for d in defined):
        flags.append("definition not recorded")
    if any(d is not None and d != definition for d in defined):
        flags.append("definition changed after its first run")
    if text is not None and any(rec.get("source") and not ok for rec, ok in zip(records, now)):
        flags.append("code changed since")
    return tuple(flags)


def _code_of_now(table: Table, cell: str, seed: int, rec: dict, record: dict,
                 text: Callable[[str], str | None] | None) -> bool:
    """Whether a run's code is the code now: the same source, or a commit that the behaviour baseline
    shows giving the numbers of now for the run's algorithm and experiment (``record``: same_numbers.json)."""
    if text is None:
        return False
    if rec.get("source") and source_hash(rec["source"]["modules"], text) == rec["source"]["hash"]:
        return True
    summary = json.loads(text(f"docs/reproduction/{table.name}/runs/{cell}/seed{seed}/summary.json") or "{}")
    modules = (rec.get("source") or {}).get("modules")
    return code_versions.gives_numbers_of_now(record, str(rec.get("commit") or ""),
                                              str(summary.get("algorithm") or ""), str(summary.get("experiment") or ""),
                                              modules, text)
