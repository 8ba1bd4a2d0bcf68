"""``flrep tune``: a table cell's lost value chosen on validation data (:mod:`flower_app.reproduction.tune`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from flower_app.commands.common import JOBS_HELP, config_error, positive_int
from flower_app.run.stop_signals import Stopped
from task.errors import ConfigError


def _cmd_tune(args: argparse.Namespace) -> int:
    from flower_app.reproduction.tables import load_table
    from flower_app.reproduction.tune import tune

    out = Path(args.out).expanduser().resolve()
    try:
        return tune(load_table(args.table), args.cell, args.scale, out, args.set or [], args.jobs)
    except Stopped as stop:
        again = ["flrep", "tune", args.table, args.cell, "--scale", args.scale, "--out", str(out),
                 *(["--set", *args.set] if args.set else []), *(["--jobs", str(args.jobs)] if args.jobs != 1 else [])]
        print(f"[tune] continue it with:\n  {shlex.join(again)}", file=sys.stderr)
        return stop.exit_code
    except ConfigError as err:
        return config_error(err)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``tune`` subcommand."""
    tune = sub.add_parser("tune", help="choose a table cell's lost value (its tune: grid) by mean validation "
                                       "accuracy: DIR/tuning/<cell>.json, read by flrep reproduce")
    tune.add_argument("table", help="name of a file in conf/tables/ (without .yaml)")
    tune.add_argument("cell", help="a cell of the table that declares tune: {key, grid}")
    tune.add_argument("--out", required=True, help="the table's output directory (as flrep reproduce --out)")
    tune.add_argument("--scale", choices=["paper", "cpu"], default="cpu",
                      help="paper: the paper's setting; cpu: the table's declared reduction (default)")
    tune.add_argument("--set", nargs="+", metavar="KEY=VALUE",
                      help="machine settings for every run (simulation.*, client_state.*, wandb.*)")
    tune.add_argument("--jobs", type=positive_int, default=1, metavar="N", help=JOBS_HELP)
    tune.set_defaults(func=_cmd_tune)
