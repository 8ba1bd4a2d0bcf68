"""``flrep bench-round``: a few rounds in the simulation engine and where their time went (:mod:`flower_app.tools.bench_round`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flower_app.commands.common import config_error, positive_int
from task.errors import ConfigError


def device_overrides(device: str | None, overrides: list[str]) -> list[str]:
    """``--device``: ``simulation.device``; on ``cuda`` also a tenth of a GPU per ClientApp unless
    ``simulation.client_gpus`` is given (Ray shows no GPU to a ClientApp that asks for none)."""
    if device is None:
        return []
    extra = [f"simulation.device={device}"]
    if device == "cuda" and not any(o.startswith("simulation.client_gpus=") for o in overrides):
        extra.append("simulation.client_gpus=0.1")
    return extra


def command(args: argparse.Namespace) -> int:
    from flower_app.tools.bench_round import bench_round, table
    from flower_app.run.simulation import exit_interrupted

    try:
        report = bench_round(args.experiment, [*args.overrides, *device_overrides(args.device, args.overrides)],
                             args.rounds)
    except ConfigError as err:
        return config_error(err)
    except BaseException as err:  # noqa: BLE001 - a failed benchmark run: leave without waiting threads
        print(f"flrep: bench-round failed: {type(err).__name__}: {err}", file=sys.stderr)
        exit_interrupted(1)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"flrep: report in {Path(args.out).resolve()}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    bench = sub.add_parser("bench-round", help="run a few rounds in the simulation engine and report where the time "
                                               "went (engine start-up, server phases, clients' setup/compute/snapshots)")
    bench.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    bench.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    bench.add_argument("--rounds", type=positive_int, default=3, help="rounds to run (default 3)")
    bench.add_argument("--out", help="also write the report as JSON to this file")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="simulation.device (cuda: with "
                       "simulation.client_gpus=0.1 unless given, ten ClientApps per GPU)")
    bench.set_defaults(func=command)
