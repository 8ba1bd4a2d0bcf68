"""The cluster rules without a cluster: where a client's state goes, which resources fit, what
the start-up check refuses, and a multi-node Ray without ``simulation.ray_address``."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict

from flower_app.run import ray_cluster
from flower_app.run.config import load_config
from strategies.common import ClientRuntime
from strategies.state_store import SIMULATION_ENV, keep_arrays, kept_arrays, state_root
from task.errors import ConfigError
from task.learning.engine import TensorData
from task.learning.models import build_model


def _runtime(overrides: list[str]) -> ClientRuntime:
    cfg = load_config("quickstart", overrides)
    model = build_model("digits_mlp", (1, 8, 8), 10)
    data = TensorData(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long))
    return ClientRuntime(cfg, 3, torch.device("cpu"), data, data, model, ["fc2"], {}, state=RecordDict(), run_id=7)


def test_on_a_cluster_every_kept_array_travels_in_the_context_state(monkeypatch, tmp_path):
    monkeypatch.setenv(SIMULATION_ENV, "1")
    tensors = {"w": torch.randn(64, 64)}  # 16 KB, above disk_above_bytes=100
    alone = _runtime([f"client_state.dir={tmp_path / 'alone'}", "client_state.disk_above_bytes=100"])
    keep_arrays(alone, "head", tensors)
    assert not isinstance(alone.state[alone.state_key("head")], ArrayRecord)  # one machine: on its disk
    spread = _runtime([f"out_dir={tmp_path / 'run'}", "client_state.disk_above_bytes=100",
                       "simulation.ray_address=127.0.0.1:1"])
    keep_arrays(spread, "head", tensors)
    assert isinstance(spread.state[spread.state_key("head")], ArrayRecord)
    torch.testing.assert_close(kept_arrays(spread, "head")["w"], tensors["w"])
    assert not (tmp_path / "run").exists()
    assert state_root(spread.cfg) == tmp_path / "run" / "client-state"  # TCT's files: in the shared run folder


def test_client_resources_must_fit_a_node_of_the_cluster():
    nodes = [{"Resources": {"CPU": 4.0}}, {"Resources": {"CPU": 16.0, "GPU": 2.0}}]
    ray_cluster.check_fits(16, 1, nodes)
    with pytest.raises(ConfigError, match=r"simulation.client_cpus=32: the Ray cluster's largest node has 16 CPU"):
        ray_cluster.check_fits(32, 0, nodes)
    with pytest.raises(ConfigError, match=r"simulation.client_gpus=3: the Ray cluster's largest node has 2 GPU"):
        ray_cluster.check_fits(1, 3, nodes)


def _report(tmp_path: Path, **changes) -> dict:
    probe = tmp_path / "probe"
    probe.write_text("probe\n")
    report = ray_cluster.node_report("quickstart", [], str(probe))
    return dict(report, name="node 10.0.0.2 (Ray node abcd1234)", **changes)


def test_the_start_up_check_names_the_node_and_what_it_lacks(tmp_path):
    probe = tmp_path / "probe"
    ray_cluster._judge([_report(tmp_path)], tmp_path, probe)  # this machine as a node: nothing to say
    cases = [({"app": "0" * 40}, "runs other flrep source"),
             ({"has_data": False, "data": "/data/mnist"}, "has no dataset at /data/mnist"),
             ({"sees_probe": False}, f"does not share {tmp_path}")]
    for changes, message in cases:
        with pytest.raises(ConfigError, match="node 10.0.0.2 .*" + message):
            ray_cluster._judge([_report(tmp_path, **changes)], tmp_path, probe)


def test_a_multi_node_ray_without_the_key_is_refused(monkeypatch):
    nodes = [{"Alive": True}, {"Alive": True}, {"Alive": False}]
    fake = types.SimpleNamespace(is_initialized=lambda: True, nodes=lambda: nodes)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    with pytest.raises(ConfigError, match="runs on a Ray cluster of 2 nodes; set simulation.ray_address"):
        ray_cluster.refuse_unnamed_cluster(None)
    ray_cluster.refuse_unnamed_cluster("auto")
    nodes[1]["Alive"] = False
    ray_cluster.refuse_unnamed_cluster(None)
