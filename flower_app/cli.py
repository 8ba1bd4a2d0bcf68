"""The ``flrep`` command: blocking runs, deployments and the benchmarks' entry points; the
other subcommands are :mod:`flower_app.tool_commands`, :mod:`flower_app.data_command` and
:mod:`flower_app.reproduce_command`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from flower_app.data_command import add_data_parser
from flower_app.reproduce_command import add_reproduce_parser
from flower_app.tool_commands import add_tool_parsers, positive_int
from flower_app.stop_signals import Stopped, stopping_on_signals
from task.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig


def resume_command(args: argparse.Namespace, out: Path) -> str:
    """The exact command that continues this command's run in ``out`` from its last checkpoint."""
    kept = [o for o in args.overrides if not o.startswith(("resume=", "out_dir="))]
    options = [f"--nodes={args.nodes}"] if getattr(args, "nodes", None) else []
    for name in ("tls", "node_data"):
        if getattr(args, name, None):
            options.append(f"--{name.replace('_', '-')}={Path(getattr(args, name)).resolve()}")
    return shlex.join(["flrep", args.command, args.experiment, *kept, *options, f"resume={out}"])


def _start_fresh_without_checkpoint(overrides: list[str], out: Path) -> list[str]:
    """``resume=out`` where ``out`` holds nothing to continue: say so, move any started files
    aside (nothing is deleted) and start a new run in ``out``."""
    from flower_app import run_dir

    moved = run_dir.move_aside(out)
    aside = f" (its files moved to {moved})" if moved is not None else ""
    print(f"flrep: no checkpoint in {out}{aside}, starting fresh", file=sys.stderr)
    return [o for o in overrides if not o.startswith("resume=")] + [f"out_dir={out}"]


def _quick_check(args: argparse.Namespace) -> bool:
    """The mistakes that need no heavy import, found in the command's first second (printed)."""
    from flower_app import run_dir
    from flower_app.precheck import quick_check
    from flower_app.resume_check import check_target

    try:
        check_target(args.overrides, args.out)
        if args.out:  # before the data check, which may download
            run_dir.check_writable(Path(args.out).expanduser().resolve(), "--out")
        quick_check(args.experiment, list(args.overrides))
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return False
    return True


def _prepare(args: argparse.Namespace, extra: list[str] = (), default_out: Path | None = None,
             check: Callable[[DictConfig], None] | None = None):
    """Overrides (the output directory fixed in them), the first variant and the output
    directory, after every check that needs no federation, ``check`` (the command's own)
    included: nothing is written before they pass. Else the exit code: 2 after printing a
    configuration error, 0 for a ``resume=`` of a run that completed (nothing is written)."""
    from flower_app import checkpoint, run_dir, run_lock
    from flower_app.config import load_variants
    from flower_app.experiment import output_dir
    from flower_app.resume_check import completed
    from flower_app.server_app import check_resume, preflight

    from flower_app.console import configure, say
    from task.data.federated_data import build_federated_data

    configure(args.verbose)
    since = command_start()
    overrides = list(args.overrides) + list(extra)
    if args.out:
        overrides.append(f"out_dir={Path(args.out).expanduser().resolve()}")
    try:
        variants = load_variants(args.experiment, overrides)
        if variants[0].resume and completed(output_dir(variants[0])):
            check_resume(variants)  # a resume with another configuration is refused, as always
            print(f"flrep: the run in {output_dir(variants[0])} already completed; nothing to resume")
            return 0
        if not variants[0].resume and not variants[0].out_dir:  # fix the folder, so the outcome can be checked
            where = default_out.resolve() if default_out is not None else output_dir(variants[0])
            overrides.append(f"out_dir={where}")
            variants = load_variants(args.experiment, overrides)
        if check is not None:
            check(variants[0])
        run_dir.check_writable(output_dir(variants[0]))  # before the data: out_dir= and the default folder too
        run_lock.acquire(output_dir(variants[0]))  # before the first write: one command per folder
        if variants[0].resume and not checkpoint.resumable(output_dir(variants[0])):
            overrides = _start_fresh_without_checkpoint(overrides, output_dir(variants[0]))
            variants = load_variants(args.experiment, overrides)
        say(f"configuration checked: {args.experiment}, {len(variants)} variant(s)", since)
        loaded = time.time()
        fed = build_federated_data(variants[0].data, int(variants[0].seed))
        say(f"data ready: {variants[0].data.name}, {len(fed.bundle.train.y):,} train / {len(fed.bundle.test.y):,} "
            f"test samples, {fed.num_clients} clients partitioned in {time.time() - loaded:.1f}s", since)
        moved = preflight(variants, force=bool(getattr(args, "force", False)))
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    out = output_dir(variants[0])
    if moved is not None:
        print(f"flrep: --force: the earlier run in {out} was moved to {moved}", file=sys.stderr)
    return overrides, variants[0], out


def command_start() -> float:
    """When this command's process started (epoch seconds)."""
    import psutil

    return psutil.Process().create_time()


def _summary_stamp(out: Path) -> tuple[int, int] | None:
    """(mtime, size) of ``out``'s summary.json, or None."""
    path = out / "summary.json"
    return (path.stat().st_mtime_ns, path.stat().st_size) if path.is_file() else None


def _outcome(out: Path, before: tuple[int, int] | None) -> int:
    """0 when the run wrote a new summary with status completed; ``before``: the old summary's stamp."""
    summary_path = out / "summary.json"
    if not summary_path.is_file() or _summary_stamp(out) == before:
        print(f"flrep: run failed: no new {summary_path} was written", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    status = summary.get("status")
    if status != "completed":
        reason = summary.get("failure_reason")
        print(f"flrep: run failed: status {status!r} in {summary_path}" + (f": {reason}" if reason else ""),
              file=sys.stderr)
        return 1
    print(f"flrep: outputs in {out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    if not _quick_check(args):
        return 2
    from flower_app.console import say
    from flower_app.experiment import COMMAND_START_ENV
    from flower_app.simulation import check_resources, exit_interrupted, run_blocking

    prepared = _prepare(args, check=lambda cfg: check_resources(cfg.simulation))
    if isinstance(prepared, int):
        return prepared
    overrides, cfg, out = prepared
    before = _summary_stamp(out)
    os.environ[COMMAND_START_ENV] = str(command_start())  # the run counts the engine's start as start-up
    say(f"starting Flower's simulation engine: {int(cfg.data.num_clients)} SuperNodes, "
        f"{float(cfg.simulation.client_cpus):g} CPU(s) per ClientApp", command_start())
    try:
        run_blocking(args.experiment, overrides, int(cfg.data.num_clients),
                     float(cfg.simulation.client_cpus), float(cfg.simulation.client_gpus))
    except Stopped as stop:  # the engine is down; the ServerApp's thread would keep the process alive
        print(f"flrep: run in {out} {stop}; continue it from its last checkpoint with:\n"
              f"  {resume_command(args, out)}", file=sys.stderr)
        exit_interrupted(stop.exit_code)
    except SystemExit as err:
        print(f"flrep: run failed: the simulation exited with code {err.code}", file=sys.stderr)
        exit_interrupted(1)
    except BaseException as err:  # noqa: BLE001 - report any failure as a non-zero exit
        traceback.print_exc()
        print(f"flrep: run failed: {type(err).__name__}: {err}", file=sys.stderr)
        exit_interrupted(1)
    code = _outcome(out, before)
    if code != 0:  # a failed simulation may leave threads waiting for replies: leave without joining them
        exit_interrupted(code)
    return code


def _cmd_deploy(args: argparse.Namespace) -> int:
    if not _quick_check(args):
        return 2
    from flower_app.certs import load_deployment_keys
    from flower_app.deployment import LocalDeployment

    def check_inputs(cfg) -> None:  # before anything is written (or moved aside with --force)
        if args.node_data:  # each SuperNode i reads <node-data>/node-<i>
            missing = [str(Path(args.node_data) / f"node-{i}") for i in range(args.nodes)
                       if not (Path(args.node_data) / f"node-{i}").is_dir()]
            if missing:
                raise ConfigError(f"--node-data: no node folder {', '.join(missing[:4])} (write them with flrep "
                                  "split-data, one node-<i> folder per SuperNode)")
        if args.tls:
            load_deployment_keys(Path(args.tls), args.nodes)

    prepared = _prepare(args, [f"data.num_clients={args.nodes}"], Path("outputs") / f"{args.experiment}-deploy",
                        check=check_inputs)
    if isinstance(prepared, int):
        return prepared
    overrides, cfg, out = prepared
    if cfg.data.root is not None:  # the SuperLink runs the app from its own copy: paths must be absolute
        overrides.append(f"data.root={cfg.data.root}")
    if cfg.resume:
        overrides.append(f"resume={out}")
    before = _summary_stamp(out)
    try:
        keys = load_deployment_keys(Path(args.tls), args.nodes) if args.tls else None
        with LocalDeployment(out / "deployment", keys) as deployment:
            deployment.start_superlink()
            for i in range(args.nodes):
                node = {"partition-id": i, "num-partitions": args.nodes}
                if args.node_data:
                    node["data-path"] = str(Path(args.node_data).resolve() / f"node-{i}")
                key = None
                if keys is not None:
                    key = keys.node_keys[i][0]
                    deployment.register(keys.node_keys[i][1])
                deployment.start_supernode(i, node, key)
            print(f"flrep: SuperLink on {deployment.address} with {args.nodes} SuperNodes; logs in {deployment.work}")
            deployment.run(args.experiment, overrides)  # _prepare fixed out_dir (or resume) in them
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    except Stopped as stop:
        print(f"flrep: deployment {stop}: the SuperLink, SuperNodes and run it started were stopped; continue "
              f"it with:\n  {resume_command(args, out)}", file=sys.stderr)
        return stop.exit_code
    except BaseException as err:  # noqa: BLE001 - report any failure as a non-zero exit
        traceback.print_exc()
        print(f"flrep: deployment failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return _outcome(out, before)


def _device_overrides(device: str | None, overrides: list[str]) -> list[str]:
    """``--device``: ``simulation.device``; on ``cuda`` also a tenth of a GPU per ClientApp unless
    ``simulation.client_gpus`` is given (Ray shows no GPU to a ClientApp that asks for none)."""
    if device is None:
        return []
    extra = [f"simulation.device={device}"]
    if device == "cuda" and not any(o.startswith("simulation.client_gpus=") for o in overrides):
        extra.append("simulation.client_gpus=0.1")
    return extra


def _cmd_bench_round(args: argparse.Namespace) -> int:
    from flower_app.bench_round import bench_round, table
    from flower_app.simulation import exit_interrupted

    try:
        report = bench_round(args.experiment, [*args.overrides, *_device_overrides(args.device, args.overrides)],
                             args.rounds)
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    except BaseException as err:  # noqa: BLE001 - a failed benchmark run: leave without waiting threads
        print(f"flrep: bench-round failed: {type(err).__name__}: {err}", file=sys.stderr)
        exit_interrupted(1)
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"flrep: report in {Path(args.out).resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``flrep`` parser (its subcommands' parsers in ``SUBCOMMANDS`` after the call)."""
    parser = argparse.ArgumentParser(prog="flrep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment in Flower's simulation engine and wait for it")
    run.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rounds=5 train.lr=0.1")
    run.add_argument("--out", help="output directory (default: outputs/<experiment>-<timestamp>)")
    run.add_argument("--force", action="store_true", help="move an earlier run in the output directory aside "
                     "(to <dir>.old-<time>; nothing is deleted) instead of refusing to start")
    run.add_argument("--verbose", action="store_true", help="also show Flower's and Ray's INFO lines and warnings")
    run.set_defaults(func=_cmd_run)
    bench = sub.add_parser("bench-round", help="run a few rounds in the simulation engine and report where the time "
                                               "went (engine start-up, server phases, clients' setup/compute/snapshots)")
    bench.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    bench.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    bench.add_argument("--rounds", type=positive_int, default=3, help="rounds to run (default 3)")
    bench.add_argument("--out", help="also write the report as JSON to this file")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="simulation.device (cuda: with "
                       "simulation.client_gpus=0.1 unless given, ten ClientApps per GPU)")
    bench.set_defaults(func=_cmd_bench_round)
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
    dep.set_defaults(func=_cmd_deploy)
    add_tool_parsers(sub)
    add_data_parser(sub)
    add_reproduce_parser(sub)
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
    from flower_app.run_lock import owned

    with owned():  # the folders the command locked are given up when it ends
        return _stoppable(args)


if __name__ == "__main__":
    sys.exit(main())
