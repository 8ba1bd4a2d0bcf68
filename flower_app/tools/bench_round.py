"""``flrep bench-round``: a few rounds of an experiment in Flower's simulation engine, and where
their time went: engine start-up, each server phase (start-up data loading, handshake,
exchanges = dispatch + client work + replies, aggregation, server-side evaluation,
checkpoints) and the clients' own seconds (runtime setup with data loading, compute, state
snapshots; summed over clients, so parallel workers can exceed the wall time).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from flower_app.run.config import PROJECT_DIR
from flower_app.tools.memory import TreeMemory


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def commit() -> str | None:
    """The checked-out commit of the app, ``+changes`` when tracked files outside ``docs/`` (the
    app's code and configs, not the reports runs write there) differ from it (None outside a git
    checkout)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_DIR, capture_output=True, text=True)
    if not out.stdout.strip():
        return None
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":(exclude)docs"], cwd=PROJECT_DIR, capture_output=True).returncode != 0
    return out.stdout.strip() + ("+changes" if dirty else "")


def breakdown(summary: dict, started: float, ended: float) -> dict:
    """The report of one run: its phases from ``summary.json`` and the engine's start-up."""
    engine = summary["started_at"] - started
    phases = summary["timings"]
    server = {k: v for k, v in phases.items() if not k.startswith("clients:")}
    clients = {k[len("clients: "):]: v for k, v in phases.items() if k.startswith("clients:")}
    start = sum(v["s"] for k, v in server.items() if k.startswith("start:"))
    rounds = int(summary["rounds"])
    return {"total_s": round(ended - started, 3), "engine_startup_s": round(engine, 3),
            "app_startup_s": round(start, 3),
            "rounds_s": round(summary["wall_time_s"], 3),
            "per_round_s": round(summary["wall_time_s"] / rounds, 3),
            "server_phases": server, "client_seconds": clients}


def table(report: dict) -> str:
    """The report as an aligned text table."""
    rows = [("total (command start to end)", report["total_s"], ""),
            ("engine start-up (to the ServerApp's experiment)", report["engine_startup_s"], ""),
            ("app start-up (data, model, handshake)", report["app_startup_s"], ""),
            (f"rounds ({report['rounds']})", report["rounds_s"], f"{report['per_round_s']} s/round")]
    rows += [(f"  server {name}", v["s"], f"{v['calls']} calls") for name, v in report["server_phases"].items()]
    rows += [(f"  clients {name}", v["s"], f"{v['calls']} messages, summed")
             for name, v in report["client_seconds"].items()]
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {seconds:>9.3f} s  {note}" for name, seconds, note in rows]
    if "memory" in report:
        mem = report["memory"]
        lines.append(f"{'peak memory of the process tree':<{width}}  {mem['peak_rss_tree_mb']:>9} MiB RSS summed over "
                     f"{mem['processes_at_peak']} processes (PSS {mem['peak_pss_tree_mb']} MiB)")
    return "\n".join(lines)


def bench_round(experiment: str, overrides: list[str], rounds: int) -> dict:
    """Run ``rounds`` rounds of ``experiment`` in the simulation engine and report where the time went."""
    from flower_app.run.config import load_variants
    from flower_app.run.simulation import check_resources, client_gpus_of, run_blocking

    with tempfile.TemporaryDirectory(prefix="flrep-bench-round-") as tmp:
        out = Path(tmp) / "run"
        items = [*overrides, f"rounds={rounds}", "compare=[]", "wandb.enabled=false", f"out_dir={out}"]
        cfg = load_variants(experiment, items)[0]
        check_resources(cfg.simulation)
        started = time.time()
        with TreeMemory() as memory:
            run_blocking(experiment, items, int(cfg.data.num_clients), float(cfg.simulation.client_cpus),
                         client_gpus_of(cfg.simulation), cfg.simulation.ray_address)
        ended = time.time()
        summary = json.loads((out / "summary.json").read_text())
    if summary.get("status") != "completed":
        raise RuntimeError(f"the benchmark run failed: {summary.get('failure_reason')}")
    report = {"experiment": experiment, "overrides": overrides, "rounds": rounds,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "machine": machine(), "num_clients": summary["num_clients"],
              "clients_per_round": summary["clients_per_round"]}
    report.update(breakdown(summary, started, ended))
    report["memory"] = memory.report()
    return report
