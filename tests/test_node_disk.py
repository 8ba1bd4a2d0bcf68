"""Nodes own their disks: a deployed node writes only under its own ``state-dir`` (or its
user's default), never to a path from the server (the handshake's ``checkpoint-dir``, the run
config's ``client_state.dir``); only ``flrep run``'s simulated nodes share the server's disk."""

import json
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict

from flower_app.app.client_checkpoint import snapshot_mod
from flower_app.run.config import load_config
from flower_app.app.server_app import Experiment
from strategies.common import CONFIG
from strategies.state_store import SIMULATION_ENV
from tests.local_grid import LocalGrid


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _run(tmp_path: Path, state_dirs: bool) -> Path:
    out, chosen = tmp_path / "out", tmp_path / "server-chosen"
    overrides = (f"wandb.enabled=false compare=[] data.num_clients=4 train.fraction=1.0 rounds=2 eval.final_window=1 "
                 f"algorithm=fedrep client_state.dir={chosen} client_state.disk_above_bytes=0 out_dir={out}")
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    if state_dirs:
        for pid, node in enumerate(grid.node_ids):
            grid.contexts[node].node_config["state-dir"] = str(tmp_path / f"node-{pid}")
    Experiment(grid, load_config("quickstart", overrides.split())).run()
    return out


def test_a_deployed_node_never_writes_where_the_server_says(tmp_path, monkeypatch):
    monkeypatch.delenv(SIMULATION_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = _run(tmp_path, state_dirs=False)
    assert files(out / "checkpoint" / "clients") == []  # the handshake's checkpoint-dir
    assert files(tmp_path / "server-chosen") == []  # the run config's client_state.dir
    own = tmp_path / "home" / ".cache" / "flrep" / "node-state"
    assert any(f.endswith(".pt") and "checkpoints" in f for f in files(own))  # snapshots
    assert any(f.startswith("run") for f in files(own))  # kept heads (disk_above_bytes=0)


def test_a_node_with_a_state_dir_writes_only_there(tmp_path, monkeypatch):
    monkeypatch.delenv(SIMULATION_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = _run(tmp_path, state_dirs=True)
    assert files(out / "checkpoint" / "clients") == [] and files(tmp_path / "server-chosen") == []
    assert files(tmp_path / "home") == []
    for pid in range(4):
        assert any("checkpoints" in f for f in files(tmp_path / f"node-{pid}"))


def test_simulated_nodes_share_the_servers_disk(tmp_path):
    out = _run(tmp_path, state_dirs=False)
    assert files(out / "checkpoint" / "clients") and files(tmp_path / "server-chosen")


def test_a_run_name_from_the_server_cannot_walk_the_nodes_disk(tmp_path, monkeypatch):
    monkeypatch.delenv(SIMULATION_ENV)
    node = tmp_path / "node"
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1, "state-dir": str(node)},
                      state=RecordDict(), run_config={"experiment": "quickstart", "overrides": "compare=[]"})
    handshake = ConfigRecord({"variant": "fedrep", "checkpoint-dir": str(tmp_path / "elsewhere"),
                              "checkpoint-key": "../../escaped", "restore-round": -1})
    msg = Message(RecordDict({CONFIG: handshake}), dst_node_id=7, message_type="query.info")
    snapshot_mod(msg, context, lambda m, c: Message(RecordDict(), reply_to=m))
    where = Path(str(context.state["flrep-checkpoint"]["dir"]))
    assert where.is_dir() and node.resolve() in where.resolve().parents
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "escaped").exists()


def test_a_deployed_node_keeps_its_data_caches_on_its_own_disk(tmp_path, monkeypatch):
    from flower_app.app.client_app import runtime_for

    monkeypatch.delenv(SIMULATION_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    overrides = f"compare=[] data.num_clients=4 data.cache_dir={tmp_path / 'server-cache'}"
    for node_config, expected in (({}, tmp_path / "home" / ".cache" / "flrep"),
                                  ({"state-dir": str(tmp_path / "node")}, tmp_path / "node" / "cache")):
        context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 4, **node_config},
                          state=RecordDict(), run_config={"experiment": "quickstart", "overrides": overrides})
        rt = runtime_for(context)
        assert Path(rt.cfg.data.cache_dir) == expected
        assert files(expected)  # its partitions were cached there
    assert not (tmp_path / "server-cache").exists()


def test_only_messages_that_change_the_clients_state_are_snapshotted(tmp_path):
    """FedRep with 4 clients, 1 trained per round: every round all 4 evaluate (a never-sampled
    client fits a head it does not keep), but only the trained client's state changes."""
    out = tmp_path / "out"
    overrides = (f"wandb.enabled=false compare=[] data.num_clients=4 train.fraction=0.25 rounds=2 eval.final_window=1 "
                 f"algorithm=fedrep out_dir={out}")
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    trained = {p for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
               if r["phase"] == "train" for p in r["clients"]}
    snapshotted = {int(p.name[len("client"):]) for p in (out / "checkpoint" / "clients").iterdir()
                   if any(p.glob("round*.pt"))}
    assert snapshotted == trained and len(trained) < 4
    assert summary["timings"]["clients: evaluate compute_s"]["calls"] == 8
    assert "clients: evaluate snapshot_s" not in summary["timings"]
