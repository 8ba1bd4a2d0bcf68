"""Split a train set across clients and give each client a matching local test set.

Partitioning uses the flwr-datasets partitioners (``flwr_datasets.partitioner``; that
package does not import Flower itself; ``class_shards`` is plain numpy) on a ``datasets.Dataset`` with columns ``label``,
``idx`` (the sample index) and ``group``; the index column is read back from every
partition, and each client's indices are returned sorted (int64).

Config keys (under ``data.``)
-----------------------------
``partition``
    One of :data:`PARTITIONS`. Default ``natural`` for ``femnist`` and
    ``synthetic_linear`` (whose samples carry a group id), ``iid`` otherwise.

    * ``iid``: the dataset is shuffled with the seed (``Dataset.shuffle(seed=seed)``),
      then ``IidPartitioner`` cuts it into equal contiguous pieces.
    * ``pathological``: ``PathologicalPartitioner(num_classes_per_partition=
      data.classes_per_client, class_assignment_mode=data.class_assignment_mode,
      seed=seed)``; each class is split evenly among the clients that hold it.
    * ``dirichlet``: ``DirichletPartitioner(alpha=data.dirichlet_alpha,
      min_partition_size=data.min_partition_size,
      self_balancing=data.dirichlet_self_balancing, seed=seed)``; the partitioner
      resamples up to 10 times to meet the minimum size, then gives up (ConfigError).
    * ``shard``: McMahan et al.'s scheme, ``ShardPartitioner(num_shards_per_partition=
      data.shards_per_client, shard_size=data.shard_size, seed=seed)``: sort by label,
      cut shards of ``shard_size`` consecutive samples, give each client
      ``shards_per_client`` random shards (every client gets exactly
      ``shards_per_client * shard_size`` samples).
    * ``class_shards``: the official FedRep / LG-FedAvg ``noniid`` (``utils/sampling.py``),
      in seeded numpy, no flwr-datasets (:mod:`task.data.class_shards`): each class is cut into
      ``num_clients * shards_per_client / C`` single-class shards of consecutive samples (in
      dataset order); a shuffled list holding every class that many times is dealt,
      ``shards_per_client`` labels per client (a client may get the same class twice), and
      each label takes a random unused shard of its class. Each client's local test set is
      built the same way from the test set with the same labels
      (:func:`task.data.class_shards.class_shard_test_split`),
      so ``test_per_client`` is ignored.
    * ``natural``: ``NaturalIdPartitioner(partition_by="group")``: one client per group id
      (sorted ids). With fewer clients than groups a seeded random subset of
      ``num_clients`` groups is used (kept in sorted id order); more clients than groups
      is an error.
``classes_per_client``
    Int in ``[1, number of classes]``, default 2 (pathological).
``class_assignment_mode``
    ``first-deterministic`` (default: client ``i`` always gets class ``i mod C`` plus
    random others, so every class is used when there are at least C clients),
    ``random`` or ``deterministic`` (pathological).
``dirichlet_alpha``
    Float > 0, default 0.5 (dirichlet).
``min_partition_size``
    Int >= 0, default 10, and ``num_clients * min_partition_size <= N`` (dirichlet).
``dirichlet_self_balancing``
    Bool, default false (dirichlet).
``shards_per_client``
    Int >= 1, default 2 (shard, class_shards; for class_shards ``num_clients *
    shards_per_client`` must be a multiple of the number of classes).
``shard_size``
    Int >= 1 or null (default): ``floor(N / (num_clients * shards_per_client))``; it must
    satisfy ``num_clients * shards_per_client * shard_size <= N`` (shard). McMahan's MNIST
    setting is 100 clients x 2 shards of 300. Must stay null for class_shards, whose shard
    size is derived: (samples of a class) / (shards per class).

Seeding: every partitioner gets ``seed`` and draws from ``np.random.default_rng(seed)``
only; ``iid`` shuffles with the same seed. The result is a pure function of
(labels, groups, config, num_partitions, seed).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from task.errors import ConfigError
from task.data.class_shards import class_shards
from task.data.sources import cfg_get, get_bool, get_choice, get_float, get_int

PARTITIONS = ("iid", "pathological", "dirichlet", "shard", "class_shards", "natural")
CLASS_ASSIGNMENT_MODES = ("first-deterministic", "random", "deterministic")
_NATURAL_BY_DEFAULT = ("femnist", "synthetic_linear", "synthetic_quadratic")


def partition_scheme(data_cfg: Mapping) -> str:
    """The validated ``data.partition`` (with its dataset-dependent default)."""
    default = "natural" if cfg_get(data_cfg, "name", None) in _NATURAL_BY_DEFAULT else "iid"
    return get_choice(data_cfg, "partition", default, PARTITIONS)


@contextlib.contextmanager
def _quiet_datasets():
    """Silence datasets' and tqdm's progress bars while partitioning."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            # pyarrow >= 25 deprecates an option datasets still passes when sorting
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyarrow")
            yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _read_partitions(partitioner, num_partitions: int) -> list[np.ndarray]:
    out = []
    for pid in range(num_partitions):
        part = partitioner.load_partition(pid)
        out.append(np.sort(np.asarray(part.with_format("numpy")["idx"], dtype=np.int64)))
    return out


def _read_or_explain(partitioner, num_partitions: int, quiet_warning: str, explanation: str) -> list[np.ndarray]:
    """Read all partitions, silencing one expected warning; a partitioner ValueError becomes
    a ConfigError carrying ``explanation`` and the partitioner's own message."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=quiet_warning)
        try:
            return _read_partitions(partitioner, num_partitions)
        except ValueError as exc:
            raise ConfigError(f"{explanation} ({exc})") from exc


def partition_train(
    labels: np.ndarray,
    groups: np.ndarray | None,
    data_cfg: Mapping,
    num_partitions: int,
    seed: int,
) -> list[np.ndarray]:
    """Split train sample indices ``0..len(labels)-1`` into ``num_partitions`` clients.

    Returns one sorted int64 index array per partition id. Raises ConfigError naming the
    offending ``data.*`` key when the configuration cannot be realised.
    """
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
        ShardPartitioner,
    )

    labels = np.asarray(labels)
    n = int(labels.shape[0])
    scheme = partition_scheme(data_cfg)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
        raise ConfigError(f"data.num_clients={num_partitions!r} is invalid: expected an integer >= 1")
    num_partitions = int(num_partitions)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed={seed!r} is invalid: expected an integer >= 0")
    seed = int(seed)
    if scheme != "natural" and num_partitions > n:
        raise ConfigError(
            f"data.num_clients={num_partitions} is invalid: more clients than the {n} train samples"
        )
    if labels.dtype.kind == "f" and scheme in ("pathological", "dirichlet", "shard", "class_shards"):
        raise ConfigError(
            f"data.partition={scheme!r} needs class labels but the dataset is a regression task; "
            "use iid or natural"
        )
    columns: dict[str, np.ndarray] = {"label": labels, "idx": np.arange(n, dtype=np.int64)}
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != (n,):
            raise ConfigError(f"data.partition={scheme!r}: groups have shape {groups.shape}; expected ({n},)")
        columns["group"] = groups

    num_classes = int(np.unique(labels).size)
    if scheme == "class_shards":
        return class_shards(labels, data_cfg, num_partitions, seed)
    with _quiet_datasets():
        ds = datasets.Dataset.from_dict(columns)
        if scheme == "iid":
            partitioner = IidPartitioner(num_partitions=num_partitions)
            partitioner.dataset = ds.shuffle(seed=seed)
            return _read_partitions(partitioner, num_partitions)

        if scheme == "pathological":
            cpc = get_int(data_cfg, "classes_per_client", 2, lo=1)
            if cpc > num_classes:
                raise ConfigError(
                    f"data.classes_per_client={cpc} is invalid: expected an integer in [1, {num_classes}] "
                    f"(the number of classes)"
                )
            mode = get_choice(data_cfg, "class_assignment_mode", "first-deterministic", CLASS_ASSIGNMENT_MODES)
            partitioner = PathologicalPartitioner(
                num_partitions=num_partitions, partition_by="label", num_classes_per_partition=cpc,
                class_assignment_mode=mode, shuffle=True, seed=seed,
            )
            partitioner.dataset = ds
            return _read_or_explain(
                partitioner, num_partitions, "Classes: .* will NOT be used",
                f"data.classes_per_client={cpc} with data.num_clients={num_partitions} cannot be realised",
            )

        if scheme == "dirichlet":
            alpha = get_float(data_cfg, "dirichlet_alpha", 0.5, gt=0.0)
            min_size = get_int(data_cfg, "min_partition_size", 10, lo=0)
            if min_size * num_partitions > n:
                raise ConfigError(
                    f"data.min_partition_size={min_size} is invalid: {num_partitions} clients x {min_size} "
                    f"> {n} train samples"
                )
            balancing = get_bool(data_cfg, "dirichlet_self_balancing", False)
            partitioner = DirichletPartitioner(
                num_partitions=num_partitions, partition_by="label", alpha=alpha, min_partition_size=min_size,
                self_balancing=balancing, shuffle=True, seed=seed,
            )
            partitioner.dataset = ds
            return _read_or_explain(
                partitioner, num_partitions, "The specified min_partition_size",
                f"data.dirichlet_alpha={alpha} / data.min_partition_size={min_size}: no Dirichlet partition "
                "meeting the minimum size was found in 10 attempts; raise dirichlet_alpha or lower min_partition_size",
            )

        if scheme == "shard":
            spc = get_int(data_cfg, "shards_per_client", 2, lo=1)
            shard_size = get_int(data_cfg, "shard_size", None, lo=1)
            if shard_size is None:
                shard_size = n // (num_partitions * spc)
                if shard_size < 1:
                    raise ConfigError(
                        f"data.shards_per_client={spc} is invalid: {num_partitions} clients x {spc} shards "
                        f"> {n} train samples"
                    )
            if num_partitions * spc * shard_size > n:
                raise ConfigError(
                    f"data.shard_size={shard_size} is invalid: data.num_clients={num_partitions} x "
                    f"data.shards_per_client={spc} x shard_size = {num_partitions * spc * shard_size} "
                    f"> {n} train samples"
                )
            partitioner = ShardPartitioner(
                num_partitions=num_partitions, partition_by="label", num_shards_per_partition=spc,
                shard_size=shard_size, shuffle=True, seed=seed,
            )
            partitioner.dataset = ds
            return _read_partitions(partitioner, num_partitions)

        # natural
        if groups is None:
            raise ConfigError(
                f"data.partition='natural' needs per-sample group ids but data.name="
                f"{cfg_get(data_cfg, 'name', None)!r} has none; use iid, pathological, dirichlet or shard"
            )
        partitioner = NaturalIdPartitioner(partition_by="group")
        partitioner.dataset = ds
        num_groups = partitioner.num_partitions
        if num_partitions > num_groups:
            raise ConfigError(
                f"data.num_clients={num_partitions} is invalid for data.partition='natural': "
                f"the dataset has only {num_groups} groups"
            )
        chosen = np.arange(num_groups)
        if num_partitions < num_groups:
            chosen = np.sort(np.random.default_rng(seed).choice(num_groups, size=num_partitions, replace=False))
        out = []
        for pid in chosen:
            part = partitioner.load_partition(int(pid))
            out.append(np.sort(np.asarray(part.with_format("numpy")["idx"], dtype=np.int64)))
        return out


def _largest_remainder(fractions: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total``, each floor or ceil of ``fractions * total``."""
    raw = fractions * total
    counts = np.floor(raw).astype(np.int64)
    short = int(total - counts.sum())
    if short > 0:
        order = np.lexsort((np.arange(len(raw)), -(raw - counts)))
        counts[order[:short]] += 1
    return counts


def matched_test_split(
    train_parts: Sequence[np.ndarray],
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    per_client: int | None,
    seed: int,
) -> list[np.ndarray]:
    """Per-client test indices whose label distribution matches the client's train split.

    Client ``i`` gets ``n_i`` test samples (``per_client``, or when None
    ``round(len(test) / len(train) * len(train_i))``, at least 1 for a non-empty client).
    Class ``c`` with train fraction ``p_c`` gets ``p_c * n_i`` samples rounded by the
    largest-remainder rule (so the counts sum to exactly ``n_i``). Samples are drawn, in
    client order, from one seeded shuffled queue per class, without replacement across
    clients until a class's queue is exhausted, after which it wraps around (samples are
    then shared between clients). A client never gets the same sample twice: a class's
    count is capped at its number of test samples, and classes with no test samples at
    all are skipped (that client's test set is then smaller than ``n_i``).
    Returns sorted int64 index arrays into the test set.
    """
    train_labels = np.asarray(train_labels)
    test_labels = np.asarray(test_labels)
    if per_client is not None and (isinstance(per_client, bool) or int(per_client) < 1):
        raise ConfigError(f"data.test_per_client={per_client!r} is invalid: expected null or an integer >= 1")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7E57]))
    classes = np.unique(test_labels)
    queues = {c.item(): rng.permutation(np.flatnonzero(test_labels == c)) for c in classes}
    pointers = {c: 0 for c in queues}
    ratio = len(test_labels) / max(len(train_labels), 1)
    out = []
    for part in train_parts:
        part = np.asarray(part, dtype=np.int64)
        if part.size == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        n_i = int(per_client) if per_client is not None else max(1, int(round(ratio * part.size)))
        cls, cnt = np.unique(train_labels[part], return_counts=True)
        counts = _largest_remainder(cnt / part.size, n_i)
        taken = []
        for c, k in zip(cls, counts):
            q = queues.get(c.item())
            if q is None or k == 0 or q.size == 0:
                continue
            k = min(int(k), q.size)  # never the same sample twice within one client
            start = pointers[c.item()]
            taken.append(q[(start + np.arange(k)) % q.size])
            pointers[c.item()] = start + int(k)
        out.append(np.sort(np.concatenate(taken)) if taken else np.zeros(0, dtype=np.int64))
    return out


def group_test_split(
    train_parts: Sequence[np.ndarray], train_groups: np.ndarray, test_groups: np.ndarray
) -> list[np.ndarray]:
    """For natural partitions: each client's test set is the test samples of its own group(s)."""
    train_groups = np.asarray(train_groups)
    test_groups = np.asarray(test_groups)
    out = []
    for part in train_parts:
        own = np.unique(train_groups[np.asarray(part, dtype=np.int64)])
        out.append(np.flatnonzero(np.isin(test_groups, own)).astype(np.int64))
    return out


__all__ = ["PARTITIONS", "partition_scheme", "partition_train", "matched_test_split", "group_test_split"]
