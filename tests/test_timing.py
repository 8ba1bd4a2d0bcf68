"""Where a run's time goes: server phases and the clients' own seconds reach the summary's
``timings``; the clients' timing metrics never reach a record or an aggregate; the
``flrep bench-round`` report adds the phases up honestly."""

import json
import time

import pytest

from flower_app.tools.bench_round import breakdown, table
from flower_app.run.config import load_config, load_variants
from flower_app.app.experiment import Experiment
from flower_app.app.server_app import run_variants
from tests.local_grid import LocalGrid


def test_timings_are_reported_and_never_aggregated(tmp_path):
    overrides = f"wandb.enabled=false compare=[] data.num_clients=4 train.fraction=0.5 rounds=2 out_dir={tmp_path}"
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    timings = summary["timings"]
    assert timings["exchange: train"]["calls"] == 2 and timings["round: aggregate"]["calls"] == 2
    assert timings["clients: train compute_s"]["calls"] == 4  # 2 rounds x 2 sampled clients
    assert timings["clients: evaluate compute_s"]["calls"] == 8  # FedRep: every client evaluates its own head
    assert timings["clients: train snapshot_s"]["calls"] == 4
    assert all(v["s"] >= 0 for v in timings.values())
    records = (tmp_path / "metrics.jsonl").read_text()
    assert "t/" not in records and "compute_s" not in records


def test_the_bench_report_adds_up():
    summary = {"started_at": 100.0, "wall_time_s": 8.0, "startup_s": 2.0, "rounds": 4,  # wall time: the rounds only
               "timings": {"start: data and model": {"s": 1.0, "calls": 1}, "start: handshake": {"s": 1.0, "calls": 1},
                           "exchange: train": {"s": 6.0, "calls": 4},
                           "clients: train compute_s": {"s": 9.0, "calls": 8}}}
    report = breakdown(summary, started=98.5, ended=111.0)
    assert report["total_s"] == 12.5 and report["engine_startup_s"] == 1.5 and report["app_startup_s"] == 2.0
    assert report["rounds_s"] == 8.0 and report["per_round_s"] == 2.0
    assert report["client_seconds"] == {"train compute_s": {"s": 9.0, "calls": 8}}
    text = table({**report, "rounds": 4})
    assert "2.0 s/round" in text and "clients train compute_s" in text
    json.dumps(report)


def test_bench_round_on_cuda_gives_the_clientapps_a_gpu_share():
    from flower_app.commands.bench_round import device_overrides as _device_overrides

    assert _device_overrides(None, ["rounds=2"]) == []
    assert _device_overrides("cpu", []) == ["simulation.device=cpu"]
    assert _device_overrides("cuda", []) == ["simulation.device=cuda", "simulation.client_gpus=0.1"]
    assert _device_overrides("cuda", ["simulation.client_gpus=0.5"]) == ["simulation.device=cuda"]


def test_tree_memory_counts_the_processes_a_run_starts():
    import subprocess
    import sys

    from flower_app.tools.memory import TreeMemory

    child = "import time; block = bytearray(160 * 2**20); time.sleep(1.5)"
    with TreeMemory(interval=0.1) as memory:
        subprocess.run([sys.executable, "-c", child], check=True)
    report = memory.report()
    assert report["processes_at_peak"] >= 2
    assert report["peak_rss_tree_mb"] >= 160 + 10  # the child's block plus at least some of this process
    assert any(rss >= 160 for _, rss in report["largest_at_peak_mb"])


def test_bench_clientapp_times_fresh_processes(tmp_path):
    from flower_app.tools.bench_clientapp import main

    assert main(["quickstart", "--processes", "2", "--out", str(tmp_path / "r.json")]) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        assert set(run) == {"process_s", "imports_s", "config_s", "data_s", "model_s"}
        assert run["process_s"] > run["imports_s"] + run["config_s"] + run["data_s"] + run["model_s"] > 0


class SlowStartGrid(LocalGrid):
    """The nodes take 1.5 s to answer the handshake (a slow engine start), then answer at once."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if any(m.metadata.message_type.startswith("query") for m in messages):
            time.sleep(1.5)
        return super().send_and_receive(messages, timeout=timeout)


def test_start_up_is_counted_apart_from_the_rounds(tmp_path):
    overrides = f"wandb.enabled=false compare=[] rounds=2 eval.final_window=1 out_dir={tmp_path}"
    summary = run_variants(SlowStartGrid(20, {"experiment": "quickstart", "overrides": overrides}),
                           load_variants("quickstart", overrides.split()))
    assert summary["startup_s"] >= 1.5 and summary["wall_time_s"] < summary["startup_s"]
    assert summary["total_time_s"] == pytest.approx(summary["startup_s"] + summary["wall_time_s"], abs=0.05)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["round"] == 1 and records[0]["elapsed_s"] < 1.5  # round 1 is not charged the start-up
