"""Per-client arrays that outlive one message: small ones in ``context.state``, large ones
on the node's disk (only their path goes into the state), so big local models are not
pickled through the simulation every round.

Files live in one folder per run and client (partition id, not node id: a restarted
SuperNode gets a new node id but serves the same client) under the node config's
``state-dir`` when the SuperNode has one; in ``flrep run``'s simulation (whose nodes share the
server's disk) under ``client_state.dir`` (default ``<run folder>/client-state``, removed when
the run completes); on any other node under its user's ``~/.cache/flrep/node-state`` (``flrep
state`` lists and removes what finished runs left there): a node never writes where the
server's configuration says. A node with a ``state-dir`` keeps all its state on
disk, so a restarted SuperNode of the same run finds it again;
``client_state.disk_above_bytes`` is otherwise the size from which arrays go to disk.
"""

from __future__ import annotations

import json
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


#: The folder of a run's client state inside its run folder (removed when the run completes).
RUN_STATE = "client-state"


def state_root(cfg) -> Path:
    """The run config's folder for state files (the server's, and those of simulated nodes, which
    share the server's disk): ``client_state.dir``; else ``<run folder>/client-state`` (on a Ray
    cluster a folder every node shares, checked at start); without a run folder (``flwr run .``
    without ``out_dir``) ``<data.cache_dir>/client-state``."""
    if cfg.client_state.dir:
        return Path(str(cfg.client_state.dir)).expanduser()
    run_folder = cfg.resume or cfg.out_dir
    if run_folder:
        return Path(str(run_folder)).expanduser() / RUN_STATE
    return Path(str(cfg.data.cache_dir)).expanduser() / RUN_STATE


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


#: The file in each folder of kept state that names the run folder it belongs to (``flrep state``).
OWNER_FILE = "owner.json"


def mark_owner(folder: Path, cfg) -> None:
    """Name, once, the run folder (the server's ``out_dir``; null when it chose a default) that the
    state in ``folder`` belongs to, so ``flrep state`` can tell when that run is finished or gone."""
    owner = folder / OWNER_FILE
    if owner.is_file():
        return
    run_folder = cfg.resume or cfg.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    owner.write_text(json.dumps({"run_folder": str(Path(str(run_folder)).expanduser()) if run_folder else None,
                                 "experiment": str(cfg.experiment)}) + "\n")


def keep_arrays(rt: ClientRuntime, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Keep ``tensors`` for this client under ``name`` (memory or disk by size)."""
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    key = rt.state_key(name)
    if rt.state_dir is None and (size <= int(rt.cfg.client_state.disk_above_bytes) or on_cluster(rt.cfg)):
        rt.state[key] = ArrayRecord({k: t.detach().cpu() for k, t in tensors.items()})
        return
    path = node_file(rt, name)
    mark_owner(path.parent, rt.cfg)
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
