"""``flrep lg-synthetic``: LG-FedAvg's synthetic analysis, Figs. 2 and 4 (:mod:`task.analysis.lg_synthetic`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def command(args: argparse.Namespace) -> int:
    from task.analysis.lg_synthetic import run

    out = Path(args.out).expanduser().resolve()
    summary = run(list(args.rho), out, seed=args.seed, sigma=args.sigma)
    for res in summary["settings"]:
        print(f"rho={res['rho']}: local {res['local_mse']:.4f}, global {res['global_mse']:.4f}, "
              f"best alpha {res['best_alpha']:.2f} -> {res['best_mse']:.4f} (theory alpha* {res['theory_alpha_star']:.2f})")
    print(f"flrep: outputs in {out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    syn = sub.add_parser("lg-synthetic", help="LG-FedAvg Fig. 2/4: local, global and interpolated linear models")
    syn.add_argument("--out", required=True, help="output directory")
    syn.add_argument("--rho", type=float, nargs="+", default=[0.5, 0.1, 0.06, 0.02], help="device std rho")
    syn.add_argument("--sigma", type=float, default=1.5, help="label noise std sigma")
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=command)
