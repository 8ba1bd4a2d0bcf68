"""``flrep reproduce``: run a paper table's cells over seeds, resumably, and write ours beside the paper's.

Each (cell, seed) is one ``flrep run`` in ``DIR/runs/<cell>/seed<k>/`` (its log beside it as
``seed<k>.log``): a completed run is kept and read, a failed one is kept as a result (``retry_failed``:
moved aside and run again from the start), a checkpointed one is resumed, a started
one without a checkpoint is moved aside (``--force``: never deleted) and run again, as is a run
made with other settings than its cell's now or under an older ``revision`` of the table. After every
run ``DIR/reproduce.json`` records what ran (machine, date, commit, wall time; for a resumed run
also each earlier part, which may have run on another machine) and
``DIR/table.md``, ``table.csv`` and ``table.png`` are rewritten from every completed run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from flower_app.app import checkpoint
from flower_app.run import run_dir, run_lock
from flower_app.run.run_dir import read_summary, write_atomic
from flower_app.run.stop_signals import Stopped
from flower_app.reproduction import side_by_side
from flower_app.reproduction.child_rounds import run_child
from flower_app.reproduction.report import claim_results, failed_seeds, markdown, rows, table_csv
from flower_app.reproduction.table_model import Cell, Table
from flower_app.reproduction.tuning_record import TUNING, tuned_overrides, tuning_failed, tuning_record
from task.errors import ConfigError

MANIFEST = "reproduce.json"
MACHINE_SECTIONS = ("simulation", "client_state", "wandb")  # settings that place a run, never change its numbers


@dataclass
class _Started:
    """A run of the table started by this command: its job, command, record and log."""

    job: Job
    cmd: list[str]
    part: dict
    log: TextIO
    t0: float


class _Pace:
    """Wall seconds spent per estimated minute of the runs that ended (1 minute a minute before any)."""

    def __init__(self) -> None:
        self.spent_s, self.estimated_min = 0.0, 0.0

    def add(self, seconds: float, estimated_min: float) -> None:
        self.spent_s, self.estimated_min = self.spent_s + seconds, self.estimated_min + estimated_min

    def factor(self) -> float:
        return self.spent_s / 60 / self.estimated_min if self.estimated_min > 0 else 1.0


@dataclass(frozen=True)
class Job:
    """One run of a table: a cell at a seed."""

    cell: Cell
    seed: int
    tuned: tuple[str, ...] = ()  # ``key=value`` that ``flrep tune`` chose for the cell (its ``tune:``)

    @property
    def key(self) -> str:
        return f"{self.cell.name}/seed{self.seed}"

    def overrides(self, table: Table, scale: str) -> list[str]:
        """The cell's overrides at ``scale``, then its tuned value."""
        return [*self.cell.overrides_at(table, scale), *self.tuned]


def run_folder(out: Path, job: Job) -> Path:
    return out / "runs" / job.cell.name / f"seed{job.seed}"


def plan(table: Table, seeds: list[int], only: list[str] | None, out: Path) -> list[Job]:
    """The table's runs: every selected cell at every seed, cell by cell. A cell whose value is
    still to be tuned is left out (named) unless ``only`` asks for it, which is refused."""
    unknown = sorted(set(only or ()) - set(table.cells))
    if unknown:
        raise ConfigError(f"--only {unknown[0]!r}: table {table.name!r} has no such cell; cells: {', '.join(table.cells)}")
    jobs = []
    for cell in (c for c in table.cells.values() if not only or c.name in only):
        tuned = tuned_overrides(out, cell)
        if tuned is None:
            why = (f"cell {cell.name!r}: every value of its tuning of {cell.tune.key} failed ({out / TUNING}/"
                   f"{cell.name}.json): nothing to run" if tuning_failed(out, cell) else
                   f"cell {cell.name!r} awaits its tuning of {cell.tune.key}: run `flrep tune {table.name} "
                   f"{cell.name} --out {out}` first")
            if only:
                raise ConfigError(why)
            print(f"[reproduce] {why}; left out", flush=True)
            continue
        jobs += [Job(cell, seed, tuned) for seed in seeds]
    return jobs


def machine_settings(settings: list[str]) -> list[str]:
    """``--set`` overrides, refused unless each is ``KEY=VALUE`` under a section that only places a
    run on this machine (GPU share, state folder, tracking), so a table never mixes settings."""
    for item in settings:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or key.split(".", 1)[0] not in MACHINE_SECTIONS:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with KEY under {', '.join(MACHINE_SECTIONS)} "
                              "(settings that change results belong in the table's cells)")
    return list(settings)


def check(table: Table, scale: str, jobs: list[Job], out: Path, settings: list[str] = ()) -> None:
    """Every check before anything runs or is written: the output folder belongs to this table
    and scale, and every cell's configuration loads."""
    from flower_app.run.config import load_variants

    manifest = load_manifest(out)
    if manifest is not None and (manifest["table"], manifest["scale"]) != (table.name, scale):
        raise ConfigError(f"{out / MANIFEST}: this folder holds table {manifest['table']!r} at scale "
                          f"{manifest['scale']!r}, not {table.name!r} at {scale!r}; choose another --out")
    for job in {job.cell.name: job for job in jobs}.values():
        cell = job.cell
        try:
            load_variants(cell.experiment, [*job.overrides(table, scale), *machine_settings(settings), "compare=[]"])
        except ConfigError as err:
            raise ConfigError(f"table {table.name!r}, cell {cell.name!r} ({cell.experiment}): {err}") from None


def stale_keys(table: Table, scale: str, job: Job, folder: Path) -> list[str]:
    """The keys whose values in ``folder``'s run config differ from what the job asks for now
    (empty when the folder holds no run, or this job's). A key the run's config lacks (added to
    the app later) counts as its default, so it is stale only where the job asks for another value."""
    import yaml

    from flower_app.run.config import load_config

    path = folder / "config.yaml"
    if not path.is_file():
        return []
    saved = yaml.safe_load(path.read_text()) or {}
    wanted = load_config(job.cell.experiment, [*job.overrides(table, scale), f"seed={job.seed}", "compare=[]"])
    return checkpoint.config_differences(saved, wanted)


def stale_reason(table: Table, scale: str, job: Job, folder: Path, manifest: dict) -> str | None:
    """Why the run in ``folder`` no longer belongs to its cell (None: it does, or there is none):
    other settings, a table revision older than the table's now (a run recorded without one
    is revision 1), or code with uncommitted changes (the run cannot be traced to a commit)."""
    differing = stale_keys(table, scale, job, folder)
    if differing:
        return f"was run with other values of {', '.join(differing[:6])}"
    record = manifest["runs"].get(job.key, {})
    revision = record.get("revision", 1)
    if run_dir.run_files(folder) and revision < table.revision:
        return f"was run for revision {revision} of the table, which is now at revision {table.revision}"
    if run_dir.run_files(folder) and (str(record.get("commit")).endswith("+changes") or record.get("clean") is False):
        return f"was run from a tree with uncommitted changes ({record.get('commit')}): its code cannot be named"
    return None


def load_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path}: unreadable ({err}); move it away or choose another --out") from None


def command(table: Table, scale: str, job: Job, folder: Path, settings: list[str] = ()) -> list[str]:
    """The ``flrep run`` command line of ``job``: resume a checkpointed run, else start it."""
    args = [sys.executable, "-m", "flower_app.cli", "run", job.cell.experiment,
            *job.overrides(table, scale), f"seed={job.seed}", "compare=[]", *settings]
    if (checkpoint.checkpoint_dir(folder) / checkpoint.SERVER_FILE).is_file():
        return [*args, f"resume={folder}"]
    return [*args, "--out", str(folder), *(["--force"] if folder.exists() else [])]


def reproduce(table: Table, scale: str, seeds: list[int], only: list[str] | None, out: Path,
              settings: list[str] = (), retry_failed: bool = False, jobs: int = 1) -> int:
    """Run the table's missing runs and write its report; the exit code (1 if a run failed, now
    or before). ``settings``: machine-only overrides (``--set``) added to every run. ``jobs``: how
    many runs go side by side (:mod:`~flower_app.reproduction.side_by_side`).
    ``retry_failed``: move failed runs aside and run them again from the start (otherwise they
    are kept: resuming a diverged run diverges again). A stop signal during a run records it as
    interrupted, then :class:`Stopped` goes on."""
    planned = plan(table, seeds, only, out)
    check(table, scale, planned, out, settings)
    with run_lock.hold(out):  # one command per table folder (each run locks its own folder)
        return _run_jobs(table, scale, planned, out, settings, retry_failed, jobs)


def _run_jobs(table: Table, scale: str, planned: list[Job], out: Path, settings: list[str],
              retry_failed: bool, jobs: int) -> int:
    """:func:`reproduce` once its checks passed and it owns ``out``."""
    from flower_app.tools.bench_round import commit, machine

    manifest = load_manifest(out) or {"table": table.name, "scale": scale, "runs": {}}
    here = {"machine": machine()}
    for job in planned:  # a run made with other settings, or by an older revision of the table, is kept aside
        why = stale_reason(table, scale, job, run_folder(out, job), manifest)
        if why:
            moved = run_dir.move_aside(run_folder(out, job))
            manifest["runs"].pop(job.key, None)
            print(f"[reproduce] {job.key} {why}: moved to {moved}, to run again", flush=True)
    keys = {j.key for j in planned}
    for key, why in missing_runs(table, out, manifest).items():
        if key in keys:
            print(f"[reproduce] {why}: it runs again", flush=True)
    status = {j.key: (read_summary(run_folder(out, j)) or {}).get("status") for j in planned}
    kept_failed = []  # failed runs are results: resuming a diverged run diverges again
    for job in [j for j in planned if status[j.key] == "failed"]:
        if retry_failed:
            moved = run_dir.move_aside(run_folder(out, job))
            manifest["runs"].pop(job.key, None)
            status[job.key] = None
            print(f"[reproduce] {job.key} failed earlier: moved to {moved}, to run again from the start", flush=True)
        else:
            kept_failed.append(job.key)
            print(f"[reproduce] {job.key} failed earlier: kept (its log: {run_folder(out, job).parent}/"
                  f"seed{job.seed}.log); --retry-failed moves it aside and runs it again", flush=True)
    todo = [j for j in planned if status[j.key] not in ("completed", "failed")]
    # a checkpointed run resumes: only what its checkpoint has not yet spent of the cell's estimate is left
    expected = {j.key: max(j.cell.minutes.get(scale, 0) - checkpoint.elapsed_minutes(run_folder(out, j)), 0.0)
                for j in todo}
    print(f"[reproduce] {table.name} at scale {scale!r}: {len(planned)} runs, "
          f"{len(planned) - len(todo) - len(kept_failed)} already completed, "
          + (f"{len(kept_failed)} failed earlier, " if kept_failed else "") +
          f"{len(todo)} to run (estimated {_minutes(sum(expected.values()))})", flush=True)
    failed, begun, pace = list(kept_failed), time.monotonic(), _Pace()
    app_changed: list[str] = []

    def start(i_job: tuple[int, Job]) -> _Started:
        i, job = i_job
        folder = run_folder(out, job)
        left = sum(expected[j.key] for j in todo[i:]) / min(jobs, len(todo) - i)
        print(f"[reproduce] run {i + 1}/{len(todo)}: {job.key} ({job.cell.label}) | elapsed "
              f"{_minutes((time.monotonic() - begun) / 60)} | ETA {_minutes(left * pace.factor())}", flush=True)
        cmd = command(table, scale, job, folder, settings)
        folder.parent.mkdir(parents=True, exist_ok=True)
        # every run left in the folder is of the table's revision now (older ones were moved aside):
        # record it before the run starts, so that an interrupted run keeps it
        here["commit"] = commit()  # the code this run starts with (a long table may span commits)
        here["clean"] = here["commit"] is not None and not here["commit"].endswith("+changes")
        resumed = earlier_parts(manifest["runs"].get(job.key)) if cmd[-1].startswith("resume=") else []
        part = {"revision": table.revision, "definition": table.definition(job.cell.name, scale, job.tuned),
                "command": cmd[1:], "date": _now(), **here,
                **({"earlier_parts": resumed} if resumed else {})}
        manifest["runs"][job.key] = {"status": "started", **part}
        save_manifest(out, manifest)
        log = open(folder.parent / f"seed{job.seed}.log", "a")
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        return _Started(job, cmd, part, log, time.monotonic())

    def run(started: _Started) -> int:
        return run_child(started.cmd, started.log)

    def finish(started: _Started, code: int) -> bool:
        started.log.close()
        job, seconds = started.job, time.monotonic() - started.t0
        pace.add(seconds, expected[job.key])
        folder = run_folder(out, job)
        summary = read_summary(folder)
        status = (summary or {}).get("status") if code == 0 else "failed"
        manifest["runs"][job.key] = {"status": status, "exit_code": code, "wall_s": round(seconds, 1),
                                     **started.part, "date": _now(),
                                     **({"source": summary["source"]} if (summary or {}).get("source") else {})}
        save_manifest(out, manifest)
        if status != "completed":
            failed.append(job.key)
            print(f"[reproduce] {job.key} failed (exit {code}); its log: {folder.parent / f'seed{job.seed}.log'}",
                  file=sys.stderr, flush=True)
        if not app_changed:
            try:
                write_report(table, scale, out, manifest)
            except ConfigError as err:  # the run is recorded; this process's schema is older than the files
                app_changed.append(f"{job.key} is recorded as {status}, but the table could not be re-read ({err}): "
                                   "the app (conf/ or its code) changed while this command ran")
        return not app_changed  # after a change of the app, the runs going end; none starts

    def interrupted(started: _Started, why: str) -> None:
        started.log.close()
        manifest["runs"][started.job.key] = {"status": "interrupted",
                                             "wall_s": round(time.monotonic() - started.t0, 1), **started.part}
        save_manifest(out, manifest)
        print(f"[reproduce] interrupted by {why} during {started.job.key}", file=sys.stderr)

    try:
        side_by_side.run_all(enumerate(todo), jobs, start, run, finish, interrupted)
    except Stopped:
        write_report(table, scale, out, manifest)
        raise
    if app_changed:
        raise AppChanged(app_changed[0])
    if not todo:
        write_report(table, scale, out, manifest)
    print(f"[reproduce] table in {out / 'table.md'}" + (f"; {len(failed)} runs failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


class AppChanged(Exception):
    """The app changed under a running ``flrep reproduce`` (its schema is older than ``conf/``):
    every run so far is recorded, and the same command, started again, continues with the new app."""


def earlier_parts(record: dict | None) -> list[dict]:
    """The parts of a run that ``record`` left unfinished (started or interrupted, here or on
    another machine), oldest first: what the record of its resumption keeps."""
    if not record or record.get("status") not in ("started", "interrupted"):
        return []
    part = {k: record[k] for k in ("date", "commit", "clean", "machine", "wall_s", "command") if k in record}
    return [*record.get("earlier_parts", []), part]


def save_manifest(out: Path, manifest: dict) -> None:
    """Write ``manifest`` as ``out/reproduce.json`` (atomically)."""
    write_atomic(out / MANIFEST, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=1) + "\n"))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _minutes(m: float) -> str:
    return f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"


# -- the report -------------------------------------------------------------------------------


def missing_runs(table: Table, out: Path, manifest: dict) -> dict[str, str]:
    """run key -> why, for the runs ``manifest`` records as completed whose folder in ``out`` holds
    no completed summary (made on another machine, or the folder was moved)."""
    missing = {}
    for key, record in manifest.get("runs", {}).items():
        if record.get("status") != "completed" or key.partition("/")[0] not in table.cells:
            continue
        if (read_summary(out / "runs" / key) or {}).get("status") != "completed":
            missing[key] = (f"{key} was recorded as completed on {str(record.get('date'))[:10]} (commit "
                            f"{record.get('commit')}) but its folder runs/{key} is missing")
    return missing


def collect(table: Table, scale: str, out: Path, manifest: dict) -> tuple[dict[str, dict[int, dict]], list[str]]:
    """cell -> seed -> summary of every completed run in ``out`` that still belongs to its cell, and
    the completed runs left out, with why: made with other settings or under an older revision, or
    recorded in ``manifest`` but not in ``out``."""
    done: dict[str, dict[int, dict]] = {}
    left_out = list(missing_runs(table, out, manifest).values())
    for cell in table.cells:
        for folder in sorted((out / "runs" / cell).glob("seed*")):
            summary = read_summary(folder)
            if not (folder.is_dir() and folder.name[4:].isdigit() and summary and summary.get("status") == "completed"):
                continue
            job = Job(table.cells[cell], int(folder.name[4:]), tuned_overrides(out, table.cells[cell]) or ())
            why = stale_reason(table, scale, job, folder, manifest)
            if why:
                left_out.append(f"{job.key} {why}")
            else:
                done.setdefault(cell, {})[job.seed] = summary
    return done, left_out


def write_report(table: Table, scale: str, out: Path, manifest: dict) -> None:
    """``table.md``, ``table.csv`` and ``table.png`` from every completed run in ``out``."""
    done, left_out = collect(table, scale, out, manifest)
    tunings = {c: record for c in sorted(table.cells) if (record := tuning_record(out, table.cells[c]))}
    table_rows = rows(table, done, scale, tunings, failed_seeds(manifest))
    claims = claim_results(table, done)
    page = markdown(table, scale, manifest, table_rows, claims, left_out, tunings)
    write_atomic(out / "table.md", lambda tmp: Path(tmp).write_text(page))
    write_atomic(out / "table.csv", lambda tmp: Path(tmp).write_text(table_csv(table_rows)))
    if any(r["n"] for r in table_rows):
        from flower_app.results.plots import plot_table

        plot_table(table, table_rows, out / "table.png")
