"""Paper tables as data: the registry behind ``flrep reproduce`` (``conf/tables/<name>.yaml``).

A table file declares, once, what a paper table reports and how we compute each of its cells::

    title: FedRep Table 1, CIFAR-10        # shown in the generated table's header
    short: FedRep Table 1, CIFAR-10        # optional: the table's name in the index (default: the title)
    source: Collins et al. 2021, Table 1   # where the paper's numbers come from
    columns:                               # what each cell reports: a summary.json key
                                           # (``a.b``: entry ``b`` of the summary's mapping ``a``)
      acc: {key: personalized_accuracy, label: personalized accuracy, percent: true}
    tolerance: 1.5                         # points (percent columns) within which ours agrees
    revision: 2                            # optional (default 1): raise it when a code change makes the
                                           # table's earlier runs wrong; they are moved aside and run again
    scales:                                # `paper`: the paper's setting; `cpu`: a declared reduction
      paper: {note: the paper's setting, overrides: [], needs: "a GPU, about 4 h a run"}
      cpu: {note: 50 rounds instead of 100, overrides: [rounds=50]}
    numbers:                               # every number the paper prints in this table, once each
      fedrep_100x2: {value: 87.13, what: "FedRep, (100, 2)"}
      local_100x2: {value: null, what: "Local Only, (100, 2)", not_attempted: "unreadable in our copy"}
    notes: [why a difference is expected, ...]
    says: [what the primaries say about the paper's own claims, ...]
    rank: {column: acc, better: higher}    # optional: the page ranks the cells by this column (Welch
                                           # t-tests at 5% say which differences are not significant)
    diagnosed:                             # a primary that differs, with paired evidence
      fedrep_100x2: {evidence: docs/reproduction/evidence/x.md, reason: the official code on our data gives 84.1}
    suspected:                             # a primary that differs: a cause not shown by paired evidence
      fedrep_100x2: the JPEG copy          # (shown on the page; the verdict stays "differs")
    cells:
      fedrep:                              # the cell's id (``--only fedrep``, its folder)
        label: FedRep
        experiment: fedrep_cifar10_100x2   # conf/experiment/<name>.yaml
        overrides: [algorithm=fedrep]
        primary: true                      # the paper's numbers below are judged on this cell
        paper: {acc: fedrep_100x2}         # column -> the number's id in ``numbers``
        minutes: {paper: 10, cpu: 5}       # estimated minutes per seed on a 2-core CPU
        at: {cpu: [rounds=40]}             # optional: this cell's own overrides at a scale (after the table's)
        keys: {acc: global_accuracy}       # optional: where this cell's run reports a column under another key
        columns: [acc]                     # optional: the columns this cell reports (default: all)
        tune: {key: fedprox.mu, grid: [0.01, 0.1, 1.0], seeds: [0]}   # optional: a value our copy lost,
                                           # chosen by `flrep tune` on validation data (tuning/<cell>.json);
                                           # also fraction: the share held out (default 0.2)
    claims:                                # optional pass/fail statements on the cells' values
      - {text: "FedAvg learns col(B*)", cell: fedavg, column: dist, op: "<", value: 0.01}
      - {text: "exact heads beat GD heads", cell: fedrep, column: dist, op: "<", other: gdgd}
      - {text: "alpha has little effect", cell: a1, column: acc, op: "~=", other: a0, within: 1.0}
    findings:                              # optional: claims an analysis of the runs' models checks
      - {text: "same-class features grow more similar with tau", verdict: fails, evidence: docs/diagnostics.md}

Each paper number is attached to exactly one **primary** (cell, column), or carries a
``not_attempted`` reason and none. Every other cell is a **sensitivity** row: its ``paper:``
shows the number beside it on the table's page, and it is never counted.

Every check is made when the file is read; an error names the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flower_app.reproduction.table_model import (SCALES, Cell, Claim, Column, Diagnosis, Finding, OPS, PaperNumber,
                                                 Rank, Table, Tune)
from flower_app.run.config import CONF_DIR, experiment_names
from flower_app.run.suggest import did_you_mean
from task.errors import ConfigError

TABLES_DIR = CONF_DIR / "tables"


def table_names() -> list[str]:
    """Names of the table files in ``conf/tables``."""
    return sorted(p.stem for p in TABLES_DIR.glob("*.yaml"))


def load_table(name: str) -> Table:
    """Read and check ``conf/tables/<name>.yaml``."""
    path = TABLES_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown table {name!r}: no {path}; tables: {', '.join(table_names())}"
                          f"{did_you_mean(name, table_names())}")
    return parse_table(name, path.read_text(), str(path))


def parse_table(name: str, text: str, where: str) -> Table:
    """A table from the YAML ``text`` of a table file (another commit's, say); ``where`` names it in errors."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML ({err})") from None
    return _parse(name, raw, Path(where))


def _parse(name: str, raw: Any, path: Path) -> Table:
    def need(mapping: Any, key: str, where: str, kind: type | tuple = str):
        if not isinstance(mapping, dict) or key not in mapping:
            raise ConfigError(f"{path}: {where}{key} is missing")
        if not isinstance(mapping[key], kind):
            raise ConfigError(f"{path}: {where}{key} is {mapping[key]!r}; expected {_kind(kind)}")
        return mapping[key]

    columns = {
        c: Column(c, need(spec, "key", f"columns.{c}."), str(spec.get("label", c)), bool(spec.get("percent", False)))
        for c, spec in need(raw, "columns", "", dict).items()
    }
    scales = need(raw, "scales", "", dict)
    for s in SCALES:
        spec = need(scales, s, "scales.", dict)
        need(spec, "note", f"scales.{s}.")
        _strings(need(spec, "overrides", f"scales.{s}.", list), f"scales.{s}.overrides", path)
    unknown = set(scales) - set(SCALES)
    if unknown:
        raise ConfigError(f"{path}: scales.{sorted(unknown)[0]} is not a scale; expected {', '.join(SCALES)}")
    numbers = _numbers(raw.get("numbers"), path)
    if "needs" in scales["paper"] and not isinstance(scales["paper"]["needs"], str):
        raise ConfigError(f"{path}: scales.paper.needs is {scales['paper']['needs']!r}; expected what the paper's "
                          "scale needs (a string)")
    known_experiments = set(experiment_names())
    cells = {}
    for c, spec in need(raw, "cells", "", dict).items():
        where = f"cells.{c}."
        experiment = need(spec, "experiment", where)
        if experiment not in known_experiments:
            raise ConfigError(f"{path}: {where}experiment={experiment!r} is not a file in conf/experiment/")
        paper = spec.get("paper") or {}
        for col, ref in paper.items():
            if col not in columns:
                raise ConfigError(f"{path}: {where}paper.{col} is not a column ({', '.join(columns)})")
            if ref not in numbers:
                raise ConfigError(f"{path}: {where}paper.{col} is {ref!r}; expected the id of one of the table's "
                                  f"numbers{did_you_mean(str(ref), list(numbers))}")
        primary = spec.get("primary", False)
        if not isinstance(primary, bool):
            raise ConfigError(f"{path}: {where}primary is {primary!r}; expected true or false")
        tune = spec.get("tune")
        if tune is not None:
            fraction = tune.get("fraction", 0.2) if isinstance(tune, dict) else None
            if (not isinstance(tune, dict) or set(tune) - {"key", "grid", "seeds", "fraction"}
                    or not isinstance(tune.get("key"), str)
                    or not isinstance(tune.get("grid"), list) or len(tune["grid"]) < 2
                    or not all(isinstance(s, int) for s in tune.get("seeds", [0]))
                    or not isinstance(fraction, float) or not 0 < fraction < 1):
                raise ConfigError(f"{path}: {where}tune is {tune!r}; expected {{key: <a config key>, grid: [two or "
                                  "more values], seeds: [ints, optional], fraction: <in (0, 1), optional, 0.2>}")
            tune = Tune(tune["key"], tuple(tune["grid"]), tuple(tune.get("seeds", [0])), fraction)
        minutes = spec.get("minutes") or {}
        if set(minutes) - set(SCALES) or not all(isinstance(m, (int, float)) for m in minutes.values()):
            raise ConfigError(f"{path}: {where}minutes is {minutes!r}; expected numbers under {', '.join(SCALES)}")
        at = spec.get("at") or {}
        if not isinstance(at, dict) or set(at) - set(SCALES):
            raise ConfigError(f"{path}: {where}at is {at!r}; expected override lists under {', '.join(SCALES)}")
        keys = spec.get("keys") or {}
        if not isinstance(keys, dict) or set(keys) - set(columns) or not all(isinstance(k, str) for k in keys.values()):
            raise ConfigError(f"{path}: {where}keys is {keys!r}; expected summary keys under columns "
                              f"({', '.join(columns)})")
        reported = spec.get("columns", list(columns))
        if (not isinstance(reported, list) or not reported or set(reported) - set(columns)
                or set(paper) - set(reported) or set(keys) - set(reported)):
            raise ConfigError(f"{path}: {where}columns is {reported!r}; expected a non-empty list of columns "
                              f"({', '.join(columns)}) that holds every column of its paper and keys")
        cells[c] = Cell(c, str(spec.get("label", c)), experiment,
                        tuple(_strings(spec.get("overrides", []), f"{where}overrides", path)),
                        dict(paper), {k: float(v) for k, v in minutes.items()},
                        {s: tuple(_strings(v, f"{where}at.{s}", path)) for s, v in at.items()}, dict(keys),
                        tuple(c for c in columns if c in reported), primary, tune)
    _check_primaries(numbers, cells, path)
    claims = []
    for i, spec in enumerate(raw.get("claims") or []):
        where = f"claims[{i}]."
        claim = Claim(need(spec, "text", where), need(spec, "cell", where), need(spec, "column", where),
                      need(spec, "op", where), spec.get("value"), spec.get("other"), spec.get("within"))
        if (claim.op == "~=") != isinstance(claim.within, (int, float)):
            raise ConfigError(f"{path}: {where} op '~=' needs within: <the largest difference>, and only it")
        for cell in (claim.cell, claim.other):
            if cell is not None and cell not in cells:
                raise ConfigError(f"{path}: {where} names cell {cell!r}; cells: {', '.join(cells)}")
        if claim.column not in columns or claim.op not in OPS or (claim.value is None) == (claim.other is None):
            raise ConfigError(f"{path}: {where} needs a column of {list(columns)}, op one of {list(OPS)} and "
                              "exactly one of value / other")
        for cell in (claim.cell, claim.other):
            if cell is not None and claim.column not in cells[cell].columns:
                raise ConfigError(f"{path}: {where} reads column {claim.column!r} of cell {cell!r}, which reports "
                                  f"only {', '.join(cells[cell].columns)}")
        claims.append(claim)
    rank = raw.get("rank")
    if rank is not None:
        if (not isinstance(rank, dict) or set(rank) - {"column", "better"} or rank.get("column") not in columns
                or rank.get("better", "higher") not in ("higher", "lower")):
            raise ConfigError(f"{path}: rank is {rank!r}; expected {{column: <one of {', '.join(columns)}>, "
                              "better: higher | lower}")
        rank = Rank(rank["column"], rank.get("better", "higher") == "higher")
    tolerance = raw.get("tolerance", 1.5)
    revision = raw.get("revision", 1)
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
        raise ConfigError(f"{path}: revision is {revision!r}; expected a whole number >= 1")
    if "explained" in raw:
        raise ConfigError(f"{path}: explained is no longer a key: a primary that differs is `diagnosed:` (with "
                          "paired evidence) or `suspected:` (a cause without it)")
    diagnosed = {}
    for ref, spec in _mapping(raw, "diagnosed", path).items():
        if (ref not in numbers or not isinstance(spec, dict) or set(spec) != {"reason", "evidence"}
                or not all(isinstance(v, str) and v.strip() for v in spec.values())):
            raise ConfigError(f"{path}: diagnosed.{ref} needs the id of one of the table's numbers and "
                              "{reason: ..., evidence: <a file of the paired evidence>}")
        diagnosed[ref] = Diagnosis(spec["reason"].strip(), spec["evidence"].strip())
    suspected = {}
    for ref, why in _mapping(raw, "suspected", path).items():
        if ref not in numbers or not isinstance(why, str) or not why.strip():
            raise ConfigError(f"{path}: suspected.{ref} needs the id of one of the table's numbers and a reason")
        suspected[ref] = why.strip()
    findings = []
    for i, spec in enumerate(raw.get("findings") or []):
        if (not isinstance(spec, dict) or set(spec) != {"text", "verdict", "evidence"}
                or spec["verdict"] not in ("holds", "fails")):
            raise ConfigError(f"{path}: findings[{i}] needs {{text, verdict: holds | fails, evidence: <a file>}}")
        findings.append(Finding(str(spec["text"]), spec["verdict"], str(spec["evidence"])))
    return Table(name, need(raw, "title", ""), need(raw, "source", ""), columns, cells,
                 {s: scales[s] for s in SCALES}, None if tolerance is None else float(tolerance),
                 tuple(str(n) for n in raw.get("notes") or ()), tuple(claims), revision,
                 str(raw.get("short") or ""), numbers, diagnosed, suspected, tuple(findings),
                 tuple(str(x) for x in raw.get("says") or ()), rank)


def _mapping(raw: dict, key: str, path: Path) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key} is {value!r}; expected a mapping of number ids")
    return value


def _numbers(raw: Any, path: Path) -> dict[str, PaperNumber]:
    """The table's ``numbers:``: id -> {value, what, not_attempted}."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: numbers is {raw!r}; expected a mapping of ids to {{value, what}}")
    out = {}
    for ref, spec in raw.items():
        where = f"{path}: numbers.{ref}"
        if not isinstance(spec, dict) or set(spec) - {"value", "what", "not_attempted"} or "what" not in spec:
            raise ConfigError(f"{where} is {spec!r}; expected {{value: <number or null>, what: <text>, "
                              "not_attempted: <reason, optional>}")
        value, reason = spec.get("value"), spec.get("not_attempted")
        if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))):
            raise ConfigError(f"{where}.value is {value!r}; expected a number, or null when our copy has none")
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            raise ConfigError(f"{where}.not_attempted is {reason!r}; expected a reason")
        if value is None and reason is None:
            raise ConfigError(f"{where}.value is null: a number our copy lost needs a not_attempted reason")
        out[str(ref)] = PaperNumber(str(ref), None if value is None else float(value), str(spec["what"]),
                                    None if reason is None else reason.strip())
    return out


def _check_primaries(numbers: dict[str, PaperNumber], cells: dict[str, Cell], path: Path) -> None:
    """Each paper number on exactly one primary (cell, column), unless it is not attempted (then on none)."""
    primaries: dict[str, list[str]] = {}
    for cell in cells.values():
        for col, ref in cell.paper.items():
            if cell.primary:
                primaries.setdefault(ref, []).append(f"{cell.name}.{col}")
    for ref, number in numbers.items():
        found = primaries.get(ref, [])
        if number.not_attempted is not None and found:
            raise ConfigError(f"{path}: numbers.{ref} is not attempted ({number.not_attempted}) but primary "
                              f"{found[0]} reports it; drop one")
        if number.not_attempted is None and len(found) != 1:
            raise ConfigError(f"{path}: numbers.{ref} needs exactly one primary cell.column (or a not_attempted "
                              f"reason); it has {len(found)}" + (f": {', '.join(found)}" if found else ""))


def _strings(value: Any, where: str, path: Path) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {where} is {value!r}; expected a list of key=value strings")
    return value


def _kind(kind: type | tuple) -> str:
    names = {str: "a string", dict: "a mapping", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
