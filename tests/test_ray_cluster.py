"""The simulation on a real two-node Ray cluster on loopback (``simulation.ray_address``).

Each node is a ``ray start`` of its own with its own HOME, so a node's own folders (``~/.cache/flrep``)
are apart, as on two machines (its files are still readable by the other node by their absolute
paths, so the tests check where client state is written, not only the metrics). Slow (two Ray nodes, three
runs): ``pytest -m slow tests/test_ray_cluster.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.terminal_signals import as_in_a_terminal

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
#: A small FedRep run whose heads would go to the node's disk (disk_above_bytes=0) without the cluster rule.
RUN = ["quickstart", "compare=[]", "rounds=4", "data.num_clients=6", "train.fraction=0.5", "eval.final_window=2",
       "client_state.disk_above_bytes=0", "wandb.enabled=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(marker: str) -> None:
    """Kill every process whose command line names ``marker`` (this cluster's folder), and their children."""
    found = [p for p in psutil.process_iter(["cmdline"]) if any(marker in c for c in (p.info["cmdline"] or []))]
    for proc in list(found):
        try:
            found += proc.children(recursive=True)
        except psutil.Error:
            pass
    for proc in found:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(found, timeout=10)


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node on loopback, one CPU each, each with its own HOME; their address."""
    root = Path(tempfile.mkdtemp(prefix="flrep-rc-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    port, homes = _free_port(), [root / "n1", root / "n2"]
    for home in homes:
        home.mkdir()
    base = {k: v for k, v in os.environ.items() if k != "FLREP_DATA"}  # each node's data home: its own HOME's
    base["RAY_DISABLE_USAGE_STATS"] = "1"
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=1", f"--temp-dir={root / 't'}",
                        "--include-dashboard=false", f"--ray-client-server-port={_free_port()}", "--disable-usage-stats"],
                       env=dict(base, HOME=str(homes[0])), check=True, timeout=180, capture_output=True)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--disable-usage-stats"],
                       env=dict(base, HOME=str(homes[1])), check=True, timeout=180, capture_output=True)
        yield f"127.0.0.1:{port}", homes
    finally:
        _stop(str(root / "t"))
        _stop(f"127.0.0.1:{port}")
        shutil.rmtree(root, ignore_errors=True)


def _flrep(*args: str, home: Path | None = None, data_home: bool = True) -> subprocess.CompletedProcess:
    """``flrep run ARGS``; ``data_home`` False: without ``$FLREP_DATA`` (each node's own data home)."""
    env = {k: v for k, v in os.environ.items() if data_home or k != "FLREP_DATA"}
    env.update({"HOME": str(home)} if home else {})
    return subprocess.run([sys.executable, "-m", "flower_app.cli", "run", *args], env=env, capture_output=True,
                          text=True, timeout=900)


def _evals(out: Path) -> list[dict]:
    keys = ("round", "personalized_accuracy", "personalized_loss", "global_accuracy", "client_accuracy")
    return [{k: r.get(k) for k in keys} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["phase"] == "eval"]


def test_a_fedrep_run_served_by_both_nodes_equals_a_one_node_run(cluster, tmp_path):
    address, homes = cluster
    (tmp_path / "home").mkdir()
    local = _flrep(*RUN, "--out", str(tmp_path / "local"), home=tmp_path / "home")  # its state files: not the nodes'
    assert local.returncode == 0, local.stderr[-3000:]
    spread = _flrep(*RUN, f"simulation.ray_address={address}", "--out", str(tmp_path / "cluster"), home=homes[0])
    assert spread.returncode == 0, spread.stderr[-3000:]
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert len(summary["served_by"]) == 2, summary.get("served_by")  # both Ray nodes served clients
    assert min(summary["served_by"].values()) > 0
    assert "served_by" not in json.loads((tmp_path / "local" / "summary.json").read_text())
    assert _evals(tmp_path / "cluster") == _evals(tmp_path / "local")
    # nothing a client keeps went to a node's own disk: on loopback a file named by its absolute path
    # would still be found by the other node, so the place itself is what shows the rule
    assert not [p for home in homes for p in (home / ".cache" / "flrep").rglob("client-state/**/*") if p.is_file()]


def test_a_resumed_cluster_run_equals_an_uninterrupted_one(cluster, tmp_path):
    address, homes = cluster
    # 40 rounds: on an idle machine a round takes 0.4 s, and Ctrl-C after round 3 must find the run still going
    on_cluster = [*RUN, "rounds=40", f"simulation.ray_address={address}"]
    whole = _flrep(*on_cluster, "--out", str(tmp_path / "whole"), home=homes[0])
    assert whole.returncode == 0, whole.stderr[-3000:]
    parts = tmp_path / "parts"
    env = dict(os.environ, HOME=str(homes[0]))
    proc = subprocess.Popen([sys.executable, "-m", "flower_app.cli", "run", *on_cluster, "--out", str(parts)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None and len(_evals(parts) if (parts / "metrics.jsonl").is_file() else []) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # Ctrl-C after round 3's evaluation, as a user would stop it
    assert proc.wait(timeout=120) == 130, proc.stderr.read()[-2000:]
    assert len(_evals(parts)) < len(_evals(tmp_path / "whole"))
    resumed = _flrep(*on_cluster, f"resume={parts}", home=homes[0])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _evals(parts) == _evals(tmp_path / "whole")


def test_a_node_without_the_data_is_named_before_anything_is_written(cluster, tmp_path):
    address, homes = cluster
    own = homes[0] / ".cache" / "flrep" / "data"  # the head's data home has MNIST, node 2's (its HOME) not
    own.mkdir(parents=True, exist_ok=True)
    if not (own / "mnist").exists():
        (own / "mnist").symlink_to(Path(os.environ["FLREP_DATA"]) / "mnist")
    out = tmp_path / "run"
    result = _flrep("lg_mnist", "rounds=1", f"simulation.ray_address={address}", "--out", str(out), home=homes[0],
                    data_home=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "has no dataset at" in result.stderr and str(homes[1]) in result.stderr, result.stderr[-2000:]
    assert not out.exists()
    assert not list(tmp_path.glob(".flrep-cluster-probe*"))
