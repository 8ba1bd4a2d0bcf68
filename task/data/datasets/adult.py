"""UCI Adult (census income) from its CSV files, one-hot encoded.

``data.root`` layout: UCI ``adult.data`` and ``adult.test`` in ``root``.

Config keys (under ``data.``)
-----------------------------
``adult_missing``
    ``keep`` (default; a ``?`` is its own category, so all 32,561 / 16,281 rows are kept)
    or ``drop`` (rows with any ``?`` are removed: 30,162 / 15,060 rows).
``adult_include_protected``
    Bool, default ``true``: whether the one-hot ``race`` and ``sex`` columns are part of
    the adult features. They are always returned in ``ArrayData.attributes``.
``adult_split``
    ``uci`` (default): ``adult.data`` is the train split and ``adult.test`` the test split,
    encoded as below. ``fairness``: the protocol of LG-FedAvg's Table 4 (from the
    fairness-in-ml tutorial its official code uses): ``adult.data`` only, rows whose race is
    White or Black (30,940), a label-stratified 50/50 split (scikit-learn,
    ``random_state=7``) of which the first 15,000 rows of each half are kept; features are
    the numeric columns except ``fnlwgt`` and the one-hot categorical columns except race
    and sex (``?`` is the category ``Unknown``; each column's first category in sorted
    order is dropped), all standardised with the train split's mean and standard
    deviation; ``attributes`` are binary: ``race`` 1 = White, ``sex`` 1 = Male.
    ``adult_missing`` and ``adult_include_protected`` do not apply.

Adult encoding: features are the 6 numeric columns (age, fnlwgt, education-num,
capital-gain, capital-loss, hours-per-week), then the one-hot encodings of workclass,
education, marital-status, occupation, relationship, race, sex, native-country, with each
column's category set taken (sorted) from the train file; unseen test categories encode as
all zeros. Label 1 means income ``>50K``. ``ArrayData.attributes`` holds ``race`` and
``sex`` as int64 codes indexing ``bundle.meta["attribute_categories"][attr]`` (-1 for a
category not seen in train).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from task.data.datasets.bundle import ArrayData, DataBundle
from task.data.datasets.config import get_bool, get_choice
from task.errors import ConfigError

ADULT_COLUMNS = ("age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
                 "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week",
                 "native-country", "income")
ADULT_NUMERIC = ("age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week")
ADULT_CATEGORICAL = ("workclass", "education", "marital-status", "occupation", "relationship", "race", "sex",
                     "native-country")
ADULT_PROTECTED = ("race", "sex")


def _read_adult_csv(path: Path, drop_missing: bool) -> tuple[np.ndarray, list[list[str]], np.ndarray]:
    if not path.is_file():
        raise ConfigError(f"{path}: file not found; expected the UCI Adult file in data.root")
    try:
        text = path.read_text(encoding="utf-8", errors="strict")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as text ({exc}); expected the UCI Adult CSV") from exc
    num_idx = [ADULT_COLUMNS.index(c) for c in ADULT_NUMERIC]
    cat_idx = [ADULT_COLUMNS.index(c) for c in ADULT_CATEGORICAL]
    nums: list[list[float]] = []
    cats: list[list[str]] = []
    labels: list[int] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("|"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(ADULT_COLUMNS):
            raise ConfigError(f"{path}:{lineno}: {len(fields)} fields; expected {len(ADULT_COLUMNS)} comma-separated fields")
        if drop_missing and "?" in fields:
            continue
        try:
            row = [float(fields[i]) for i in num_idx]
        except ValueError as exc:
            raise ConfigError(f"{path}:{lineno}: non-numeric value in a numeric column ({exc})") from exc
        bad = [ADULT_NUMERIC[j] for j, v in enumerate(row) if not math.isfinite(v)]
        if bad:
            raise ConfigError(f"{path}:{lineno}: column {bad[0]!r} is {fields[num_idx[ADULT_NUMERIC.index(bad[0])]]!r}; "
                              "expected a finite number")
        nums.append(row)
        cats.append([fields[i] for i in cat_idx])
        lab = fields[-1].rstrip(".")
        if lab not in (">50K", "<=50K"):
            raise ConfigError(f"{path}:{lineno}: income label {fields[-1]!r}; expected '>50K' or '<=50K' (optionally ending in '.')")
        labels.append(1 if lab == ">50K" else 0)
    if not labels:
        raise ConfigError(f"{path}: no data rows; expected the UCI Adult CSV")
    return np.asarray(nums, dtype=np.float64), cats, np.asarray(labels, dtype=np.int64)


#: Rows kept from each half of the fairness split (LG-FedAvg Section 5.3).
FAIRNESS_ROWS = 15_000


def _fairness_bundle(base: Path, normalize: bool) -> DataBundle:
    """The ``adult_split=fairness`` protocol documented above."""
    from sklearn.model_selection import train_test_split

    nums, cats, labels = _read_adult_csv(base / "adult.data", drop_missing=False)
    race_col, sex_col = ADULT_CATEGORICAL.index("race"), ADULT_CATEGORICAL.index("sex")
    keep = np.array([row[race_col] in ("White", "Black") for row in cats])
    rows = [row for row, k in zip(cats, keep) if k]
    nums, labels = nums[keep], labels[keep]
    numeric = [i for i, c in enumerate(ADULT_NUMERIC) if c != "fnlwgt"]
    feats, names = [nums[:, numeric]], [ADULT_NUMERIC[i] for i in numeric]
    for j, col in enumerate(ADULT_CATEGORICAL):
        if col in ADULT_PROTECTED:
            continue
        values = np.array(["Unknown" if row[j] == "?" else row[j] for row in rows])
        kinds = np.unique(values)[1:]
        feats.append((values[:, None] == kinds[None, :]).astype(np.float64))
        names.extend(f"{col}={c}" for c in kinds)
    x = np.concatenate(feats, axis=1)
    attrs = {"race": np.array([row[race_col] == "White" for row in rows], dtype=np.int64),
             "sex": np.array([row[sex_col] == "Male" for row in rows], dtype=np.int64)}
    train_idx, test_idx = train_test_split(np.arange(len(labels)), test_size=0.5, stratify=labels, random_state=7)
    train_idx, test_idx = train_idx[:FAIRNESS_ROWS], test_idx[:FAIRNESS_ROWS]
    mean, std = x[train_idx].mean(axis=0), x[train_idx].std(axis=0)
    std[std < 1e-12] = 1.0
    if normalize:
        x = (x - mean) / std

    def split(idx: np.ndarray) -> ArrayData:
        return ArrayData(x[idx].astype(np.float32), labels[idx], None, {k: v[idx] for k, v in attrs.items()})

    return DataBundle(
        train=split(train_idx),
        test=split(test_idx),
        num_classes=2,
        input_shape=(x.shape[1],),
        meta={"class_names": ["<=50K", ">50K"], "feature_names": names,
              "attribute_categories": {"race": ["Black", "White"], "sex": ["Female", "Male"]}},
    )


def load_adult(root: Path, data_cfg: Mapping, normalize: bool) -> DataBundle:
    """UCI Adult from ``adult.data`` / ``adult.test`` under ``root``, encoded as documented above."""
    base = root if root.is_dir() else root.parent
    if get_choice(data_cfg, "adult_split", "uci", ("uci", "fairness")) == "fairness":
        return _fairness_bundle(base, normalize)
    missing = get_choice(data_cfg, "adult_missing", "keep", ("keep", "drop"))
    include_protected = get_bool(data_cfg, "adult_include_protected", True)
    ntr, ctr, ytr = _read_adult_csv(base / "adult.data", missing == "drop")
    nte, cte, yte = _read_adult_csv(base / "adult.test", missing == "drop")
    mean = ntr.mean(axis=0)
    std = ntr.std(axis=0)
    std[std < 1e-12] = 1.0
    if normalize:
        ntr = (ntr - mean) / std
        nte = (nte - mean) / std
    feat_tr = [ntr]
    feat_te = [nte]
    feature_names = list(ADULT_NUMERIC)
    attr_cats: dict[str, list[str]] = {}
    attrs_tr: dict[str, np.ndarray] = {}
    attrs_te: dict[str, np.ndarray] = {}
    for j, col in enumerate(ADULT_CATEGORICAL):
        vtr = np.array([row[j] for row in ctr])
        vte = np.array([row[j] for row in cte])
        cats = np.unique(vtr)
        code_tr = np.searchsorted(cats, vtr)
        code_te = np.searchsorted(cats, vte)
        code_te[(code_te >= len(cats)) | (cats[np.minimum(code_te, len(cats) - 1)] != vte)] = -1
        if col in ADULT_PROTECTED:
            attr_cats[col] = [str(c) for c in cats]
            attrs_tr[col] = code_tr.astype(np.int64)
            attrs_te[col] = code_te.astype(np.int64)
            if not include_protected:
                continue
        eye = np.eye(len(cats), dtype=np.float64)
        feat_tr.append(eye[code_tr])
        oh_te = np.zeros((len(vte), len(cats)))
        ok = code_te >= 0
        oh_te[ok] = eye[code_te[ok]]
        feat_te.append(oh_te)
        feature_names.extend(f"{col}={c}" for c in cats)
    xtr = np.concatenate(feat_tr, axis=1).astype(np.float32)
    xte = np.concatenate(feat_te, axis=1).astype(np.float32)
    meta = {
        "class_names": ["<=50K", ">50K"],
        "feature_names": feature_names,
        "attribute_categories": attr_cats,
        "numeric_mean": mean.astype(np.float32),
        "numeric_std": std.astype(np.float32),
    }
    return DataBundle(
        train=ArrayData(xtr, ytr, None, attrs_tr),
        test=ArrayData(xte, yte, None, attrs_te),
        num_classes=2,
        input_shape=(xtr.shape[1],),
        meta=meta,
    )
