"""Flower's simulation engine on a Ray cluster that is already running (``simulation.ray_address``).

``flrep run`` joins the cluster instead of starting a Ray of its own; Flower's backend then spreads
the ClientApps over every node. Before the first round each alive node is asked, by a small Ray
task pinned to it, whether it runs the same flrep source, holds the run's dataset where the run
config resolves it, and sees the run folder's parent as this machine writes it (the clients'
snapshots for a resume go there). A node that fails one of these is named in a ConfigError, and
nothing is left on disk.

Client state needs no shared disk: on a cluster every client keeps its state in
``context.state`` (see :func:`strategies.state_store.keep_arrays`), which the engine carries
with each message to whichever node serves the client next.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import uuid
from pathlib import Path

from strategies.state_store import SIMULATION_ENV
from task.errors import ConfigError

#: The packages whose source every node must share with this machine.
APP_PACKAGES = ("flower_app", "strategies", "protocols", "task")
#: Seconds a node may take to answer the start-up check.
CHECK_TIMEOUT_S = 120.0


def worker_env() -> dict[str, str]:
    """Environment the cluster's workers get from this run: this process's import path and every
    ``FLREP_*`` variable (the simulated nodes' mark, the data home), which remote nodes do not inherit."""
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": pythonpath, **{k: v for k, v in os.environ.items() if k.startswith("FLREP_")}}


def join(address: str, init_args: dict[str, object]) -> None:
    """Connect this process to the Ray cluster at ``address`` (once); a ConfigError if none answers."""
    import ray

    if ray.is_initialized():
        return
    env = dict(worker_env(), **{SIMULATION_ENV: "1"})  # every worker serves simulated nodes
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, **init_args)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ConfigError(f"simulation.ray_address={address!r}: no Ray cluster answers there ({err}); start one "
                          "with `ray start --head` (docs/running.md, \"From one machine to a cluster\")") from None


def alive_nodes() -> list[dict]:
    """The cluster's alive nodes as ``ray.nodes()`` lists them."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def refuse_unnamed_cluster(ray_address: str | None) -> None:
    """A simulation whose Ray (started by ``flwr run .`` with ``RAY_ADDRESS`` set, say) spans several
    nodes although ``simulation.ray_address`` is unset: a ConfigError, since its clients would keep
    state on whichever node served them last."""
    ray = sys.modules.get("ray")
    if ray_address or ray is None or not ray.is_initialized():
        return
    nodes = alive_nodes()
    if len(nodes) > 1:
        raise ConfigError(f"simulation.ray_address: this simulation runs on a Ray cluster of {len(nodes)} nodes; set "
                          "simulation.ray_address (e.g. auto) so that every client's state travels with its messages")


def node_name(node: dict) -> str:
    """A node in words: its address and the start of its Ray node id."""
    return f"node {node.get('NodeManagerAddress')} (Ray node {str(node.get('NodeID'))[:8]})"


def check_fits(client_cpus: float, client_gpus: float, nodes: list[dict]) -> None:
    """A ClientApp's ``client_cpus``/``client_gpus`` fit on at least one node (else Ray's actor pool
    stays empty and the run would wait forever): a ConfigError naming the key and the largest node."""
    for key, need, resource in (("client_cpus", client_cpus, "CPU"), ("client_gpus", client_gpus, "GPU")):
        largest = max((float(n.get("Resources", {}).get(resource, 0)) for n in nodes), default=0.0)
        if need > largest:
            raise ConfigError(f"simulation.{key}={need:g}: the Ray cluster's largest node has {largest:g} {resource}(s); "
                              f"a ClientApp can ask for at most {largest:g}")


def app_fingerprint() -> str:
    """A hash of this flrep's Python source (what a node must share to serve the run)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha1()
    for package in APP_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def node_report(experiment: str, overrides: list[str], probe: str) -> dict:
    """What the start-up check asks a node (run there): host, flrep source, whether the run's data
    is where a client on this node resolves it (the run config loaded here, as a ClientApp loads it),
    and whether it reads ``probe`` (written by the machine that starts the run) and can write beside it."""
    from flower_app.run.config import load_config

    cfg = load_config(experiment, overrides)
    root = Path(str(cfg.data.root)) if cfg.data.source == "local" and cfg.data.root else None
    probe_path = Path(probe)
    seen = probe_path.is_file()
    mine = probe_path.with_name(f"{probe_path.name}-{uuid.uuid4().hex[:8]}")
    try:
        mine.write_text("seen\n")
        written = str(mine)
    except OSError as err:
        written = f"error: {err}"
    return {"host": socket.gethostname(), "app": app_fingerprint(), "data": None if root is None else str(root),
            "has_data": root is None or root.exists(), "sees_probe": seen, "wrote": written}


def check_nodes(experiment: str, overrides: list[str], run_folder: Path) -> list[dict]:
    """Ask every alive node about the run ``experiment`` with ``overrides`` (see :func:`node_report`);
    a ConfigError naming the first node that lacks the data, runs other flrep source, or does not
    share the folder the run folder is made in. Removes its probe files. The reports, one per node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    parent = next(p for p in run_folder.parents if p.is_dir())  # the run folder may not exist yet
    probe = parent / f".flrep-cluster-probe-{uuid.uuid4().hex[:12]}"
    probe.write_text("probe\n")
    nodes = alive_nodes()
    remote = ray.remote(num_cpus=0)(node_report)
    try:
        pending = {node["NodeID"]: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
                   .remote(experiment, list(overrides), str(probe)) for node in nodes}
        reports = []
        for node in nodes:
            try:
                reports.append(dict(ray.get(pending[node["NodeID"]], timeout=CHECK_TIMEOUT_S), name=node_name(node)))
            except Exception as err:  # noqa: BLE001 - a node that cannot even run the check: name it
                raise ConfigError(f"simulation.ray_address: {node_name(node)} cannot run flrep "
                                  f"({type(err).__name__}: {str(err).splitlines()[0][:300]}); install the same flrep "
                                  "at the same path (or in the same environment) on every node") from None
        _judge(reports, parent, probe)
        return reports
    finally:
        for leftover in parent.glob(f"{probe.name}*"):
            leftover.unlink(missing_ok=True)


def _judge(reports: list[dict], parent: Path, probe: Path) -> None:
    """The first problem of any node as a ConfigError."""
    ours = app_fingerprint()
    for r in reports:
        if r["app"] != ours:
            raise ConfigError(f"simulation.ray_address: {r['name']}, host {r['host']}, runs other flrep source than this "
                              "machine; install the same commit on every node")
        if not r["has_data"]:
            raise ConfigError(f"data.root: {r['name']}, host {r['host']}, has no dataset at {r['data']}; every node "
                              "resolves data.root the same way (the data home $FLREP_DATA or an absolute path): "
                              "put the data there on every node")
        shared = r["sees_probe"] and not r["wrote"].startswith("error") and Path(r["wrote"]).is_file()
        if not shared:
            raise ConfigError(f"simulation.ray_address: {r['name']}, host {r['host']}, does not share {parent} with this "
                              "machine (the run folder, where clients keep their snapshots for a resume, must be on a "
                              "disk every node mounts at the same path)")
