"""``flrep data``: where each dataset of the data home is, and ``flrep data fetch`` to download it."""

from __future__ import annotations

import argparse
import sys

from task.data.home import DEFAULT_FOLDERS, HOME_FOLDERS, data_home, home_origin
from task.errors import ConfigError


def _folder_name(name: str) -> str:
    """A data-home folder from its own name or its dataset's ``data.name`` (``fashion_mnist``)."""
    return name if name in HOME_FOLDERS else DEFAULT_FOLDERS.get(name, name)


def _cmd_data(args: argparse.Namespace) -> int:
    from task.data.fetch import fetch_folder

    if args.action == "fetch":
        if not args.names:
            raise SystemExit(f"flrep data fetch: name a dataset folder: {', '.join(HOME_FOLDERS)}")
        for name in args.names:
            try:
                print(f"[data] {name}: {fetch_folder(_folder_name(name))}")
            except ConfigError as err:
                print(f"flrep: {err}", file=sys.stderr)
                return 2
        return 0
    print(f"data home: {data_home()} ({home_origin()})")
    for entry in HOME_FOLDERS.values():
        path = data_home() / entry.folder
        state = "present" if path.exists() else ("missing: flrep data fetch " + entry.folder if entry.fetchable
                                                 else "missing: placed by hand")
        print(f"  {entry.folder:<14} data.name={entry.dataset:<13} {state}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``data`` subcommand."""
    data = sub.add_parser("data", help="list the data home's datasets (present or not); "
                                       "'flrep data fetch NAME' downloads one into it")
    data.add_argument("action", nargs="?", choices=["list", "fetch"], default="list")
    data.add_argument("names", nargs="*", metavar="NAME", help=f"fetch: dataset folders ({', '.join(HOME_FOLDERS)})")
    data.set_defaults(func=_cmd_data)
