"""``flrep reproduce``: a paper table's cells over seeds (:mod:`flower_app.reproduction.runner`), from the command line;
``--index``: the results page of every table (:mod:`flower_app.reproduction.index`)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flower_app.run.stop_signals import Stopped
from flower_app.commands.common import JOBS_HELP, config_error, positive_int
from task.errors import ConfigError

if TYPE_CHECKING:
    from flower_app.reproduction.tables import Table
from task.files import WriteFailed

#: ``flrep reproduce``'s exit code when a file of the table (its report or ``reproduce.json``)
#: could not be written: the finished runs are kept, and the same command writes it again.
REPORT_NOT_WRITTEN = 3


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from flower_app.reproduction.tables import SCALES, load_table, table_names

    try:
        if args.index:
            from flower_app.reproduction.index import Files, write_index
            from flower_app.run.config import PROJECT_DIR

            for path in write_index(Files(PROJECT_DIR), PROJECT_DIR):
                print(f"[reproduce] wrote {path}")
            return 0
        if args.list and args.table:
            print("\n".join(cell_lines(load_table(args.table), list(args.seeds))))
            return 0
        if args.list:
            for name in table_names():
                table = load_table(name)
                cost = ", ".join(f"{s} {table.minutes(s) * len(args.seeds) / 60:.1f} h" for s in SCALES)
                print(f"{name:28s} {len(table.cells):3d} cells  {len(args.seeds)} seeds: {cost}  {table.title}")
            return 0
        if not args.table or not args.out:
            print("flrep: reproduce needs a table and --out DIR (or --list, or --index)", file=sys.stderr)
            return 2
        from flower_app.reproduction.runner import AppChanged, reproduce

        out = Path(args.out).expanduser().resolve()
        if args.take_from:
            from flower_app.reproduction.take_runs import take_runs

            return take_runs(load_table(args.table), args.scale, out, Path(args.take_from).expanduser().resolve(),
                             args.only)
        again = ["reproduce", args.table, "--scale", args.scale, "--seeds", *map(str, args.seeds), "--out", str(out),
                 *(["--only", *args.only] if args.only else []), *(["--set", *args.set] if args.set else []),
                 *(["--retry-failed"] if args.retry_failed else []), *(["--jobs", str(args.jobs)] if args.jobs != 1 else [])]
        try:
            return reproduce(load_table(args.table), args.scale, list(args.seeds), args.only, out, args.set or [],
                             args.retry_failed, args.jobs)
        except AppChanged as changed:
            print(f"[reproduce] {changed}; starting the same command again with the new app", flush=True)
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, "-m", "flower_app.cli", *again])
        except Stopped as stop:
            print(f"[reproduce] continue it with:\n  {shlex.join(['flrep', *again])}", file=sys.stderr)
            return stop.exit_code
        except WriteFailed as failed:
            print(f"flrep: reproduce: {failed}; the finished runs are kept: free some space and run the same "
                  "command again (it repeats no finished run)", file=sys.stderr)
            return REPORT_NOT_WRITTEN
    except ConfigError as err:
        return config_error(err)


def cell_lines(table: Table, seeds: list[int]) -> list[str]:
    """``flrep reproduce TABLE --list``: one line per cell (its id for ``--only``, its role, the
    paper numbers it is judged on, its estimated minutes per seed at each scale), then the total."""
    from flower_app.reproduction.tables import SCALES

    lines = [f"{table.name}: {table.title} ({len(table.cells)} cells; minutes per seed on a 2-core CPU)"]
    for cell in table.cells.values():
        role = "primary" if cell.primary else "sensitivity"
        cost = "  ".join(f"{s} {cell.minutes.get(s, 0):g}" for s in SCALES)
        judged = ", ".join(cell.paper.values()) or "-"
        lines.append(f"  {cell.name:28s} {role:11s} {cost:18s} {cell.label}  (paper numbers: {judged})")
    total = ", ".join(f"{s} {table.minutes(s) * len(seeds) / 60:.1f} h" for s in SCALES)
    lines.append(f"all cells, seeds {' '.join(map(str, seeds))}: {total}")
    return lines


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``reproduce`` subcommand."""
    rep = sub.add_parser("reproduce", help="run a paper table's cells over seeds (resumable) and write ours beside "
                                           "the paper's: DIR/table.md, table.csv, table.png")
    rep.add_argument("table", nargs="?", help="name of a file in conf/tables/ (without .yaml); "
                                             "`flrep reproduce TABLE --list` lists its cells and their cost")
    rep.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds to run (default 0 1 2)")
    rep.add_argument("--scale", choices=["paper", "cpu"], default="cpu",
                     help="paper: the paper's setting; cpu: the table's declared reduction (default)")
    rep.add_argument("--only", nargs="+", metavar="CELL", help="run only these cells")
    rep.add_argument("--out", help="output directory (runs, table.md, table.csv, table.png)")
    rep.add_argument("--set", nargs="+", metavar="KEY=VALUE",
                     help="machine settings for every run (simulation.*, client_state.*, wandb.*), "
                          "e.g. simulation.client_gpus=0.1 on a GPU")
    rep.add_argument("--jobs", type=positive_int, default=1, metavar="N", help=JOBS_HELP)
    rep.add_argument("--retry-failed", action="store_true",
                     help="move failed runs aside and run them again from the start (default: keep them)")
    rep.add_argument("--take-from", metavar="OTHER",
                     help="run nothing: bring the finished runs and tunings of OTHER, another folder of this table "
                          "(another machine's), into --out where it has none, and write the report again")
    rep.add_argument("--list", action="store_true",
                     help="list the tables and their estimated cost on a 2-core CPU; with a table: its cells "
                          "(primary or sensitivity, the paper numbers each is judged on, minutes per seed)")
    rep.add_argument("--index", action="store_true",
                     help="write docs/reproduction.md and docs/reproduction/index.png from every committed table "
                          "(table.csv, table.md; no runs needed)")
    rep.set_defaults(func=_cmd_reproduce)
