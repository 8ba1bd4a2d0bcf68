"""``flrep superlink``: show (``--stop``: stop) the local SuperLink that ``flwr run .`` leaves running."""

from __future__ import annotations

import argparse


def command(args: argparse.Namespace) -> int:
    from flower_app.tools.superlink import describe, finished_runs, local_superlinks, stop, with_descendants

    links = local_superlinks()
    if not links:
        print("flrep: no local SuperLink of flwr run . is running for this user")
        return 0
    processes = [p for link in links for p in with_descendants(link)]
    print("flrep: the local SuperLink of flwr run . and the processes it started:")
    for proc in processes:
        print(describe(proc))
    for proc in (p for link in links for p in finished_runs(link)):
        print(f"{proc.pid:>7}  a finished run's process, not yet reaped by Flower's SuperExec (<defunct>, no memory; "
              "it goes at the SuperExec's next run, or with --stop)")
    if not args.stop:
        print("flrep: stop them with: flrep superlink --stop")
        return 0
    ended = stop(processes)
    left = sorted({p.pid for p in processes} - set(ended))
    print(f"flrep: stopped {len(ended)} process(es): {' '.join(map(str, ended))}"
          + (f"; still running: {' '.join(map(str, left))}" if left else ""))
    return 1 if left else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    slk = sub.add_parser("superlink", help="show (--stop: stop) the local SuperLink that 'flwr run .' leaves running "
                                           "for this user, with its SuperExec and simulation processes")
    slk.add_argument("--stop", action="store_true", help="stop them (SIGTERM, then SIGKILL after 10 s)")
    slk.set_defaults(func=command)
