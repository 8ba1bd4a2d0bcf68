"""``flrep split-data``: each client's partition as its own dataset folder, for SuperNodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from flower_app.commands.common import config_error
from task.errors import ConfigError


def command(args: argparse.Namespace) -> int:
    from flower_app.run.config import load_config
    from flower_app.run.run_dir import check_writable
    from task.data.node_data import write_partitions

    try:
        cfg = load_config(args.experiment, list(args.overrides))
        check_writable(Path(args.out).expanduser().resolve(), "--out")
        folders = write_partitions(cfg.data, int(cfg.seed), Path(args.out))
    except (ConfigError, OSError) as err:
        return config_error(err)
    print(f"flrep: {len(folders)} node data folders ({cfg.data.name} format) in {Path(args.out).resolve()}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    spl = sub.add_parser("split-data", help="write each client's partition as its own dataset folder (node-<i>/)")
    spl.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    spl.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    spl.add_argument("--out", required=True, help="directory for the node folders")
    spl.set_defaults(func=command)
