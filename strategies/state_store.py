"""Per-client arrays that outlive one message: small ones in ``context.state``, large ones
on the node's disk (only their path goes into the state), so big local models are not
pickled through the simulation every round.

Files live in one folder per run and client (partition id, not node id: a restarted
SuperNode gets a new node id but serves the same client) under the node config's
``state-dir`` when the SuperNode has one; in ``flrep run``'s simulation (whose nodes share the
server's disk) under ``client_state.dir`` (default ``<data.cache_dir>/client-state``); on any
other node under its user's ``~/.cache/flrep/node-state``: a node never writes where the
server's configuration says. A node with a ``state-dir`` keeps all its state on
disk, so a restarted SuperNode of the same run finds it again;
``client_state.disk_above_bytes`` is otherwise the size from which arrays go to disk.
"""

from __future__ import annotations

import os
import sys
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log

from strategies.common import ClientRuntime
from task.files import save_torch_atomic


#: Set (to 1) by ``flrep run`` for the nodes of its simulation, which share the server's disk.
SIMULATION_ENV = "FLREP_SIMULATION"
#: Where a deployed node without a ``state-dir`` keeps its data caches and its state: its user's cache.
NODE_CACHE = Path("~/.cache/flrep")
NODE_DEFAULT = NODE_CACHE / "node-state"


def in_simulation() -> bool:
    """Whether this process serves simulated nodes of ``flrep run`` (see :data:`SIMULATION_ENV`)."""
    return os.environ.get(SIMULATION_ENV) == "1"


def on_cluster(cfg) -> bool:
    """Whether this process serves simulated nodes on a Ray cluster (``simulation.ray_address``): then
    every array a client keeps stays in ``context.state``, which the engine carries to whichever node
    serves the client next; only files (TCT's features) go to :func:`state_root`."""
    if not cfg.simulation.ray_address:
        return False
    ray = sys.modules.get("ray")  # flwr run's simulated nodes: Ray workers without flrep's mark
    return in_simulation() or (ray is not None and ray.is_initialized())


def state_root(cfg) -> Path:
    """The run config's folder for state files: ``client_state.dir``; else on a Ray cluster
    ``<run folder>/client-state`` (a folder every node shares, checked at start), elsewhere
    ``<data.cache_dir>/client-state`` (the server's files; simulated nodes', which share the server's disk)."""
    if cfg.client_state.dir:
        return Path(str(cfg.client_state.dir)).expanduser()
    run_folder = cfg.resume or cfg.out_dir
    if cfg.simulation.ray_address and run_folder:
        return Path(str(run_folder)).expanduser() / "client-state"
    return Path(str(cfg.data.cache_dir)).expanduser() / "client-state"


def node_home(node_state_dir: str | None) -> Path:
    """A node's own folder: its ``state-dir``, else its user's default (:data:`NODE_DEFAULT`)."""
    return Path(node_state_dir).expanduser() if node_state_dir else NODE_DEFAULT.expanduser()


def node_root(cfg, node_state_dir: str | None) -> Path:
    """Where a node writes: :func:`node_home`, except for ``flrep run``'s simulated nodes without a
    ``state-dir`` (:func:`state_root`). A deployed node never writes to a path the server chose."""
    return state_root(cfg) if in_simulation() and not node_state_dir else node_home(node_state_dir)


def safe_name(text: str) -> str:
    """``text`` as one harmless path component (a name from the server must not walk the node's disk)."""
    name = "".join(c if c.isalnum() or c in "-_.+" else "_" for c in str(text)).lstrip(".")
    return name or "run"


def node_file(rt: ClientRuntime, name: str, suffix: str = ".pt") -> Path:
    """This run variant's file ``name`` in the client's state directory (one folder per run and client)."""
    safe = safe_name(rt.state_key(name).replace("/", "__"))
    return node_root(rt.cfg, rt.state_dir) / f"run{rt.run_id}-client{rt.partition_id}" / f"{safe}{suffix}"


def keep_arrays(rt: ClientRuntime, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Keep ``tensors`` for this client under ``name`` (memory or disk by size)."""
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    key = rt.state_key(name)
    if rt.state_dir is None and (size <= int(rt.cfg.client_state.disk_above_bytes) or on_cluster(rt.cfg)):
        rt.state[key] = ArrayRecord({k: t.detach().cpu() for k, t in tensors.items()})
        return
    path = node_file(rt, name)
    save_torch_atomic({k: t.detach().cpu() for k, t in tensors.items()}, path)
    rt.state[key] = ConfigRecord({"path": str(path)})


def kept_arrays(rt: ClientRuntime, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors kept under ``name``, or None if this client has none. On a node with a
    ``state-dir``, a client whose ``context.state`` is empty (its SuperNode restarted) finds
    its files again."""
    key = rt.state_key(name)
    if key not in rt.state:
        path = node_file(rt, name)
        if rt.state_dir is None or not path.is_file():
            return None
        log(INFO, "client %d: %s found on disk after a restart (%s)", rt.partition_id, name, path)
        rt.state[key] = ConfigRecord({"path": str(path)})
    record = rt.state[key]
    if isinstance(record, ArrayRecord):
        return record.to_torch_state_dict()
    return torch.load(str(record["path"]), weights_only=True)


#: Where a client's kept model starts before its first update: the run's common initial weights, or
#: the global model it receives then (the official FedRep scripts, whose ``w_locals`` alias the global
#: model's tensors until a client's first update).
PERSONAL_STARTS = ("initial", "received")


def load_kept_model(rt: ClientRuntime, name: str, fallback: dict[str, torch.Tensor] | None = None) -> bool:
    """Put the whole model kept under ``name`` into ``rt.model``; a client with none yet gets
    ``fallback``, or the run's common initial weights. True if kept."""
    own = kept_arrays(rt, name)
    if own is None:
        if fallback is None:
            rt.reset_model()
        else:
            rt.model.load_state_dict(fallback)
        return False
    rt.model.load_state_dict(own)
    return True
