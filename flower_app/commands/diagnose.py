"""``flrep diagnose``: representation diagnostics of runs or exported models (:mod:`flower_app.tools.diagnose`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flower_app.commands.common import config_error, positive_int
from task.errors import ConfigError


def command(args: argparse.Namespace) -> int:
    import torch

    from flower_app.tools import diagnose

    torch.set_num_threads(args.threads)
    paths, out = [Path(p) for p in args.models], Path(args.out).expanduser().resolve()
    try:
        if args.analysis == "cosine":
            results = diagnose.cosine(paths, out)
        else:
            if not args.clients:
                print("flrep: configuration error: --clients EXPERIMENT [key=value ...] names the new clients' data",
                      file=sys.stderr)
                return 2
            clients = diagnose.new_clients(args.clients[0], args.clients[1:], args.new_clients)
            if args.analysis == "cka":
                results = diagnose.cka(paths, clients, args.epochs, max(args.samples), args.lr, args.batch_size,
                                       args.seed, out)
            else:
                results = diagnose.transfer(paths, clients, args.epochs, args.samples, args.trials, args.lr,
                                            args.batch_size, args.seed, out)
    except ConfigError as err:
        return config_error(err)
    for name, result in results.items():
        numbers = {k: v for k, v in result.items() if k in ("mean_diagonal", "mean_off_diagonal", "cka", "mean")}
        print(f"{name}: " + ", ".join(f"{k} {_short(v)}" for k, v in numbers.items()))
    print(f"flrep: {args.analysis} results in {out}")
    return 0


def _short(value) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in value) + "]" if isinstance(value, list) else f"{value:.3f}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    dia = sub.add_parser("diagnose", help="representation diagnostics of runs or exported models: per-class feature "
                                          "cosine, CKA per layer under fine-tuning, fine-tuning transfer")
    dia.add_argument("analysis", choices=["cosine", "cka", "transfer"])
    dia.add_argument("models", nargs="+", help="run directories (a comparison's variant folders) or model.pt files")
    dia.add_argument("--out", required=True, help="directory for the PNGs, CSVs and JSON")
    dia.add_argument("--clients", nargs="+", metavar="EXPERIMENT [key=value]",
                     help="cka, transfer: the new clients' data: an experiment (with overrides); its held-out new "
                          "clients (data.num_new_clients) if it has them, else its first clients")
    dia.add_argument("--new-clients", type=positive_int, default=5, help="how many new clients (default 5)")
    dia.add_argument("--epochs", type=positive_int, default=10, help="fine-tuning epochs (default 10)")
    dia.add_argument("--samples", type=int, nargs="+", default=[10, 50, 100, 200],
                     help="transfer: samples per epoch to try (default 10 50 100 200); cka: the largest is used")
    dia.add_argument("--trials", type=positive_int, default=5, help="transfer: trials per new client (default 5)")
    dia.add_argument("--lr", type=float, default=0.01, help="fine-tuning SGD step size (default 0.01)")
    dia.add_argument("--batch-size", type=positive_int, default=10, help="fine-tuning batch size (default 10)")
    dia.add_argument("--seed", type=int, default=0)
    dia.add_argument("--threads", type=positive_int, default=1,
                     help="torch threads (default 1: with more, a fine-tuning step ran 9x slower on a busy 2-core "
                          "machine; raise it on an idle one)")
    dia.set_defaults(func=command)
