"""The ``flrep`` command: blocking runs, experiment listing and the engine benchmark."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from task.errors import ConfigError


def _cmd_run(args: argparse.Namespace) -> int:
    from flower_app.config import load_variants, validate_with_data
    from flower_app.simulation import run_blocking

    overrides = list(args.overrides)
    if args.out:
        out = Path(args.out).expanduser().resolve()
        overrides.append(f"out_dir={out}")
    try:
        variants = load_variants(args.experiment, overrides)
        for variant in variants:
            validate_with_data(variant)
        cfg = variants[0]
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    out = Path(cfg.out_dir) if cfg.out_dir else None
    if out is not None and (out / "summary.json").exists():
        (out / "summary.json").unlink()
    try:
        run_blocking(args.experiment, overrides, int(cfg.data.num_clients),
                     float(cfg.simulation.client_cpus), float(cfg.simulation.client_gpus))
    except BaseException as err:  # noqa: BLE001 - report any failure as a non-zero exit
        traceback.print_exc()
        print(f"flrep: run failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if out is not None:
        summary_path = out / "summary.json"
        if not summary_path.is_file():
            print(f"flrep: run failed: no {summary_path} was written", file=sys.stderr)
            return 1
        status = json.loads(summary_path.read_text()).get("status")
        if status != "completed":
            print(f"flrep: run failed: status {status!r} in {summary_path}", file=sys.stderr)
            return 1
        print(f"flrep: outputs in {out}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from flower_app.config import experiment_names
    from strategies import ALGORITHMS

    print("experiments:", " ".join(experiment_names()))
    print("algorithms: ", " ".join(ALGORITHMS))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flrep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment in Flower's simulation engine and wait for it")
    run.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rounds=5 train.lr=0.1")
    run.add_argument("--out", help="output directory (default: outputs/<experiment>-<timestamp>)")
    run.set_defaults(func=_cmd_run)
    lst = sub.add_parser("list", help="list experiments and algorithms")
    lst.set_defaults(func=_cmd_list)
    sub.add_parser("bench", help="local-training throughput: engine vs DataLoader (flrep bench --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from task.benchmark import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
