"""The official FedRep / LG-FedAvg shard partition (``data.partition=class_shards``, their
``noniid`` in ``utils/sampling.py``) in seeded numpy: each class is cut into single-class shards
of consecutive samples, a shuffled list of labels is dealt to the clients, and each label takes a
random unused shard of its class; each client's local test set is dealt the same way from the test
set with the same labels. Called by :func:`task.data.partition.partition_train` and
:func:`task.data.federated_data.build_federated_data`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from task.data.sources import cfg_get, get_int
from task.errors import ConfigError


def _class_rows(classes: np.ndarray, data_cfg: Mapping, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """The (num_clients, shards_per_client) class labels dealt by ``class_shards`` (the official
    ``rand_set_all``): every class ``num_clients * shards_per_client / C`` times, shuffled."""
    spc = get_int(data_cfg, "shards_per_client", 2, lo=1)
    if cfg_get(data_cfg, "shard_size", None) is not None:
        raise ConfigError("data.shard_size must be null for data.partition='class_shards': the shard size is "
                          "derived (samples of a class / shards per class)")
    if (num_clients * spc) % classes.size:
        raise ConfigError(
            f"data.shards_per_client={spc} is invalid for data.partition='class_shards': data.num_clients="
            f"{num_clients} x shards_per_client must be a multiple of the {classes.size} classes"
        )
    return rng.permutation(np.tile(classes, num_clients * spc // classes.size)).reshape(num_clients, spc)


def _deal_class_shards(labels: np.ndarray, rows: np.ndarray, rng: np.random.Generator, split: str) -> list[np.ndarray]:
    """Cut each class of ``labels`` into as many shards as ``rows`` names it (consecutive samples
    in index order; the first ``len % shards`` shards get one of the last samples each), then give
    each client, for each label of its row, a random unused shard of that class."""
    classes, per_class = np.unique(rows, return_counts=True)
    shards: dict[int, list[np.ndarray]] = {}
    for c, k in zip(classes.tolist(), per_class.tolist()):
        idx = np.flatnonzero(labels == c)
        if idx.size < k:
            raise ConfigError(
                f"data.partition='class_shards': class {c} has {idx.size} {split} samples, fewer than its {k} "
                "shards; use fewer data.num_clients or data.shards_per_client"
            )
        extra = idx.size % k
        body = idx[: idx.size - extra].reshape(k, -1)
        shards[c] = [np.append(body[i], idx[idx.size - extra + i]) if i < extra else body[i] for i in range(k)]
    out = []
    for row in rows:
        picked = [shards[c].pop(int(rng.integers(len(shards[c])))) for c in row.tolist()]
        out.append(np.sort(np.concatenate(picked)).astype(np.int64))
    return out


def class_shards(labels: np.ndarray, data_cfg: Mapping, num_clients: int, seed: int) -> list[np.ndarray]:
    """The official FedRep / LG-FedAvg shard partition of the train set (``data.partition=class_shards``).

    Draws from ``np.random.default_rng(seed)``: first the class rows (:func:`_class_rows`), then
    each client's shards in client order.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    return _deal_class_shards(labels, _class_rows(np.unique(labels), data_cfg, num_clients, rng), rng, "train")


def class_shard_test_split(
    train_labels: np.ndarray, test_labels: np.ndarray, data_cfg: Mapping, num_clients: int, seed: int
) -> list[np.ndarray]:
    """Local test sets of ``class_shards``, as the official code builds them: the test set's
    classes are cut into shards the same way and each client takes, for each label of its row
    (the same rows as its train shards), a random unused test shard of that class. Test shards
    are disjoint across clients and cover the test samples of the dealt classes."""
    rows = _class_rows(np.unique(np.asarray(train_labels)), data_cfg, num_clients, np.random.default_rng(seed))
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7E57]))
    return _deal_class_shards(np.asarray(test_labels), rows, rng, "test")


__all__ = ["class_shards", "class_shard_test_split"]
