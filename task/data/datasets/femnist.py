"""FEMNIST from LEAF json shards, and the class and writer filter it shares with Hub FEMNIST.

``data.root`` layout: LEAF json shards; either ``root/train/*.json`` and ``root/test/*.json``
or ``*.json`` files directly in ``root`` with ``_train_`` / ``_test_`` in their names.
Parsed shards are cached as ``.npz`` in ``cache_dir`` like image folders.

Config keys (under ``data.``)
-----------------------------
``femnist_classes``
    ``all`` (default; 62 classes, LEAF coding 0-9 digits, 10-35 ``A``-``Z``, 36-61
    ``a``-``z``), ``digits`` (LEAF labels 0-9, kept as 0-9) or ``letters`` (the 10
    handwritten lowercase letters ``a``-``j``, LEAF labels 36-45, remapped to 0-9; our
    reading of FedRep's "10 handwritten letters"), or ``letters_digits`` (those letters as
    0-9 and the digits as 10-19: FedRep Figure 6, training clients on the letters and new
    clients on the digits via ``data.new_client_classes``). Only writers that have samples in both
    train and test after this filter are kept; ``group`` is the writer's index in the
    sorted list of kept writer ids (``bundle.meta["writers"]``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from task.data.datasets.bundle import DataBundle
from task.data.datasets.cache import CACHE_VERSION, file_stamp, hash_key, load_npz, save_npz_atomic
from task.data.datasets.config import get_choice
from task.data.datasets.images import image_bundle
from task.errors import ConfigError

FEMNIST_LETTERS = tuple(range(36, 46))  # LEAF labels of lowercase 'a'..'j'
FEMNIST_CLASS_MODES = ("all", "digits", "letters", "letters_digits")


def _femnist_files(root: Path) -> tuple[list[Path], list[Path]]:
    if (root / "train").is_dir() and (root / "test").is_dir():
        tr = sorted((root / "train").glob("*.json"))
        te = sorted((root / "test").glob("*.json"))
    else:
        files = sorted(root.glob("*.json")) if root.is_dir() else []
        tr = [f for f in files if "_train_" in f.name]
        te = [f for f in files if "_test_" in f.name]
    if not tr or not te:
        raise ConfigError(
            f"data.root={str(root)!r}: no FEMNIST LEAF json found; expected train/*.json and test/*.json "
            "subfolders, or *.json files with '_train_' / '_test_' in their names"
        )
    return tr, te


def _parse_leaf_json(path: Path) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    try:
        with open(path, "rb") as fh:
            obj = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot parse json ({exc}); expected a LEAF FEMNIST json shard") from exc
    if not isinstance(obj, dict) or "users" not in obj or "user_data" not in obj:
        raise ConfigError(f"{path}: expected a json object with keys 'users' and 'user_data' (LEAF format)")
    users, xs, ys = [], [], []
    for user in obj["users"]:
        ud = obj["user_data"].get(user) if isinstance(obj["user_data"], dict) else None
        if not isinstance(ud, dict) or "x" not in ud or "y" not in ud:
            raise ConfigError(f"{path}: user_data[{user!r}] must have 'x' and 'y'")
        try:
            x = np.asarray(ud["x"], dtype=np.float32)
            y = np.asarray(ud["y"], dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: user_data[{user!r}] has non-numeric x/y ({exc})") from exc
        if x.ndim != 2 or x.shape[1] != 784 or y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ConfigError(
                f"{path}: user_data[{user!r}] has x of shape {x.shape} and y of shape {y.shape}; "
                "expected x (n, 784) and y (n,)"
            )
        if y.size and (y.min() < 0 or y.max() > 61):
            raise ConfigError(f"{path}: user_data[{user!r}] has labels outside 0..61")
        users.append(str(user))
        xs.append(x)
        ys.append(y)
    _check_num_samples(path, obj.get("num_samples"), users, ys)
    return users, xs, ys


def _check_num_samples(path: Path, counts: object, users: list[str], ys: list[np.ndarray]) -> None:
    """LEAF's optional ``num_samples`` (one count per user) agrees with ``user_data``."""
    if counts is None:
        return
    if not isinstance(counts, list) or len(counts) != len(users):
        size = len(counts) if isinstance(counts, list) else "no list of"
        raise ConfigError(f"{path}: num_samples has {size} entries for {len(users)} users")
    for user, count, y in zip(users, counts, ys):
        if count != len(y):
            raise ConfigError(f"{path}: num_samples gives {count} samples for user {user!r}, its user_data "
                              f"holds {len(y)}; the shard is inconsistent (truncated or edited)")


def _read_leaf_split(files: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    users_all: list[str] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for f in files:
        users, ux, uy = _parse_leaf_json(f)
        for u, x, y in zip(users, ux, uy):
            users_all.extend([u] * len(y))
            xs.append(x)
            ys.append(y)
    x = np.concatenate(xs) if xs else np.zeros((0, 784), np.float32)
    y = np.concatenate(ys) if ys else np.zeros((0,), np.int64)
    return x, y, np.array(users_all, dtype=str)


def load_femnist_local(root: Path, data_cfg: Mapping, cache_dir: Path) -> DataBundle:
    """FEMNIST from the LEAF json shards under ``root`` (cached as ``.npz``)."""
    classes_mode = get_choice(data_cfg, "femnist_classes", "all", FEMNIST_CLASS_MODES)
    tr_files, te_files = _femnist_files(root)
    key = hash_key("femnist", CACHE_VERSION, [file_stamp(f) for f in tr_files + te_files])
    cache_file = cache_dir / "decoded" / f"femnist-{key[:32]}.npz"
    cached = load_npz(cache_file)
    if cached is not None:
        xtr, ytr, utr = cached["x_train"], cached["y_train"], cached["u_train"]
        xte, yte, ute = cached["x_test"], cached["y_test"], cached["u_test"]
    else:
        xtr, ytr, utr = _read_leaf_split(tr_files)
        xte, yte, ute = _read_leaf_split(te_files)
        save_npz_atomic(cache_file, x_train=xtr, y_train=ytr, u_train=utr, x_test=xte, y_test=yte, u_test=ute)
    return femnist_bundle(xtr.reshape(-1, 1, 28, 28), ytr, utr, xte.reshape(-1, 1, 28, 28), yte, ute,
                          classes_mode, where=str(root))


def femnist_bundle(xtr: np.ndarray, ytr: np.ndarray, utr: np.ndarray, xte: np.ndarray, yte: np.ndarray,
                   ute: np.ndarray, classes_mode: str, where: str) -> DataBundle:
    """Filter classes, keep writers present in both splits, attach writer groups."""
    if classes_mode == "digits":
        keep_labels, names = np.arange(10), [str(i) for i in range(10)]
    elif classes_mode == "letters":
        keep_labels, names = np.array(FEMNIST_LETTERS), list("abcdefghij")
    elif classes_mode == "letters_digits":
        keep_labels = np.array(FEMNIST_LETTERS + tuple(range(10)))
        names = list("abcdefghij") + [str(i) for i in range(10)]
    else:
        keep_labels = np.arange(62)
        names = [str(i) for i in range(10)] + [chr(ord("A") + i) for i in range(26)] + [chr(ord("a") + i) for i in range(26)]
    remap = np.full(62, -1, dtype=np.int64)
    remap[keep_labels] = np.arange(len(keep_labels))
    mtr = remap[ytr] >= 0
    mte = remap[yte] >= 0
    writers = np.intersect1d(np.unique(utr[mtr]), np.unique(ute[mte]))
    if writers.size == 0:
        raise ConfigError(f"{where}: no FEMNIST writer has both train and test samples (data.femnist_classes={classes_mode!r})")
    mtr &= np.isin(utr, writers)
    mte &= np.isin(ute, writers)
    gtr = np.searchsorted(writers, utr[mtr]).astype(np.int64)
    gte = np.searchsorted(writers, ute[mte]).astype(np.int64)
    x_train = np.ascontiguousarray(xtr[mtr], dtype=np.float32)
    x_test = np.ascontiguousarray(xte[mte], dtype=np.float32)
    bundle = image_bundle(x_train, remap[ytr[mtr]], x_test, remap[yte[mte]], len(keep_labels), names, gtr, gte)
    bundle.meta["writers"] = [str(w) for w in writers]
    return bundle
