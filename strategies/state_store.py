"""Per-client arrays that outlive one message: small ones in ``context.state``, large ones
on the node's disk (only their path goes into the state), so big local models are not
pickled through the simulation every round.

Files live under ``client_state.dir`` (default ``<data.cache_dir>/client-state``) in one
folder per run and node; ``client_state.disk_above_bytes`` is the size from which arrays go
to disk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord

from strategies.common import ClientRuntime


def state_root(cfg) -> Path:
    """``client_state.dir``, or ``<data.cache_dir>/client-state``."""
    return Path(str(cfg.client_state.dir or Path(str(cfg.data.cache_dir)).expanduser() / "client-state")).expanduser()


def node_file(rt: ClientRuntime, name: str, suffix: str = ".pt") -> Path:
    """This run variant's file ``name`` in the node's state directory (one folder per run and node)."""
    safe = rt.state_key(name).replace("/", "__")
    return state_root(rt.cfg) / f"run{rt.run_id}-node{rt.node_id}" / f"{safe}{suffix}"


def keep_arrays(rt: ClientRuntime, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Keep ``tensors`` for this client under ``name`` (memory or disk by size)."""
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    key = rt.state_key(name)
    if size <= int(rt.cfg.client_state.disk_above_bytes):
        rt.state[key] = ArrayRecord({k: t.detach().cpu() for k, t in tensors.items()})
        return
    path = node_file(rt, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: t.detach().cpu() for k, t in tensors.items()}, tmp)
    tmp.replace(path)
    rt.state[key] = ConfigRecord({"path": str(path)})


def kept_arrays(rt: ClientRuntime, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors kept under ``name``, or None if this client has none."""
    key = rt.state_key(name)
    if key not in rt.state:
        return None
    record = rt.state[key]
    if isinstance(record, ArrayRecord):
        return record.to_torch_state_dict()
    return torch.load(str(record["path"]), weights_only=True)
