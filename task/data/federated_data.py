"""The federated view of a dataset: which train/test samples belong to which client.

``build_federated_data(data_cfg, seed)`` loads the source (:func:`task.data.sources.load_source`),
partitions the train split (:func:`task.data.partition.partition_train`) and gives each client a
local test set, then returns a :class:`FederatedData`. The result is a pure function of
``(data_cfg, seed)``, so every algorithm run with the same config and seed sees the same
clients.

Config keys (under ``data.``; the source and partition keys are documented in
:mod:`task.data.sources` and :mod:`task.data.partition`):

``num_clients``
    Int >= 1, default 100. Partition ids are ``0 .. num_clients-1``.
``num_new_clients``
    Int in ``[0, num_clients)``, default 0: the last ``num_new_clients`` partition ids are
    "new clients", never sampled for training (``FederatedData.new_clients``).
``new_client_classes``
    Null (default: new clients are ordinary partitions held out from training) or a list of
    labels reserved for the new clients (the FedRep Figure 6 protocol: train on some classes,
    adapt new clients to others). The training clients are then partitioned (with the
    configured scheme) from the samples of the other labels only, the global test set keeps
    only those labels, and each new client draws ``new_client_classes_per_client`` (5) of the
    reserved labels and ``new_client_train_size`` (500) train / ``new_client_test_size`` (100)
    test samples uniformly from them (independently per new client, so new clients may share
    samples).
``online_device``
    ``{enabled, train_size, test_size, quarter_turns}`` (default disabled): LG-FedAvg Table 3's
    device that joins after training. When enabled the last partition id is that device:
    ``train_size`` (3000) train and ``test_size`` (500) test images drawn at random (seeded)
    from the whole train / test sets and rotated by ``quarter_turns`` × 90°
    (:func:`rotated_device`); the other ``num_clients - 1`` partitions split the data as
    configured. ``FederatedData.online_device`` is its id.
``validation_fraction``
    Float in ``[0, 1)``, default 0: the share of each client's training samples held out as its
    validation part (:mod:`task.data.validation`; ``FederatedData.client_validation``), after the
    partition: ``client_train`` is then the part the client trains on. 0 changes nothing.
``test_per_client``
    Null (default) or int >= 1: local test-set size per client. Null means proportional,
    ``round(len(test) / len(train) * len(train_i))``. Local test sets have the client's
    train label distribution (:func:`task.data.partition.matched_test_split`); for ``natural``
    partitions of data with per-group test samples (femnist, synthetic_linear) each client
    instead gets all test samples of its own group, and ``test_per_client`` is ignored; so it is
    for ``class_shards``, whose clients get test shards of their train shards' classes
    (:func:`task.data.class_shards.class_shard_test_split`).

Caching: results are memoised in-process (keyed by the canonical JSON of the config and
the seed) and the partition index arrays are stored on disk as
``<cache_dir>/partitions/<sha256>.npz`` keyed by a content hash of the config, the seed and
a fingerprint of the train/test labels and groups, so a second process only has to load
the source arrays.

For ``synthetic_linear`` the ``natural`` partition reproduces
:func:`task.data.synthetic.make_linear_tasks`'s per-client tasks exactly (client ``i`` = task ``i``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from task.data.datasets.bundle import ArrayData
from task.data.datasets.images import ImageArray
from task.errors import ConfigError
from task.data.class_shards import class_shard_test_split
from task.data.validation import split_clients, validation_fraction
from task.data.partition import (
    group_test_split,
    matched_test_split,
    partition_scheme,
    partition_train,
)
from task.data.sources import (
    DataBundle,
    cache_dir_from_cfg,
    get_int,
    load_npz,
    load_source,
    save_npz_atomic,
    to_plain,
)

DEFAULT_NUM_CLIENTS = 100
_PARTITION_CACHE_VERSION = 1


@dataclass
class FederatedData:
    """Per-client index arrays into a shared :class:`DataBundle` (treat as read-only)."""

    bundle: DataBundle
    client_train: list[np.ndarray]
    client_test: list[np.ndarray]
    global_test: np.ndarray
    new_clients: list[int]
    online_device: int | None = None
    client_validation: list[np.ndarray] = dataclasses.field(default_factory=list)  # empty: no validation split

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    @property
    def validating(self) -> bool:
        """Whether the clients hold out a validation part of their training data."""
        return bool(self.client_validation)


def label_counts(fed: FederatedData) -> np.ndarray | None:
    """(clients, classes) int64: how many training samples of each label every client holds (row
    sums are the clients' training-set sizes); None for regression data, which has no classes."""
    if fed.bundle.task == "regression":
        return None
    labels = np.asarray(fed.bundle.train.y)
    classes = int(fed.bundle.num_classes)
    counts = np.zeros((fed.num_clients, classes), dtype=np.int64)
    for pid, idx in enumerate(fed.client_train):
        counts[pid] = np.bincount(labels[idx].astype(np.int64), minlength=classes)
    return counts


def _canonical(data_cfg: Mapping, seed: int) -> str:
    if not isinstance(data_cfg, Mapping):
        raise ConfigError(f"data: expected a mapping of data options, got {type(data_cfg).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or int(seed) < 0:
        raise ConfigError(f"seed={seed!r} is invalid: expected an integer >= 0")
    try:
        return json.dumps({"data": to_plain(data_cfg), "seed": int(seed)}, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"data: config values must be plain scalars, lists or mappings ({exc})") from exc


def build_federated_data(data_cfg: Mapping, seed: int) -> FederatedData:
    """Load, partition and split the dataset of ``data_cfg`` for run seed ``seed``."""
    return _build_cached(_canonical(data_cfg, seed))


def clear_caches() -> None:
    """Drop the in-process caches (the on-disk caches stay)."""
    _build_cached.cache_clear()
    _load_source_cached.cache_clear()


def source_key(data_cfg: Mapping) -> str:
    """Canonical JSON of the config keys that determine the loaded arrays."""
    plain = to_plain(data_cfg)
    ignore = {"partition", "classes_per_client", "class_assignment_mode", "dirichlet_alpha", "min_partition_size",
              "dirichlet_self_balancing", "shards_per_client", "shard_size", "num_new_clients", "test_per_client",
              "new_client_classes", "new_client_classes_per_client", "new_client_train_size", "new_client_test_size",
              "online_device", "validation_fraction"}
    if plain.get("name") not in ("synthetic_linear", "synthetic_quadratic"):
        ignore.add("num_clients")
    return json.dumps({k: v for k, v in plain.items() if k not in ignore}, sort_keys=True)


@functools.lru_cache(maxsize=4)
def _load_source_cached(key: str) -> DataBundle:
    data_cfg = json.loads(key)
    bundle = load_source(data_cfg)
    root = data_cfg.get("root")
    check_finite(bundle, f"data.name={data_cfg.get('name')}" + (f" in data.root={root}" if root else ""))
    return bundle


def check_finite(bundle: DataBundle, where: str) -> None:
    """Every float input and target of ``bundle`` is finite (one NaN makes every reply rejected);
    checked once per loaded source, in chunks so a large split is never copied."""
    for name, split in (("train", bundle.train), ("test", bundle.test)):
        for what, values in (("inputs", split.x), ("targets", split.y)):
            if isinstance(values, ImageArray):
                continue  # uint8 pixels are finite
            values = np.asarray(values)
            if not np.issubdtype(values.dtype, np.floating):
                continue
            for start in range(0, len(values), 4096):
                ok = np.isfinite(values[start:start + 4096].reshape(-1, values[0].size)).all(axis=1)
                if not ok.all():
                    raise ConfigError(f"{where}: the {name} split's {what} hold NaN or Inf, first at sample "
                                      f"{start + int(np.argmin(ok))}; fix or drop them in the data files")


def _labels_fingerprint(bundle: DataBundle) -> str:
    h = hashlib.sha256()
    for arr in (bundle.train.y, bundle.test.y, bundle.train.group, bundle.test.group):
        if arr is None:
            h.update(b"none")
        else:
            a = np.ascontiguousarray(arr)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def _new_client_classes(data_cfg: Mapping, bundle: DataBundle, num_new: int) -> np.ndarray | None:
    """The validated ``data.new_client_classes`` (None when unset)."""
    classes = data_cfg.get("new_client_classes")
    if classes is None:
        return None
    labels = set(np.unique(bundle.train.y).tolist())
    ok = isinstance(classes, (list, tuple)) and classes and all(isinstance(c, int) and c in labels for c in classes)
    if not ok or len(set(classes)) >= len(labels):
        raise ConfigError(
            f"data.new_client_classes={classes!r} is invalid: expected a list of distinct labels from "
            f"{sorted(labels)} that leaves at least one label for the training clients"
        )
    if num_new < 1:
        raise ConfigError("data.new_client_classes needs data.num_new_clients >= 1")
    if bundle.task == "regression":
        raise ConfigError("data.new_client_classes is for classification datasets")
    return np.asarray(sorted(set(classes)), dtype=np.int64)


def _split(bundle: DataBundle, train_keep: np.ndarray, test_keep: np.ndarray, data_cfg: Mapping, scheme: str,
           num_clients: int, per_client: int | None, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Partition the kept train samples into clients and give each a matched local test set."""
    train_groups = bundle.train.group[train_keep] if bundle.train.group is not None else None
    test_groups = bundle.test.group[test_keep] if bundle.test.group is not None else None
    natural_test = scheme == "natural" and train_groups is not None and test_groups is not None
    if bundle.task == "regression" and not natural_test:
        raise ConfigError(
            f"data.partition={scheme!r} is not supported for the regression dataset "
            f"data.name={data_cfg.get('name')!r}: use data.partition=natural"
        )
    parts = partition_train(bundle.train.y[train_keep], train_groups, data_cfg, num_clients, seed)
    if natural_test:
        tests = group_test_split(parts, train_groups, test_groups)
    elif scheme == "class_shards":
        tests = class_shard_test_split(bundle.train.y[train_keep], bundle.test.y[test_keep], data_cfg, num_clients, seed)
    else:
        tests = matched_test_split(parts, bundle.train.y[train_keep], bundle.test.y[test_keep], per_client, seed)
    return [train_keep[p] for p in parts], [test_keep[t] for t in tests]


def new_client_split(train_labels: np.ndarray, test_labels: np.ndarray, classes: np.ndarray, num_new: int,
                     classes_per_client: int, train_size: int, test_size: int, seed: int
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each new client: ``classes_per_client`` of ``classes`` and samples drawn uniformly from them."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x4E11]))
    train_out, test_out = [], []
    for _ in range(num_new):
        own = rng.choice(classes, size=classes_per_client, replace=False)
        for labels, size, out in ((train_labels, train_size, train_out), (test_labels, test_size, test_out)):
            pool = np.flatnonzero(np.isin(labels, own))
            out.append(np.sort(rng.choice(pool, size=min(size, pool.size), replace=False)).astype(np.int64))
    return train_out, test_out


def _pack(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return flat, lengths


def _unpack(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(p, dtype=np.int64) for p in np.split(flat, np.cumsum(lengths)[:-1])]


@functools.lru_cache(maxsize=8)
def _build_cached(key: str) -> FederatedData:
    spec = json.loads(key)
    data_cfg, seed = spec["data"], spec["seed"]
    num_clients = get_int(data_cfg, "num_clients", DEFAULT_NUM_CLIENTS, lo=1)
    num_new = get_int(data_cfg, "num_new_clients", 0, lo=0)
    if num_new >= num_clients:
        raise ConfigError(
            f"data.num_new_clients={num_new} is invalid: expected an integer in [0, data.num_clients={num_clients})"
        )
    per_client = get_int(data_cfg, "test_per_client", None, lo=1)
    fraction = validation_fraction(data_cfg)
    scheme = partition_scheme(data_cfg)
    cache_dir = cache_dir_from_cfg(data_cfg)

    bundle = _load_source_cached(source_key(data_cfg))

    digest = hashlib.sha256(
        json.dumps(
            {"v": _PARTITION_CACHE_VERSION, "cfg": {k: v for k, v in data_cfg.items() if k != "validation_fraction"},
             "seed": seed, "labels": _labels_fingerprint(bundle)},
            sort_keys=True,
        ).encode()
    ).hexdigest()
    cache_file = cache_dir / "partitions" / f"{digest}.npz"
    cached = load_npz(cache_file)
    train_keep, test_keep = np.arange(len(bundle.train.y)), np.arange(len(bundle.test.y))
    new_classes = _new_client_classes(data_cfg, bundle, num_new)
    if new_classes is not None:
        train_keep = np.flatnonzero(~np.isin(bundle.train.y, new_classes))
        test_keep = np.flatnonzero(~np.isin(bundle.test.y, new_classes))
    if cached is not None and {"train_flat", "train_len", "test_flat", "test_len"} <= cached.keys():
        client_train = _unpack(cached["train_flat"], cached["train_len"])
        client_test = _unpack(cached["test_flat"], cached["test_len"])
    else:
        num_partitioned = num_clients if new_classes is None else num_clients - num_new
        num_partitioned -= 1 if (data_cfg.get("online_device") or {}).get("enabled", False) else 0
        client_train, client_test = _split(bundle, train_keep, test_keep, data_cfg, scheme, num_partitioned,
                                           per_client, seed)
        if new_classes is not None:
            new_train, new_test = new_client_split(
                bundle.train.y, bundle.test.y, new_classes, num_new,
                get_int(data_cfg, "new_client_classes_per_client", 5, lo=1, hi=len(new_classes)),
                get_int(data_cfg, "new_client_train_size", 500, lo=1),
                get_int(data_cfg, "new_client_test_size", 100, lo=1), seed)
            client_train, client_test = client_train + new_train, client_test + new_test
        tf, tl = _pack(client_train)
        sf, sl = _pack(client_test)
        save_npz_atomic(cache_file, train_flat=tf, train_len=tl, test_flat=sf, test_len=sl)

    online = data_cfg.get("online_device") or {}
    online_pid = None
    if online.get("enabled", False):
        bundle, train_idx, test_idx = rotated_device(bundle, int(online.get("train_size", 3000)),
                                                     int(online.get("test_size", 500)),
                                                     int(online.get("quarter_turns", 1)), seed)
        client_train, client_test = client_train + [train_idx], client_test + [test_idx]
        online_pid = len(client_train) - 1
    client_validation = []
    if fraction > 0:
        client_train, client_validation = split_clients(client_train, fraction, seed)
    return FederatedData(
        bundle=bundle,
        client_train=client_train,
        client_test=client_test,
        global_test=test_keep.astype(np.int64),
        new_clients=list(range(num_clients - num_new, num_clients)),
        online_device=online_pid,
        client_validation=client_validation,
    )


def rotated_device(bundle: DataBundle, train_size: int, test_size: int, quarter_turns: int, seed: int
                   ) -> tuple[DataBundle, np.ndarray, np.ndarray]:
    """LG-FedAvg Table 3's online device: ``train_size`` / ``test_size`` samples drawn at random
    (seeded) from the train / test sets, images rotated by ``quarter_turns`` × 90°. Returns a
    bundle with those rotated copies appended to its splits, and the device's indices."""
    if len(bundle.input_shape) != 3:
        raise ConfigError(f"data.online_device needs image data (C, H, W); data has inputs {tuple(bundle.input_shape)}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x0A11]))
    splits, indices = [], []
    for split, size, key in ((bundle.train, train_size, "train_size"), (bundle.test, test_size, "test_size")):
        if not 1 <= size <= len(split):
            raise ConfigError(f"data.online_device.{key}={size} is invalid: expected 1..{len(split)}")
        pick = np.sort(rng.choice(len(split), size=size, replace=False))
        x = np.concatenate([split.x, np.rot90(split.x[pick], k=quarter_turns, axes=(2, 3))])
        splits.append(ArrayData(np.ascontiguousarray(x), np.concatenate([split.y, split.y[pick]])))
        indices.append(np.arange(len(split), len(split) + size, dtype=np.int64))
    return dataclasses.replace(bundle, train=splits[0], test=splits[1]), indices[0], indices[1]


__all__ = ["FederatedData", "build_federated_data", "clear_caches", "label_counts"]
