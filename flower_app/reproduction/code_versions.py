"""Which earlier commits give the numbers of the code now, by the behaviour baseline.

The seeds of a primary may come from several commits only where the code did not change the
numbers between them. ``python tests/behaviour_baseline.py same-numbers REV ...`` runs the
baseline's cases (``docs/behaviour-baseline``) with the code now and with the code of each commit,
on one machine (numbers drift across machines), and writes what it saw to
``docs/reproduction/same_numbers.json``:

    {"code": {path: <hash of its text>} of every module of the code now that the cases ran against,
     "commits": {"<rev>": {"checked": <date>,
                           "cases": {case: {"algorithm": ..., "experiment": ...,
                                            "result": "same" | "differs" | "not run",
                                            "detail": where it differs, or why it did not run,
                                            "reference": <hash of the case's reference file then>,
                                            "checked": <date, for a case checked alone later>}}}},
     "machine": <CPU model, torch version>, "outputs": {case: <hash of the numbers the code now gives there>}}

When the code changes, ``same-numbers`` runs the cases with it: if it gives exactly the numbers the
record was made against (``outputs``, on the same ``machine``), every commit's result holds for it
and the record carries over; otherwise the record starts empty.

A commit *gives the numbers of now* for a run (its algorithm and experiment) when at least one
case of that algorithm ran with the commit's code, every case of that algorithm or experiment that
ran gave the same numbers, no case of that experiment failed to run (its protocol must be shown,
not assumed), and the check was made against the code as it is now (a change to a module the run
executed voids it). A case re-recorded since the check (its definition changed) counts as not run
there, as does a case that did not exist then: it voids the runs of its experiment and says nothing
of its algorithm until ``same-numbers --cases NAME`` checks it again. The index then counts the runs
as the code now; otherwise they stay flagged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable

RECORD = "docs/reproduction/same_numbers.json"
BASELINE = "docs/behaviour-baseline"


def reference_hash(name: str, text: Callable[[str], str | None]) -> str:
    """The sha256 (16 hex digits) of case ``name``'s reference file ``BASELINE/<name>.json``."""
    return hashlib.sha256((text(f"{BASELINE}/{name}.json") or "\0missing").encode()).hexdigest()[:16]


def code_hashes(paths: Iterable[str], text: Callable[[str], str | None]) -> dict[str, str]:
    """``{path: sha256 of its text (16 hex digits)}``; a missing file hashes as "missing"."""
    return {p: hashlib.sha256((text(p) or "\0missing").encode()).hexdigest()[:16] for p in sorted(paths)}


def load(text: Callable[[str], str | None]) -> dict:
    """The committed record (empty when there is none)."""
    raw = text(RECORD)
    return json.loads(raw) if raw else {"code": {}, "commits": {}}


def gives_numbers_of_now(record: dict, commit: str, algorithm: str, experiment: str, modules: list[str] | None,
                         text: Callable[[str], str | None]) -> bool:
    """Whether ``commit``'s code gave the numbers of the code now for a run of ``algorithm`` in ``experiment``
    that executed ``modules`` (None: not recorded, so every module the record knows), by a ``record`` made
    against those modules and the cases' reference files as they are now (``text``: a file's text by path)."""
    entry = record.get("commits", {}).get(commit)
    if not commit or commit.endswith("+changes") or not entry or not record.get("code"):
        return False
    checked = record["code"]
    paths = list(checked) if modules is None else modules
    if any(path not in checked for path in paths) or code_hashes(paths, text) != {p: checked[p] for p in paths}:
        return False
    mine = [case if case.get("reference") == reference_hash(name, text) else {**case, "result": "not run"}
            for name, case in entry["cases"].items()  # re-recorded since: not checked on its definition of now
            if case["algorithm"] == algorithm or case.get("experiment") == experiment]
    ran = [c for c in mine if c["result"] != "not run"]
    return (any(c["algorithm"] == algorithm for c in ran) and all(c["result"] == "same" for c in ran)
            and not any(c.get("experiment") == experiment and c["result"] == "not run" for c in mine))
