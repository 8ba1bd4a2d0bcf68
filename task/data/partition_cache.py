"""One client's partition on its own, cached on its node's disk.

A deployed SuperNode starts a fresh ClientApp process for every message. Without this cache each
of them would load the whole dataset and partition it again (for the quickstart: importing
scikit-learn and the Hugging Face ``datasets`` library, seconds per message). The first message
of a node builds the federation once and writes that node's client; later processes read only
that file. The file is keyed by the data config, the run seed and the size and modification time
of ``data.root``, so a changed config or data directory builds a new one.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from task.data.datasets.bundle import ArrayData, DataBundle
from task.data.datasets.config import cfg_get
from task.data.datasets.images import ImageArray
from task.data.federated_data import FederatedData, _canonical, build_federated_data
from task.errors import ConfigError

FORMAT = 2  # 2: a one-client federation carries its validation part


def take(split: ArrayData, idx: np.ndarray) -> ArrayData:
    """The samples ``idx`` of ``split``; uint8 images stay uint8 (with the split's normalisation)."""
    x = ImageArray(split.x.raw[idx], split.x.mean, split.x.std) if isinstance(split.x, ImageArray) else split.x[idx]
    group = None if split.group is None else split.group[idx]
    attributes = None if split.attributes is None else {k: v[idx] for k, v in split.attributes.items()}
    return ArrayData(x, split.y[idx], group, attributes)


def one_client(fed: FederatedData, pid: int) -> FederatedData:
    """Client ``pid`` of ``fed`` as a federation of one client holding exactly its samples (its
    training part, then its validation part when ``fed`` has a validation split)."""
    bundle = fed.bundle
    train = fed.client_train[pid]
    held = fed.client_validation[pid] if fed.validating else train[:0]
    own = DataBundle(take(bundle.train, np.concatenate([train, held]) if fed.validating else train),
                     take(bundle.test, fed.client_test[pid]), bundle.num_classes, bundle.input_shape, bundle.task,
                     bundle.meta)
    validation = [np.arange(len(train), len(train) + len(held))] if fed.validating else []
    return FederatedData(own, [np.arange(len(train))], [np.arange(len(own.test))],
                         global_test=np.arange(0), new_clients=[], client_validation=validation)


def _source_stamp(data_cfg: Mapping) -> list:
    root = cfg_get(data_cfg, "root")
    if not root:
        return []
    path = Path(os.path.expanduser(str(root)))
    if not path.exists():
        return [str(path)]
    st = path.stat()
    stamps = [str(path.resolve()), st.st_size, st.st_mtime_ns]
    if path.is_dir():
        stamps += sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in path.iterdir())
    return stamps


def check_partition_id(pid: int, num_clients: int) -> None:
    """A node's ``partition-id`` names one of the federation's clients (else a ConfigError)."""
    if not 0 <= pid < num_clients:
        raise ConfigError(f"node config: partition-id {pid} is outside the {num_clients} clients of data.num_clients")


def cache_file(data_cfg: Mapping, seed: int, pid: int, cache_dir: Path) -> Path:
    """Where client ``pid``'s partition of this data config and seed is kept."""
    key = hashlib.sha256(repr((FORMAT, _canonical(data_cfg, seed), _source_stamp(data_cfg))).encode()).hexdigest()
    return cache_dir / "partitions" / key[:32] / f"client{pid}.pkl"


def client_data(data_cfg: Mapping, seed: int, pid: int, cache_dir: Path) -> FederatedData:
    """Client ``pid``'s partition of ``build_federated_data(data_cfg, seed)`` as a one-client
    federation: read from ``cache_dir`` when cached, else built (and cached for the next process)."""
    path = cache_file(data_cfg, seed, pid, cache_dir)
    try:
        with open(path, "rb") as fh:
            return pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError):
        pass  # not cached yet (or unreadable): build it
    fed = build_federated_data(data_cfg, seed)
    check_partition_id(pid, fed.num_clients)
    own = one_client(fed, pid)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(own, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs the next process the full build
    return own
