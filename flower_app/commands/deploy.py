"""``flrep deploy``: an experiment on a real local deployment, a SuperLink and N SuperNodes on loopback (:mod:`flower_app.tools.deploy`)."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from flower_app.commands.common import (config_error, first_second_check, positive_int, prepare_run, resume_command,
                                         run_outcome, summary_stamp)
from flower_app.run.stop_signals import Stopped
from task.errors import ConfigError


def command(args: argparse.Namespace) -> int:
    if not first_second_check(args):
        return 2
    from flower_app.tools.certs import load_deployment_keys
    from flower_app.run.console import say
    from flower_app.tools.deploy import LocalDeployment

    def check_inputs(cfg) -> None:  # before anything is written (or moved aside with --force)
        if args.node_data:  # each SuperNode i reads <node-data>/node-<i>
            missing = [str(Path(args.node_data) / f"node-{i}") for i in range(args.nodes)
                       if not (Path(args.node_data) / f"node-{i}").is_dir()]
            if missing:
                raise ConfigError(f"--node-data: no node folder {', '.join(missing[:4])} (write them with flrep "
                                  "split-data, one node-<i> folder per SuperNode)")
        if args.tls:
            load_deployment_keys(Path(args.tls), args.nodes)

    prepared = prepare_run(args, [f"data.num_clients={args.nodes}"], Path("outputs") / f"{args.experiment}-deploy",
                        check=check_inputs)
    if isinstance(prepared, int):
        return prepared
    overrides, cfg, out = prepared
    if cfg.data.root is not None:  # the SuperLink runs the app from its own copy: paths must be absolute
        overrides.append(f"data.root={cfg.data.root}")
    if cfg.resume:
        overrides.append(f"resume={out}")
    before = summary_stamp(out)
    try:
        keys = load_deployment_keys(Path(args.tls), args.nodes) if args.tls else None
        with LocalDeployment(out / "deployment", keys) as deployment:
            deployment.start_superlink()
            say(f"SuperLink up on {deployment.address}; starting {args.nodes} SuperNodes")
            for i in range(args.nodes):
                node = {"partition-id": i, "num-partitions": args.nodes}
                if args.node_data:
                    node["data-path"] = str(Path(args.node_data).resolve() / f"node-{i}")
                key = None
                if keys is not None:
                    key = keys.node_keys[i][0]
                    deployment.register(keys.node_keys[i][1])
                deployment.start_supernode(i, node, key)
            say(f"logs of the SuperLink and SuperNodes in {deployment.work}")
            deployment.run(args.experiment, overrides)  # _prepare fixed out_dir (or resume) in them
    except ConfigError as err:
        return config_error(err)
    except Stopped as stop:
        print(f"flrep: deployment {stop}: the SuperLink, SuperNodes and run it started were stopped; continue "
              f"it with:\n  {resume_command(args, out)}", file=sys.stderr)
        return stop.exit_code
    except BaseException as err:  # noqa: BLE001 - report any failure as a non-zero exit
        traceback.print_exc()
        print(f"flrep: deployment failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return run_outcome(out, before)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    dep = sub.add_parser("deploy", help="run an experiment on a real local deployment: a SuperLink and N SuperNodes "
                                        "on loopback, stopped afterwards")
    dep.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    dep.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    dep.add_argument("--nodes", type=positive_int, required=True, help="number of SuperNodes (= data.num_clients)")
    dep.add_argument("--out", help="output directory (logs of the processes in <out>/deployment)")
    dep.add_argument("--force", action="store_true", help="move an earlier run in the output directory aside")
    dep.add_argument("--verbose", action="store_true", help="also show Flower's and Ray's INFO lines and warnings")
    dep.add_argument("--tls", help="directory made by 'flrep certs': TLS and SuperNode authentication")
    dep.add_argument("--node-data", help="directory made by 'flrep split-data': each SuperNode loads node-<i>/")
    dep.set_defaults(func=command)
