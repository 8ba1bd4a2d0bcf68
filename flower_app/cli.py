"""The ``flrep`` command: blocking runs, experiment listing, the LG-FedAvg synthetic analysis, the
LocalUpdate Pareto frontiers and the engine and TCT benchmarks."""

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


def _cmd_lg_synthetic(args: argparse.Namespace) -> int:
    from task.lg_synthetic import run

    out = Path(args.out).expanduser().resolve()
    summary = run(list(args.rho), out, seed=args.seed, sigma=args.sigma)
    for res in summary["settings"]:
        print(f"rho={res['rho']}: local {res['local_mse']:.4f}, global {res['global_mse']:.4f}, "
              f"best alpha {res['best_alpha']:.2f} -> {res['best_mse']:.4f} (theory alpha* {res['theory_alpha_star']:.2f})")
    print(f"flrep: outputs in {out}")
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
    syn = sub.add_parser("lg-synthetic", help="LG-FedAvg Fig. 2/4: local, global and interpolated linear models")
    syn.add_argument("--out", required=True, help="output directory")
    syn.add_argument("--rho", type=float, nargs="+", default=[0.5, 0.1, 0.06, 0.02], help="device std rho")
    syn.add_argument("--sigma", type=float, default=1.5, help="label noise std sigma")
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_cmd_lg_synthetic)
    sub.add_parser("bench", help="local-training throughput: engine vs DataLoader (flrep bench --help)")
    sub.add_parser("bench-tct", help="TCT: eNTK extraction throughput and stage-2 round time (flrep bench-tct --help)")
    sub.add_parser("pareto", help="LocalUpdate convergence/accuracy Pareto frontiers, Figs. 1-5 (flrep pareto --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from task.benchmark import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["bench-tct"]:
        from task.entk_benchmark import main as tct_bench_main

        return tct_bench_main(argv[1:])
    if argv[:1] == ["pareto"]:
        from task.pareto import main as pareto_main

        return pareto_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
