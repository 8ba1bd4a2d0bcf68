"""Which earlier commits give the numbers of the code now, by the behaviour baseline.

The seeds of a primary may come from several commits only where the code did not change the
numbers between them. ``python tests/behaviour_baseline.py same-numbers REV ...`` runs the
baseline's cases (``docs/behaviour-baseline``) with the code now and with the code of each commit,
on one machine (numbers drift across machines), and writes what it saw to
``docs/reproduction/same_numbers.json``:

    {"baseline": <hash of the cases' reference files>, "cases": [the cases' names],
     "commits": {"<rev>": {"checked": <date>,
                           "cases": {case: {"algorithm": ..., "experiment": ...,
                                            "result": "same" | "differs" | "not run",
                                            "detail": where it differs, or why it did not run}}}}}

A commit *gives the numbers of now* for a run (its algorithm and experiment) when at least one
case of that algorithm ran with the commit's code, every case of that algorithm or experiment that
ran gave the same numbers, no case of that experiment failed to run (its protocol must be shown,
not assumed), and the record was made against the reference files as they are now (a re-recorded
baseline voids it). The index then counts its runs as the code now; otherwise they stay flagged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable

RECORD = "docs/reproduction/same_numbers.json"
BASELINE = "docs/behaviour-baseline"


def baseline_hash(names: Iterable[str], text: Callable[[str], str | None]) -> str:
    """One sha256 (16 hex digits) over the reference files ``BASELINE/<name>.json`` of the cases."""
    digest = hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode() + b"\0" + (text(f"{BASELINE}/{name}.json") or "\0missing").encode() + b"\0")
    return digest.hexdigest()[:16]


def load(text: Callable[[str], str | None]) -> dict:
    """The committed record (empty when there is none)."""
    raw = text(RECORD)
    return json.loads(raw) if raw else {"baseline": "", "cases": [], "commits": {}}


def gives_numbers_of_now(record: dict, commit: str, algorithm: str, experiment: str,
                         text: Callable[[str], str | None]) -> bool:
    """Whether ``commit``'s code gave the numbers of the code now for a run of ``algorithm`` in ``experiment``,
    by a ``record`` made against the reference files as they are now (``text``: a file's text by path)."""
    if not commit or commit.endswith("+changes") or not record.get("cases"):
        return False
    if record.get("baseline") != baseline_hash(record["cases"], text):
        return False
    cases = record.get("commits", {}).get(commit, {}).get("cases", {}).values()
    mine = [c for c in cases if c["algorithm"] == algorithm or c.get("experiment") == experiment]
    ran = [c for c in mine if c["result"] != "not run"]
    return (any(c["algorithm"] == algorithm for c in ran) and all(c["result"] == "same" for c in ran)
            and not any(c.get("experiment") == experiment and c["result"] == "not run" for c in mine))
