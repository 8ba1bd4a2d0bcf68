"""What a fresh ClientApp process costs before it computes: a deployed SuperNode (Flower 1.41)
starts one per message. Each measurement is a new Python process that imports the ClientApp,
reads the run config, loads one client's data the way a deployed node does (its partition
cache) and builds the model; the report is JSON.

Usage: ``python -m flower_app.tools.bench_clientapp <experiment> [--partition 1] [--processes 3] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(experiment: str, partition: int, cache: str) -> dict:
    """The phases of one fresh process (run inside it)."""
    start = time.perf_counter()
    import flower_app.app.client_app  # noqa: F401 - torch, Flower and the app, as flwr-clientapp imports them
    imported = time.perf_counter()
    from flower_app.run.config import initial_model, run_config_of
    from task.data.partition_cache import client_data

    cfg = run_config_of({"experiment": experiment, "overrides": ""}, None)
    configured = time.perf_counter()
    fed = client_data(cfg.data, int(cfg.seed), partition, Path(cache))
    loaded = time.perf_counter()
    initial_model(cfg, fed.bundle)
    built = time.perf_counter()
    return {"imports_s": imported - start, "config_s": configured - imported, "data_s": loaded - configured,
            "model_s": built - loaded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flower_app.tools.bench_clientapp", description=__doc__)
    parser.add_argument("experiment")
    parser.add_argument("--partition", type=int, default=1)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.experiment, args.partition, args.child)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory(prefix="flrep-bench-clientapp-") as cache:
        for _ in range(args.processes):  # the first builds the partition cache, the others read it
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "flower_app.tools.bench_clientapp", args.experiment, "--partition",
                                  str(args.partition), "--child", cache], capture_output=True, text=True, check=True)
            runs.append({"process_s": time.perf_counter() - start, **json.loads(out.stdout.strip().splitlines()[-1])})
    for i, run in enumerate(runs):
        print(f"process {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in run.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"experiment": args.experiment, "partition": args.partition,
                                              "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
