"""``flrep run``: an experiment in Flower's simulation engine, until it ends; the exit code says how it went."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback

from flower_app.commands.common import (command_start, first_second_check, prepare_run, resume_command,
                                         run_outcome, summary_stamp)
from flower_app.run.stop_signals import Stopped


#: Seconds the simulation engine may take to wind down after the ServerApp ended before the
#: command stops it: a ClientApp that never answers would keep it waiting for ever.
ENGINE_WIND_DOWN_S = 10.0


def _leave_when_the_engine_hangs(out, before, engine_ended: threading.Event) -> None:
    """Once the ServerApp has ended, give the engine :data:`ENGINE_WIND_DOWN_S` to end too; if it
    has not, end the command with the run's outcome, stopping Ray and every process it started."""
    from flower_app.app.server_app import finished, stopped_by_config_error
    from flower_app.run.console import say
    from flower_app.run.simulation import exit_interrupted

    finished.wait()
    if engine_ended.wait(ENGINE_WIND_DOWN_S):
        return
    say(f"the run is over, but ClientApps are still busy {ENGINE_WIND_DOWN_S:g} s after its end (a client that "
        "never answered): stopping the simulation engine")
    exit_interrupted(2 if stopped_by_config_error.is_set() else run_outcome(out, before))


def command(args: argparse.Namespace) -> int:
    if not first_second_check(args):
        return 2
    from flower_app.run.console import say
    from flower_app.app.outcome import COMMAND_START_ENV
    from flower_app.app.server_app import stopped_by_config_error
    from flower_app.run.simulation import check_simulation, client_gpus_of, exit_interrupted, run_blocking

    prepared = prepare_run(args, check=lambda cfg: check_simulation(cfg, args.experiment, list(args.overrides)))
    if isinstance(prepared, int):
        return prepared
    overrides, cfg, out = prepared
    before = summary_stamp(out)
    os.environ[COMMAND_START_ENV] = str(command_start())  # the run counts the engine's start as start-up
    where = f" on the Ray cluster at {cfg.simulation.ray_address}" if cfg.simulation.ray_address else ""
    say(f"starting Flower's simulation engine{where}: {int(cfg.data.num_clients)} SuperNodes, "
        f"{float(cfg.simulation.client_cpus):g} CPU(s) per ClientApp", command_start())
    engine_ended = threading.Event()
    threading.Thread(target=_leave_when_the_engine_hangs, args=(out, before, engine_ended), daemon=True).start()
    try:
        run_blocking(args.experiment, overrides, int(cfg.data.num_clients),
                     float(cfg.simulation.client_cpus), client_gpus_of(cfg.simulation), cfg.simulation.ray_address)
        engine_ended.set()
    except Stopped as stop:  # the engine is down; the ServerApp's thread would keep the process alive
        print(f"flrep: run in {out} {stop}; continue it from its last checkpoint with:\n"
              f"  {resume_command(args, out)}", file=sys.stderr)
        exit_interrupted(stop.exit_code)
    except SystemExit as err:
        if stopped_by_config_error.is_set():  # the ServerApp said why in one line
            exit_interrupted(2)
        print(f"flrep: run failed: the simulation exited with code {err.code}", file=sys.stderr)
        exit_interrupted(1)
    except BaseException as err:  # noqa: BLE001 - report any failure as a non-zero exit
        traceback.print_exc()
        print(f"flrep: run failed: {type(err).__name__}: {err}", file=sys.stderr)
        exit_interrupted(1)
    if stopped_by_config_error.is_set():
        exit_interrupted(2)
    code = run_outcome(out, before)
    if code != 0:  # a failed simulation may leave threads waiting for replies: leave without joining them
        exit_interrupted(code)
    return code


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    run = sub.add_parser("run", help="run an experiment in Flower's simulation engine and wait for it")
    run.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rounds=5 train.lr=0.1")
    run.add_argument("--out", help="output directory (default: outputs/<experiment>-<timestamp>)")
    run.add_argument("--force", action="store_true", help="move an earlier run in the output directory aside "
                     "(to <dir>.old-<time>; nothing is deleted) instead of refusing to start")
    run.add_argument("--verbose", action="store_true", help="also show Flower's and Ray's INFO lines and warnings")
    run.add_argument("--smoke", action="store_true", help="a first look: every variant and phase cut short "
                     "(3 rounds, 1 local epoch, short warm starts and phases), printing what it shortened (smoke=true)")
    run.set_defaults(func=command)
