"""The reproduction tables' data model: columns, cells, paper numbers, claims and the table
that holds them (read from ``conf/tables/<name>.yaml`` by :mod:`flower_app.reproduction.tables`)."""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass, field
from typing import Any

SCALES = ("paper", "cpu")
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
       "~=": lambda a, b, within=0.0: abs(a - b) <= within}  # "~=": within ``within`` of each other


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
    paper: dict[str, str]  # column -> the id of the paper number shown beside it
    minutes: dict[str, float]
    at: dict[str, tuple[str, ...]]
    keys: dict[str, str] = field(default_factory=dict)  # column -> the summary key this cell reports it under
    columns: tuple[str, ...] = ()  # the columns this cell reports (the table's rows for it)
    primary: bool = False  # its paper numbers are judged on it (else a sensitivity row, never counted)
    tune: Tune | None = None  # a value the paper tuned and our copy lost, chosen by ``flrep tune``

    def overrides_at(self, table: Table, scale: str) -> list[str]:
        """The cell's overrides at ``scale``: its own, the table's scale's, the cell's at that scale."""
        return [*self.overrides, *table.scales[scale]["overrides"], *self.at.get(scale, ())]


@dataclass(frozen=True)
class Tune:
    """A key whose value ``flrep tune`` chooses for a cell, on validation data, from a declared grid."""

    key: str
    grid: tuple[Any, ...]
    seeds: tuple[int, ...] = (0,)
    fraction: float = 0.2  # the share of each client's training data held out (data.validation_fraction)


@dataclass(frozen=True)
class PaperNumber:
    """One number the paper prints: its value (None: unreadable in our copy), what it is, and why it
    is not attempted (None: a primary cell reproduces it)."""

    id: str
    value: float | None
    what: str
    not_attempted: str | None = None


@dataclass(frozen=True)
class Diagnosis:
    """Why a primary differs, with the paired evidence (a file) that shows it."""

    reason: str
    evidence: str


@dataclass(frozen=True)
class Claim:
    """``cell.column op value`` (or ``op other.column``), checked on every seed's value."""

    text: str
    cell: str
    column: str
    op: str
    value: float | None = None
    other: str | None = None
    within: float | None = None  # op "~=": the largest difference that still holds

    def holds(self, mine: float, theirs: float) -> bool:
        if self.op == "~=":
            return bool(OPS[self.op](mine, theirs, self.within))
        return bool(OPS[self.op](mine, theirs))


@dataclass(frozen=True)
class Finding:
    """A paper's claim checked outside the table's runs (an analysis of their models), with its verdict."""

    text: str
    verdict: str  # holds | fails
    evidence: str


@dataclass(frozen=True)
class Rank:
    """The column a table's page ranks its cells by, and which way is better."""

    column: str
    higher: bool = True  # a larger mean is better


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
    numbers: dict[str, PaperNumber] = field(default_factory=dict)  # every number the paper prints here
    diagnosed: dict[str, Diagnosis] = field(default_factory=dict)  # number id -> paired evidence of a difference
    suspected: dict[str, str] = field(default_factory=dict)  # number id -> a cause not shown by paired evidence
    findings: tuple[Finding, ...] = ()  # claims checked by an analysis of the runs' models
    says: tuple[str, ...] = ()  # what the primaries say about the paper's own claims
    rank: Rank | None = None  # the column the page ranks the cells by (None: no ranking)

    def paper_value(self, cell: str, column: str) -> float | None:
        """The paper's number shown beside ``cell``'s ``column`` (None: none, or unreadable)."""
        ref = self.cells[cell].paper.get(column)
        return None if ref is None else self.numbers[ref].value

    def primary_of(self, number: str) -> tuple[str, str] | None:
        """The primary (cell, column) of paper number ``number``, None when it has none."""
        return next(((c.name, col) for c in self.cells.values() if c.primary
                     for col, ref in c.paper.items() if ref == number), None)

    def at_paper_scale(self, cell: str, scale: str) -> bool:
        """Whether ``cell`` run at ``scale`` is the paper's setting (the scale is ``paper``, or a
        scale whose overrides are the paper's for this cell)."""
        c = self.cells[cell]
        return scale == "paper" or c.overrides_at(self, scale) == c.overrides_at(self, "paper")

    def definition(self, cell: str, scale: str, tuned: tuple[str, ...] = ()) -> str:
        """A short hash of what ``cell`` runs at ``scale``: experiment, overrides (and the ``tuned``
        value), the table's revision."""
        c = self.cells[cell]
        text = json.dumps([c.experiment, [*c.overrides_at(self, scale), *tuned], self.revision])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def minutes(self, scale: str, cells: list[str] | None = None) -> float:
        """Estimated minutes of one seed of ``cells`` (all by default) at ``scale``."""
        return sum(self.cells[c].minutes.get(scale, 0.0) for c in (cells or self.cells))
