"""``flrep certs``: a CA, the SuperLink's TLS certificate and SuperNode key pairs (:mod:`flower_app.tools.certs`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flower_app.commands.common import config_error, positive_int
from task.errors import ConfigError


def command(args: argparse.Namespace) -> int:
    from flower_app.tools.certs import make_deployment_keys
    from flower_app.run.run_dir import check_writable

    try:
        check_writable(Path(args.out).expanduser().resolve(), "--out")
        keys = make_deployment_keys(Path(args.out), args.nodes, args.host, force=args.force)
    except FileExistsError as err:
        print(f"flrep: configuration error: {err.filename} exists: these keys may be in use; "
              "give another --out, or --force to replace them", file=sys.stderr)
        return 2
    except (ConfigError, OSError) as err:
        return config_error(err)
    print(f"flrep: CA {keys.ca}, SuperLink certificate {keys.server_cert} (hosts {', '.join(args.host)}), "
          f"{len(keys.node_keys)} SuperNode key pairs node-<i>.key / node-<i>.pub in {Path(args.out).resolve()}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Its parser, as a subcommand of ``flrep``."""
    crt = sub.add_parser("certs", help="create a CA, the SuperLink's TLS certificate and SuperNode key pairs")
    crt.add_argument("--out", required=True, help="directory for the files")
    crt.add_argument("--nodes", type=positive_int, required=True, help="number of SuperNode key pairs")
    crt.add_argument("--host", nargs="+", default=["127.0.0.1", "localhost"],
                     help="SuperLink addresses the certificate is valid for (IPs and names)")
    crt.add_argument("--force", action="store_true", help="replace an existing CA")
    crt.set_defaults(func=command)
