"""``flrep export``: a run's model as one loadable file (:mod:`flower_app.tools.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flower_app.commands.common import config_error
from task.errors import ConfigError


def command(args: argparse.Namespace) -> int:
    from flower_app.tools.export import export_model

    try:
        path = export_model(Path(args.run_dir), Path(args.out) if args.out else None)
    except ConfigError as err:
        return config_error(err)
    print(f"flrep: model written to {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    exp = sub.add_parser("export", help="write a run's model (its global arrays over the initial model) as a "
                                        "loadable file, for diagnostics")
    exp.add_argument("run_dir", help="a run's output directory (a comparison's variant folder)")
    exp.add_argument("--out", help="the file to write (default <run-dir>/model.pt; never overwritten)")
    exp.set_defaults(func=command)
