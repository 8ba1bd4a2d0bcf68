"""``flrep tune``: choose a cell's lost value on validation data, from the grid its table declares.

A cell with ``tune: {key, grid, seeds, fraction}`` is run once per grid value and seed, each client
holding out ``fraction`` of its training data (``data.validation_fraction``), in
``DIR/tuning/<cell>/<key>=<value>/seed<k>/`` (its log beside it). The choice is the value with the
highest mean ``validation_accuracy`` over the seeds (the final-window mean over clients of their
accuracy on the held-out part; a tie goes to the value declared first). Test accuracy is never
read. A value whose run failed (diverged, crashed, learned nothing) has no score and cannot be
chosen; when every value failed the record says so (its choice null) and the cell's numbers differ.

``DIR/tuning/<cell>.json`` records the grid, every score and the choice; ``flrep reproduce`` then
runs the cell with the choice on all of each client's training data, and the table's page shows the
record. Completed tuning runs are kept and read again; a run with other settings is moved aside.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import numpy as np

from flower_app.run import run_dir, run_lock
from flower_app.run.run_dir import read_summary, write_atomic
from flower_app.reproduction import side_by_side
from flower_app.reproduction.runner import Job, check, command, load_manifest, run_child, stale_keys, write_report
from flower_app.reproduction.table_model import Cell, Table
from flower_app.reproduction.tuning_record import TUNING
from task.errors import ConfigError

METRIC = "validation_accuracy"


@dataclass
class _Started:
    """A tuning run started by this command."""

    key: str
    folder: Path
    cmd: list[str]
    log: TextIO
    t0: float


def tuning_job(cell: Cell, value, seed: int) -> Job:
    """The run of ``cell`` at grid ``value`` and ``seed``, on the training data less the held-out part."""
    return Job(cell, seed, (f"{cell.tune.key}={json.dumps(value)}", f"data.validation_fraction={cell.tune.fraction}"))


def tuning_folder(out: Path, cell: Cell, value, seed: int) -> Path:
    return out / TUNING / cell.name / f"{cell.tune.key}={json.dumps(value)}" / f"seed{seed}"


def tunable_cell(table: Table, name: str) -> Cell:
    """Cell ``name`` of ``table``, refused unless it declares ``tune:``."""
    if name not in table.cells:
        raise ConfigError(f"cell {name!r}: table {table.name!r} has no such cell; cells: {', '.join(table.cells)}")
    cell = table.cells[name]
    if cell.tune is None:
        tunable = [c.name for c in table.cells.values() if c.tune is not None]
        raise ConfigError(f"cell {name!r} of table {table.name!r} declares no tune: (key, grid); cells that do: "
                          + (", ".join(tunable) or "none"))
    return cell


def choose(grid: tuple, means: dict[str, float | None]) -> object | None:
    """The grid value with the highest mean score (the first declared on a tie); None when none has one."""
    scored = [(means[json.dumps(v)], -i, v) for i, v in enumerate(grid) if means.get(json.dumps(v)) is not None]
    return max(scored)[2] if scored else None


def tune(table: Table, name: str, scale: str, out: Path, settings: list[str] = (), jobs: int = 1) -> int:
    """Run ``table``'s cell ``name`` over its tuning grid and seeds in ``out`` (``jobs`` runs side by
    side) and record the choice in ``out/tuning/<cell>.json``; the exit code (1 when no value could be scored)."""
    from flower_app.tools.bench_round import commit

    cell = tunable_cell(table, name)
    spec = cell.tune
    grid = [(value, seed, tuning_job(cell, value, seed)) for value in spec.grid for seed in spec.seeds]
    check(table, scale, [job for _, _, job in grid], out, settings)
    with run_lock.hold(out):
        runs: dict[str, dict] = {}
        todo = []
        for value, seed, job in grid:
            folder = tuning_folder(out, cell, value, seed)
            key = f"{spec.key}={json.dumps(value)}/seed{seed}"
            differing = stale_keys(table, scale, job, folder)
            if differing:
                moved = run_dir.move_aside(folder)
                print(f"[tune] {key} was run with other values of {', '.join(differing[:6])}: moved to {moved}", flush=True)
            status = (read_summary(folder) or {}).get("status")
            runs[key] = {"status": status}
            if status not in ("completed", "failed", "incomplete"):
                todo.append((key, seed, job, folder))

        def start(item: tuple[int, tuple]) -> _Started:
            i, (key, seed, job, folder) = item
            print(f"[tune] run {i + 1}/{len(todo)}: {cell.name} {key}", flush=True)
            cmd = command(table, scale, job, folder, settings)
            folder.parent.mkdir(parents=True, exist_ok=True)
            runs[key] = {"commit": commit(), "date": _now()}
            log = open(folder.parent / f"seed{seed}.log", "a")
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            return _Started(key, folder, cmd, log, time.monotonic())

        def finish(started: _Started, code: int) -> bool:
            started.log.close()
            summary = read_summary(started.folder) or {}
            runs[started.key].update(status=summary.get("status") if code == 0 else "failed", exit_code=code,
                                     wall_s=round(time.monotonic() - started.t0, 1))
            return True

        side_by_side.run_all(enumerate(todo), jobs, start, lambda started: run_child(started.cmd, started.log), finish,
                             lambda started, why: started.log.close())
        scores: dict[str, dict[str, float | None]] = {json.dumps(v): {} for v in spec.grid}
        for value, seed, _ in grid:
            folder = tuning_folder(out, cell, value, seed)
            key = f"{spec.key}={json.dumps(value)}/seed{seed}"
            summary = read_summary(folder) or {}
            record = runs[key]
            score = summary.get(METRIC) if record["status"] == "completed" else None
            if record["status"] == "completed" and score is None:
                raise ConfigError(f"{folder}: the run reports no {METRIC}; algorithm {summary.get('algorithm')!r} "
                                  "scores its clients on the server and cannot be tuned on validation data")
            if record["status"] != "completed":
                print(f"[tune] {key} failed: {spec.key}={json.dumps(value)} cannot be chosen (its log: "
                      f"{folder.parent / f'seed{seed}.log'})", flush=True)
            runs[key] = {**record, "source": summary.get("source"), "score": score}
            scores[json.dumps(value)][str(seed)] = score
        means = {v: (None if any(s is None for s in per.values()) else float(np.mean(list(per.values()))))
                 for v, per in scores.items()}
        choice = choose(spec.grid, means)
        for value, mean in means.items():
            print(f"[tune] {cell.name} {spec.key}={value}: mean {METRIC} "
                  + ("failed" if mean is None else f"{mean:.4f}"), flush=True)
        result = {"table": table.name, "cell": cell.name, "key": spec.key, "grid": list(spec.grid),
                  "seeds": list(spec.seeds), "fraction": spec.fraction, "scale": scale, "metric": METRIC,
                  "scores": scores, "mean": means, "choice": choice, "date": _now(), "runs": runs}
        path = out / TUNING / f"{cell.name}.json"
        write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1) + "\n"))
        if choice is None:
            print(f"[tune] {cell.name}: every value failed; recorded in {path}: the cell has nothing to run and "
                  "its paper numbers differ", flush=True)
        else:
            print(f"[tune] {cell.name}: {spec.key} = {json.dumps(choice)} (highest mean {METRIC}); recorded in {path}",
                  flush=True)
        manifest = load_manifest(out) or {"table": table.name, "scale": scale, "runs": {}}
        write_report(table, scale, out, manifest)
    return 1 if choice is None else 0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
