"""The quadratic federation of the LocalUpdate analysis as least-squares data.

Client i has f_i(x) = ½‖A_i^{1/2}(x − c_i)‖² with μI ⪯ A_i ⪯ LI (both extremes attained)
and ‖c_i‖ ≤ C (:func:`task.analysis.surrogate.random_federation`). It is stored as d regression
samples per client whose mean squared error (the regression loss of ``task.learning.engine``, no ½)
is exactly f_i up to a constant: rows X_i = √(d/2)·A_i^{1/2} and targets y_i = X_i c_i, so
(2/d)·X_iᵀX_i = A_i and the minimiser of client i is c_i. The test split is the train split
(the paper measures the loss on the training population). Use it with ``model.name=quadratic``
(x ∈ R^d, no bias) and a batch size of at least d for full-batch clients.

Config keys (``data.name: synthetic_quadratic``; sub-section ``data.quadratic``):
``d`` (10), ``mu`` (1.0), ``L`` (10.0), ``C`` (1.0), ``shared_basis`` (false: every A_i has
its own random eigenvectors; true: one eigenbasis, so cond(f̃) = κ of eq. 9), ``seed`` (0); the number of clients is
``data.num_clients``. ``bundle.meta`` holds ``A`` (n, d, d) and ``c`` (n, d) in float64.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from task.errors import ConfigError
from task.data.sources import ArrayData, DataBundle, cfg_get, get_bool, get_float, get_int
from task.analysis.surrogate import QuadraticFederation, random_federation


def quadratic_params(data_cfg: Mapping) -> dict:
    """Validated arguments of :func:`random_federation` from the ``data`` config."""
    q = cfg_get(data_cfg, "quadratic", {})
    if not isinstance(q, Mapping):
        raise ConfigError(f"data.quadratic={q!r} is invalid: expected a mapping with d, mu, L, C, seed")
    p = "data.quadratic."
    mu = get_float(q, "mu", 1.0, gt=0.0, prefix=p)
    L = get_float(q, "L", 10.0, gt=0.0, prefix=p)
    if L < mu:
        raise ConfigError(f"data.quadratic.L={L} is invalid: expected L >= mu={mu}")
    return {"num_clients": get_int(data_cfg, "num_clients", 10, lo=1), "d": get_int(q, "d", 10, lo=1, prefix=p),
            "mu": mu, "L": L, "C": get_float(q, "C", 1.0, ge=0.0, prefix=p),
            "shared_basis": get_bool(q, "shared_basis", False, prefix=p), "seed": get_int(q, "seed", 0, lo=0, prefix=p)}


def federation_samples(fed: QuadraticFederation) -> ArrayData:
    """d rows per client whose mean squared error is f_i (up to a constant)."""
    n, d, _ = fed.A.shape
    xs, ys = [], []
    for A, c in zip(fed.A, fed.c):
        lam, vec = np.linalg.eigh(A)
        rows = np.sqrt(d / 2.0) * (vec * np.sqrt(lam)) @ vec.T
        xs.append(rows)
        ys.append(rows @ c)
    owner = np.repeat(np.arange(n, dtype=np.int64), d)
    return ArrayData(np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.float32), owner)


def bundle_from_cfg(data_cfg: Mapping) -> DataBundle:
    """The quadratic federation of ``data_cfg`` as a regression bundle (natural partition)."""
    params = quadratic_params(data_cfg)
    fed = random_federation(params["num_clients"], params["d"], params["mu"], params["L"], params["C"],
                            np.random.default_rng(params["seed"]), params["shared_basis"])
    samples = federation_samples(fed)
    return DataBundle(train=samples, test=samples, num_classes=1, input_shape=(params["d"],), task="regression",
                      meta={"A": fed.A, "c": fed.c})
