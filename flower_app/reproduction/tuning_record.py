"""What ``flrep tune`` chose for a cell: ``DIR/tuning/<cell>.json``, read back by ``flrep reproduce``
and the table's report. A record whose ``choice`` is null says that every value of the grid failed:
the cell has nothing to run and its paper numbers differ."""

from __future__ import annotations

import json
from pathlib import Path

from flower_app.reproduction.table_model import Cell
from task.errors import ConfigError

TUNING = "tuning"  # DIR/tuning/<cell>.json: what ``flrep tune`` chose for a cell


def tuning_record(out: Path, cell: Cell) -> dict | None:
    """The tuning record of ``cell`` (with ``tune:``) in ``out``; None when its tuning has not been
    run. A record made for another grid, key, seeds or fraction is refused."""
    path = out / TUNING / f"{cell.name}.json"
    if cell.tune is None or not path.is_file():
        return None
    record = json.loads(path.read_text())
    declared = {"key": cell.tune.key, "grid": list(cell.tune.grid), "seeds": list(cell.tune.seeds),
                "fraction": cell.tune.fraction}
    differing = [k for k, v in declared.items() if record.get(k) != v]
    if differing:
        raise ConfigError(f"{path}: made for another tune: of cell {cell.name!r} ({', '.join(differing)} differ); "
                          "move it aside and run `flrep tune` again")
    return record


def tuned_overrides(out: Path, cell: Cell) -> tuple[str, ...] | None:
    """``(key=choice,)`` for a cell with ``tune:``; () for a cell without; None when the cell's
    tuning has not been run or chose nothing (every value failed)."""
    if cell.tune is None:
        return ()
    record = tuning_record(out, cell)
    if record is None or record["choice"] is None:
        return None
    return (f"{cell.tune.key}={json.dumps(record['choice'])}",)


def tuning_failed(out: Path, cell: Cell) -> bool:
    """Whether ``cell``'s tuning ran and every value of its grid failed."""
    record = tuning_record(out, cell)
    return record is not None and record["choice"] is None
