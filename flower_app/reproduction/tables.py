"""Paper tables as data: the registry behind ``flrep reproduce`` (``conf/tables/<name>.yaml``).

A table file declares, once, what a paper table reports and how we compute each of its cells::

    title: FedRep Table 1, CIFAR-10        # shown in the generated table's header
    short: FedRep Table 1, CIFAR-10        # optional: the table's name in the index (default: the title)
    source: Collins et al. 2021, Table 1   # where the paper's numbers come from
    columns:                               # what each cell reports: a summary.json key
                                           # (``a.b``: entry ``b`` of the summary's mapping ``a``)
      acc: {key: personalized_accuracy, label: personalized accuracy, percent: true}
    tolerance: 1.5                         # points (percent columns) within which ours matches
    revision: 2                            # optional (default 1): raise it when a code change makes the
                                           # table's earlier runs wrong; they are moved aside and run again
    scales:                                # `paper`: the paper's setting; `cpu`: a declared reduction
      paper: {note: the paper's setting, overrides: []}
      cpu: {note: 50 rounds instead of 100, overrides: [rounds=50]}
    notes: [why a difference is expected, ...]
    explained:                             # optional: numbers beyond the tolerance whose cause the notes
      fedrep.acc: 5 local epochs, not 1    # measure (cell.column: a one-line reason), counted as explained
                                           # in the index (docs/reproduction.md); notes and reasons never
                                           # make a run stale
    cells:
      fedrep:                              # the cell's id (``--only fedrep``, its folder)
        label: FedRep
        experiment: fedrep_cifar10_100x2   # conf/experiment/<name>.yaml
        overrides: [algorithm=fedrep]
        paper: {acc: 87.13}                # null (or absent): not in our copy of the paper
        minutes: {paper: 10, cpu: 5}       # estimated minutes per seed on a 2-core CPU
        at: {cpu: [rounds=40]}             # optional: this cell's own overrides at a scale (after the table's)
        keys: {acc: global_accuracy}       # optional: where this cell's run reports a column under another key
        columns: [acc]                     # optional: the columns this cell reports (default: all)
    claims:                                # optional pass/fail statements on the cells' values
      - {text: "FedAvg learns col(B*)", cell: fedavg, column: dist, op: "<", value: 0.01}
      - {text: "exact heads beat GD heads", cell: fedrep, column: dist, op: "<", other: gdgd}

Every check is made when the file is read; an error names the file and the key.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flower_app.run.config import CONF_DIR, experiment_names
from flower_app.run.suggest import did_you_mean
from task.errors import ConfigError

TABLES_DIR = CONF_DIR / "tables"
SCALES = ("paper", "cpu")
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@dataclass(frozen=True)
class Column:
    """One reported quantity: a ``summary.json`` key, shown ×100 when ``percent``."""

    name: str
    key: str
    label: str
    percent: bool

    def value(self, summary: dict, key: str | None = None) -> float | None:
        """The column's number in ``summary`` (×100 when percent), read from ``key`` (default: the
        column's own), or None when it has none.

        A dotted key ``a.b`` reads entry ``b`` of the mapping ``a`` (e.g. ``newclient_error.20``).
        """
        value: Any = summary
        for part in (key or self.key).split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value) * (100 if self.percent else 1)


@dataclass(frozen=True)
class Cell:
    """One row of a table: an experiment with overrides, run once per seed."""

    name: str
    label: str
    experiment: str
    overrides: tuple[str, ...]
    paper: dict[str, float]
    minutes: dict[str, float]
    at: dict[str, tuple[str, ...]]
    keys: dict[str, str] = field(default_factory=dict)  # column -> the summary key this cell reports it under
    columns: tuple[str, ...] = ()  # the columns this cell reports (the table's rows for it)

    def overrides_at(self, table: Table, scale: str) -> list[str]:
        """The cell's overrides at ``scale``: its own, the table's scale's, the cell's at that scale."""
        return [*self.overrides, *table.scales[scale]["overrides"], *self.at.get(scale, ())]


@dataclass(frozen=True)
class Claim:
    """``cell.column op value`` (or ``op other.column``), checked on every seed's value."""

    text: str
    cell: str
    column: str
    op: str
    value: float | None = None
    other: str | None = None

    def holds(self, mine: float, theirs: float) -> bool:
        return bool(OPS[self.op](mine, theirs))


@dataclass(frozen=True)
class Table:
    """A paper table: its columns, cells, scales and claims."""

    name: str
    title: str
    source: str
    columns: dict[str, Column]
    cells: dict[str, Cell]
    scales: dict[str, dict[str, Any]]
    tolerance: float | None
    notes: tuple[str, ...] = ()
    claims: tuple[Claim, ...] = field(default=())
    revision: int = 1  # runs recorded under an older revision no longer count
    short: str = ""  # the table's name in the index (the title when empty)
    explained: dict[tuple[str, str], str] = field(default_factory=dict)  # (cell, column) -> why it differs

    def minutes(self, scale: str, cells: list[str] | None = None) -> float:
        """Estimated minutes of one seed of ``cells`` (all by default) at ``scale``."""
        return sum(self.cells[c].minutes.get(scale, 0.0) for c in (cells or self.cells))


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
    known_experiments = set(experiment_names())
    cells = {}
    for c, spec in need(raw, "cells", "", dict).items():
        where = f"cells.{c}."
        experiment = need(spec, "experiment", where)
        if experiment not in known_experiments:
            raise ConfigError(f"{path}: {where}experiment={experiment!r} is not a file in conf/experiment/")
        paper = spec.get("paper") or {}
        for col, value in paper.items():
            if col not in columns:
                raise ConfigError(f"{path}: {where}paper.{col} is not a column ({', '.join(columns)})")
            if value is not None and not isinstance(value, (int, float)):
                raise ConfigError(f"{path}: {where}paper.{col} is {value!r}; expected a number or null")
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
                        {k: float(v) for k, v in paper.items() if v is not None},
                        {k: float(v) for k, v in minutes.items()},
                        {s: tuple(_strings(v, f"{where}at.{s}", path)) for s, v in at.items()}, dict(keys),
                        tuple(c for c in columns if c in reported))
    claims = []
    for i, spec in enumerate(raw.get("claims") or []):
        where = f"claims[{i}]."
        claim = Claim(need(spec, "text", where), need(spec, "cell", where), need(spec, "column", where),
                      need(spec, "op", where), spec.get("value"), spec.get("other"))
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
    tolerance = raw.get("tolerance", 1.5)
    revision = raw.get("revision", 1)
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
        raise ConfigError(f"{path}: revision is {revision!r}; expected a whole number >= 1")
    explained = {}
    if not isinstance(raw.get("explained") or {}, dict):
        raise ConfigError(f"{path}: explained is {raw['explained']!r}; expected a mapping of cell.column to a reason")
    for key, why in (raw.get("explained") or {}).items():
        cell, _, column = str(key).partition(".")
        if cell not in cells or column not in cells[cell].paper or not isinstance(why, str) or not why.strip():
            raise ConfigError(f"{path}: explained.{key} needs a key cell.column of a cell with a paper number "
                              "in that column, and a reason")
        explained[(cell, column)] = why.strip()
    return Table(name, need(raw, "title", ""), need(raw, "source", ""), columns, cells,
                 {s: scales[s] for s in SCALES}, None if tolerance is None else float(tolerance),
                 tuple(str(n) for n in raw.get("notes") or ()), tuple(claims), revision,
                 str(raw.get("short") or ""), explained)


def _strings(value: Any, where: str, path: Path) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: {where} is {value!r}; expected a list of key=value strings")
    return value


def _kind(kind: type | tuple) -> str:
    names = {str: "a string", dict: "a mapping", list: "a list"}
    return " or ".join(names.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
