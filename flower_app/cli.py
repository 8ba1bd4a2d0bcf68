"""The ``flrep`` command: one subcommand per module of :mod:`flower_app.commands`; ``bench``,
``bench-entk`` and ``pareto`` hand their arguments to their own parsers in ``task/``."""

from __future__ import annotations

import argparse
import os
import sys

from flower_app.commands import (bench_round, certs, data, deploy, diagnose, export, lg_synthetic, listing, reproduce,
                                 run, split_data, state, superlink, tune)
from flower_app.run.stop_signals import Stopped, stopping_on_signals

DESCRIPTION = "Run, reproduce and deploy representation-aware federated learning on Flower."
EPILOG = """first steps:
  flrep list                          the experiments and the algorithms
  flrep run quickstart                a first run: FedRep and FedAvg on MNIST
  flrep run lg_mnist --smoke          any experiment, every variant and phase cut short
  flrep reproduce --list              the paper tables and what they cost
  flrep <command> --help              a command's options
docs: README.md and docs/ in the app's folder"""

#: The subcommands in ``flrep --help``'s order, each module with ``add_parser(sub)``.
COMMANDS = (run, bench_round, deploy, certs, split_data, superlink, export, diagnose, listing, lg_synthetic, data,
            state, reproduce, tune)


def build_parser() -> argparse.ArgumentParser:
    """The ``flrep`` parser (its subcommands' parsers in ``SUBCOMMANDS`` after the call)."""
    parser = argparse.ArgumentParser(prog="flrep", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for command in COMMANDS:
        command.add_parser(sub)
    sub.add_parser("bench", help="local-training throughput: engine vs DataLoader (flrep bench --help)")
    sub.add_parser("bench-entk", help="eNTK extraction throughput and stage-2 round time (flrep bench-entk --help)")
    sub.add_parser("pareto", help="LocalUpdate convergence/accuracy Pareto frontiers, Figs. 1-5 (flrep pareto --help)")
    SUBCOMMANDS.clear()
    SUBCOMMANDS.update(sub.choices)
    return parser


#: name -> parser of each ``flrep`` subcommand (filled by :func:`build_parser`).
SUBCOMMANDS: dict[str, argparse.ArgumentParser] = {}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``flrep``'s arguments. A command's key=value overrides may come before, between or after
    its options (argparse's intermixed parsing, which works per subcommand)."""
    parser = build_parser()
    if argv and argv[0] in SUBCOMMANDS and SUBCOMMANDS[argv[0]].get_default("func") is not None:
        args = SUBCOMMANDS[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # --help, no or an unknown command


def _current_directory_importable() -> None:
    """Plug-in modules in the current directory import here and in the processes this command
    starts (simulation workers, SuperNodes), as with ``python -m``; after everything else on the path."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, cwd])


def _stoppable(args: argparse.Namespace) -> int:
    """The command, ended by a stop signal it does not handle itself with one line and 128 + the
    signal's number (no traceback)."""
    with stopping_on_signals():
        try:
            return args.func(args)
        except Stopped as stop:
            print(f"flrep: {args.command} {stop}", file=sys.stderr)
            return stop.exit_code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _current_directory_importable()
    if argv[:1] == ["bench"]:
        from task.learning.benchmark import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["bench-entk"]:
        from task.tct.benchmark import main as tct_bench_main

        return tct_bench_main(argv[1:])
    if argv[:1] == ["pareto"]:
        from task.analysis.pareto import main as pareto_main

        return pareto_main(argv[1:])
    args = parse_args(argv)
    if args.command in ("run", "deploy"):
        os.environ["FLREP_VERBOSE"] = "1" if args.verbose else "0"  # console.VERBOSE_ENV, read by the ServerApp
    from flower_app.run.run_lock import owned

    with owned():  # the folders the command locked are given up when it ends
        return _stoppable(args)


if __name__ == "__main__":
    sys.exit(main())
