"""``flrep state``: the client state that runs left outside their run folders, and ``--remove``
to delete what finished or deleted runs left (:mod:`flower_app.tools.leftovers`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _cmd_state(args: argparse.Namespace) -> int:
    from flower_app.tools.leftovers import default_roots, remove, survey

    roots = default_roots() + [Path(d).expanduser().resolve() for d in args.dirs]
    found = survey(roots)
    print(f"kept client state in {', '.join(map(str, roots))}: {len(found)} folder(s)")
    for item in found:
        print(f"  {item.verdict:<10} {_size(item.bytes):>9}  idle {item.idle_s / 3600:6.1f} h  {item.path}  "
              f"(run folder: {item.run_folder or 'not named'})")
    removable = [item for item in found if item.removable]
    if not args.remove:
        if removable:
            print(f"{len(removable)} of them ({_size(sum(i.bytes for i in removable))}) were left by finished or "
                  "deleted runs: flrep state --remove deletes them")
        return 0
    for item in remove(found):
        print(f"removed {item.path} ({item.verdict})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``state`` subcommand."""
    state = sub.add_parser("state", help="list the client state that runs left outside their run folders "
                                         "(--remove: delete what finished or deleted runs left)")
    state.add_argument("dirs", nargs="*", metavar="DIR",
                       help="more folders to look in: a SuperNode's state-dir, a client_state.dir")
    state.add_argument("--remove", action="store_true", help="delete the folders of finished or deleted runs "
                       "(never one in use or of a run that can be resumed)")
    state.set_defaults(func=_cmd_state)
