"""``flrep list``: the experiments and the algorithms, one line each (:mod:`flower_app.tools.catalogue`)."""

from __future__ import annotations

import argparse
import sys

from task.errors import ConfigError


def command(args: argparse.Namespace) -> int:
    from flower_app.run.experiment_files import experiment_names
    from flower_app.tools.catalogue import algorithm_lines, builtin_algorithms, experiment_lines, load_catalogue

    try:
        catalogue = load_catalogue()
    except ConfigError as err:
        print(f"flrep: {err}", file=sys.stderr)
        return 2
    print("experiments (flrep run <name>; estimated minutes of the whole run, all its variants, one seed):")
    print("\n".join(experiment_lines(experiment_names(), catalogue)))
    print("algorithms (algorithm=<name>):")
    print("\n".join(algorithm_lines(builtin_algorithms())))
    print("plug-in algorithms: algorithm=<name> plugins=[<module>] (docs/extending.md)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    lst = sub.add_parser("list", help="the experiments (what each reproduces, its dataset, estimated minutes) "
                                         "and the algorithms (what each does, its paper)")
    lst.set_defaults(func=command)
