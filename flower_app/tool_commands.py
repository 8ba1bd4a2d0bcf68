"""The ``flrep`` commands around runs, apart from running them: keys for a deployment
(``certs``), per-node data (``split-data``), the local SuperLink of ``flwr run .``
(``superlink``), a run's model (``export``), representation diagnostics (``diagnose``), the
experiments and algorithms (``list``) and the LG-FedAvg synthetic analysis (``lg-synthetic``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from task.errors import ConfigError


def _cmd_certs(args: argparse.Namespace) -> int:
    from flower_app.certs import make_deployment_keys
    from flower_app.run_dir import check_writable

    try:
        check_writable(Path(args.out).expanduser().resolve(), "--out")
        keys = make_deployment_keys(Path(args.out), args.nodes, args.host, force=args.force)
    except FileExistsError as err:
        print(f"flrep: configuration error: {err.filename} exists: these keys may be in use; "
              "give another --out, or --force to replace them", file=sys.stderr)
        return 2
    except (ConfigError, OSError) as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    print(f"flrep: CA {keys.ca}, SuperLink certificate {keys.server_cert} (hosts {', '.join(args.host)}), "
          f"{len(keys.node_keys)} SuperNode key pairs node-<i>.key / node-<i>.pub in {Path(args.out).resolve()}")
    return 0


def _cmd_split_data(args: argparse.Namespace) -> int:
    from flower_app.config import load_config
    from flower_app.run_dir import check_writable
    from task.data.node_data import write_partitions

    try:
        cfg = load_config(args.experiment, list(args.overrides))
        check_writable(Path(args.out).expanduser().resolve(), "--out")
        folders = write_partitions(cfg.data, int(cfg.seed), Path(args.out))
    except (ConfigError, OSError) as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    print(f"flrep: {len(folders)} node data folders ({cfg.data.name} format) in {Path(args.out).resolve()}")
    return 0


def _cmd_superlink(args: argparse.Namespace) -> int:
    from flower_app.local_superlink import describe, local_superlinks, stop, with_descendants

    links = local_superlinks()
    if not links:
        print("flrep: no local SuperLink of flwr run . is running for this user")
        return 0
    processes = [p for link in links for p in with_descendants(link)]
    print("flrep: the local SuperLink of flwr run . and the processes it started:")
    for proc in processes:
        print(describe(proc))
    if not args.stop:
        print("flrep: stop them with: flrep superlink --stop")
        return 0
    ended = stop(processes)
    left = sorted({p.pid for p in processes} - set(ended))
    print(f"flrep: stopped {len(ended)} process(es): {' '.join(map(str, ended))}"
          + (f"; still running: {' '.join(map(str, left))}" if left else ""))
    return 1 if left else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from flower_app.export import export_model

    try:
        path = export_model(Path(args.run_dir), Path(args.out) if args.out else None)
    except ConfigError as err:
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    print(f"flrep: model written to {path}")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import torch

    from flower_app import diagnose

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
        print(f"flrep: configuration error: {err}", file=sys.stderr)
        return 2
    for name, result in results.items():
        numbers = {k: v for k, v in result.items() if k in ("mean_diagonal", "mean_off_diagonal", "cka", "mean")}
        print(f"{name}: " + ", ".join(f"{k} {_short(v)}" for k, v in numbers.items()))
    print(f"flrep: {args.analysis} results in {out}")
    return 0


def _short(value) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in value) + "]" if isinstance(value, list) else f"{value:.3f}"


def _cmd_list(args: argparse.Namespace) -> int:
    from flower_app.catalogue import algorithm_lines, experiment_lines, load_catalogue
    from flower_app.config import experiment_names
    from strategies import ALGORITHMS

    try:
        catalogue = load_catalogue()
    except ConfigError as err:
        print(f"flrep: {err}", file=sys.stderr)
        return 2
    print("experiments (flrep run <name>; estimated minutes of the whole run, all its variants, one seed):")
    print("\n".join(experiment_lines(experiment_names(), catalogue)))
    print("algorithms (algorithm=<name>):")
    print("\n".join(algorithm_lines({name: a.description for name, a in sorted(ALGORITHMS.items())})))
    return 0


def _cmd_lg_synthetic(args: argparse.Namespace) -> int:
    from task.analysis.lg_synthetic import run

    out = Path(args.out).expanduser().resolve()
    summary = run(list(args.rho), out, seed=args.seed, sigma=args.sigma)
    for res in summary["settings"]:
        print(f"rho={res['rho']}: local {res['local_mse']:.4f}, global {res['global_mse']:.4f}, "
              f"best alpha {res['best_alpha']:.2f} -> {res['best_mse']:.4f} (theory alpha* {res['theory_alpha_star']:.2f})")
    print(f"flrep: outputs in {out}")
    return 0


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    """The subcommands of this module."""
    crt = sub.add_parser("certs", help="create a CA, the SuperLink's TLS certificate and SuperNode key pairs")
    crt.add_argument("--out", required=True, help="directory for the files")
    crt.add_argument("--nodes", type=positive_int, required=True, help="number of SuperNode key pairs")
    crt.add_argument("--host", nargs="+", default=["127.0.0.1", "localhost"],
                     help="SuperLink addresses the certificate is valid for (IPs and names)")
    crt.add_argument("--force", action="store_true", help="replace an existing CA")
    crt.set_defaults(func=_cmd_certs)
    spl = sub.add_parser("split-data", help="write each client's partition as its own dataset folder (node-<i>/)")
    spl.add_argument("experiment", help="name of a file in conf/experiment/ (without .yaml)")
    spl.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    spl.add_argument("--out", required=True, help="directory for the node folders")
    spl.set_defaults(func=_cmd_split_data)
    slk = sub.add_parser("superlink", help="show (--stop: stop) the local SuperLink that 'flwr run .' leaves running "
                                           "for this user, with its SuperExec and simulation processes")
    slk.add_argument("--stop", action="store_true", help="stop them (SIGTERM, then SIGKILL after 10 s)")
    slk.set_defaults(func=_cmd_superlink)
    exp = sub.add_parser("export", help="write a run's model (its global arrays over the initial model) as a "
                                        "loadable file, for diagnostics")
    exp.add_argument("run_dir", help="a run's output directory (a comparison's variant folder)")
    exp.add_argument("--out", help="the file to write (default <run-dir>/model.pt; never overwritten)")
    exp.set_defaults(func=_cmd_export)
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
    dia.set_defaults(func=_cmd_diagnose)
    lst = sub.add_parser("list", help="the experiments (what each reproduces, its dataset, estimated minutes) "
                                         "and the algorithms (what each does, its paper)")
    lst.set_defaults(func=_cmd_list)
    syn = sub.add_parser("lg-synthetic", help="LG-FedAvg Fig. 2/4: local, global and interpolated linear models")
    syn.add_argument("--out", required=True, help="output directory")
    syn.add_argument("--rho", type=float, nargs="+", default=[0.5, 0.1, 0.06, 0.02], help="device std rho")
    syn.add_argument("--sigma", type=float, default=1.5, help="label noise std sigma")
    syn.add_argument("--seed", type=int, default=0)
    syn.set_defaults(func=_cmd_lg_synthetic)
