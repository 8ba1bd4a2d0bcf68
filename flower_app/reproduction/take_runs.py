"""``flrep reproduce TABLE --out DIR --take-from OTHER``: one table from runs made in several places.

OTHER is another folder of the same table at the same scale (another machine's copy, a second
checkout's). Its finished runs (completed or failed: both are results) that DIR does not hold yet
come into DIR with their records in ``reproduce.json`` (commit, machine, earlier parts), and so do
its tuning records and runs for cells DIR has not tuned; then DIR's report is written again.
Nothing of DIR's is overwritten: a run or tuning DIR holds already is kept, and an unfinished run
of DIR's (interrupted, its checkpoint) is moved aside, never deleted. A run made with other
settings than the table's cell (or for another tuning choice) is not taken, and is named.
Checkpoints and wandb folders are not copied: a finished run needs neither. OTHER is only read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flower_app.reproduction.runner import (MANIFEST, Job, save_manifest, load_manifest, run_folder, stale_reason,
                                            write_report)
from flower_app.reproduction.table_model import Table
from flower_app.reproduction.tuning_record import TUNING, tuned_overrides, tuning_record
from flower_app.run import run_dir, run_lock
from flower_app.run.run_dir import read_summary
from task.errors import ConfigError

FINISHED = ("completed", "failed")
NOT_COPIED = shutil.ignore_patterns("checkpoint", "wandb", ".flrep.lock")


def take_runs(table: Table, scale: str, out: Path, other: Path, only: list[str] | None = None) -> int:
    """Bring OTHER's finished runs (of ``only``'s cells, or all) and tunings into ``out``; 0."""
    theirs = _their_manifest(table, scale, out, other)
    cells = [c for c in table.cells.values() if not only or c.name in only]
    with run_lock.hold(out):
        ours = load_manifest(out) or {"table": table.name, "scale": scale, "runs": {}}
        if ours.get("scale", scale) != scale:
            raise ConfigError(f"{out / MANIFEST}: scale {ours['scale']!r}, not --scale {scale}")
        taken, kept, refused = [], [], []
        for cell in (c for c in cells if c.tune is not None):
            their_tuning = tuning_record(other, cell)
            if their_tuning is None:
                continue
            our_tuning = tuning_record(out, cell)
            if our_tuning is None:
                (out / TUNING).mkdir(parents=True, exist_ok=True)
                shutil.copy2(other / TUNING / f"{cell.name}.json", out / TUNING / f"{cell.name}.json")
                if (other / TUNING / cell.name).is_dir():
                    shutil.copytree(other / TUNING / cell.name, out / TUNING / cell.name, ignore=NOT_COPIED,
                                    dirs_exist_ok=True)
                taken.append(f"tuning of {cell.name}")
            elif our_tuning["choice"] != their_tuning["choice"]:
                refused.append(f"tuning of {cell.name} (it chose {their_tuning['choice']!r}, this folder "
                               f"{our_tuning['choice']!r}: this folder's is kept)")
        names = {c.name for c in cells}
        for key, record in theirs["runs"].items():
            cell_name, _, seed = key.rpartition("/seed")
            if cell_name not in names or not seed.isdigit():
                if cell_name not in table.cells:
                    refused.append(f"{key} (no such cell in table {table.name!r})")
                continue
            job = Job(table.cells[cell_name], int(seed), tuned_overrides(out, table.cells[cell_name]) or ())
            source = run_folder(other, job)
            status = (read_summary(source) or {}).get("status")
            if record.get("status") not in FINISHED or status != record.get("status"):
                continue  # unfinished there: continue it there, or copy its folder to continue it here
            if ours["runs"].get(key, {}).get("status") in FINISHED:
                kept.append(key)
                continue
            why = stale_reason(table, scale, job, source, theirs)
            if why:
                refused.append(f"{key} ({why})")
                continue
            target = run_folder(out, job)
            moved = run_dir.move_aside(target)
            if moved is not None:
                print(f"[reproduce] {key}: this folder's unfinished run moved to {moved}", flush=True)
            shutil.copytree(source, target, ignore=NOT_COPIED, dirs_exist_ok=True)
            if (log := source.with_suffix(".log")).is_file():
                shutil.copy2(log, target.with_suffix(".log"))
            ours["runs"][key] = record
            taken.append(key)
        save_manifest(out, ours)
        write_report(table, scale, out, ours)
    print(f"[reproduce] took {len(taken)} from {other}" + (f": {', '.join(taken)}" if taken else ""), flush=True)
    if kept:
        print(f"[reproduce] kept this folder's own: {', '.join(kept)}", flush=True)
    for why in refused:
        print(f"[reproduce] not taken: {why}", flush=True)
    print(f"[reproduce] table in {out / 'table.md'}", flush=True)
    return 0


def _their_manifest(table: Table, scale: str, out: Path, other: Path) -> dict:
    """OTHER's ``reproduce.json``, refused unless it is another folder of ``table`` at ``scale``."""
    if other.resolve() == out.resolve():
        raise ConfigError(f"--take-from {other}: that is --out itself")
    theirs = load_manifest(other)
    if theirs is None:
        raise ConfigError(f"--take-from {other}: no {MANIFEST} there (not a folder of flrep reproduce)")
    if theirs.get("table") != table.name:
        raise ConfigError(f"--take-from {other}: its {MANIFEST} is of table {theirs.get('table')!r}, not {table.name!r}")
    if theirs.get("scale", scale) != scale:
        raise ConfigError(f"--take-from {other}: its runs are at scale {theirs['scale']!r}, not --scale {scale}")
    return theirs
