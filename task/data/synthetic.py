"""FedRep's synthetic multi-task linear-representation regression data.

Model (Collins et al., 2021, "Exploiting Shared Representations for Personalized
Federated Learning", Sec. 5 / linear case): a ground-truth representation
``B* in R^{d x k}`` with orthonormal columns (the Q factor of the QR decomposition of a
standard Gaussian ``d x k`` matrix), client heads ``w*_i ~ N(0, I_k) * head_scale``,
inputs ``x ~ N(0, I_d)`` and targets ``y = <B* w*_i, x> + N(0, noise^2)``.

Config keys (``data.name: synthetic_linear``; sub-section ``data.synthetic``):

* ``data.num_clients`` (default 100): number of tasks/clients.
* ``data.synthetic.d`` (default 20): input dimension.
* ``data.synthetic.k`` (default 2): representation dimension, ``1 <= k <= d``.
* ``data.synthetic.n_train`` (default 10): train samples per client.
* ``data.synthetic.n_test`` (default 100): test samples per client.
* ``data.synthetic.noise`` (default 0.01): standard deviation of the additive noise (>= 0).
* ``data.synthetic.head_scale`` (default 1.0): multiplies the heads ``w*_i`` (> 0).
* ``data.synthetic.whiten`` (default false): whiten each client's train inputs so that
  ``X_iᵀX_i / n_train = I`` exactly (needs ``n_train >= d``). The empirical loss is then the
  population loss of the papers' analysis plus noise, which removes the finite-sample bias
  of the fixed point (FedAvg-FT §5.1 and Figure 1 use population losses).
* ``data.synthetic.seed`` (default 0): generator seed (independent of the run seed so
  every algorithm and every run seed sees the same tasks unless it is set, e.g. to
  ``${seed}``).

Samples are stored client by client: client ``i`` owns train rows
``[i*n_train, (i+1)*n_train)`` and test rows ``[i*n_test, (i+1)*n_test)``; ``group`` holds
the client id, so the ``natural`` partition reproduces the tasks.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from task.errors import ConfigError
from task.data.sources import ArrayData, DataBundle, cfg_get, get_float, get_int

SYNTHETIC_DEFAULTS = {"d": 20, "k": 2, "n_train": 10, "n_test": 100, "noise": 0.01, "head_scale": 1.0, "seed": 0,
                      "whiten": False}
DEFAULT_NUM_CLIENTS = 100


def make_linear_tasks(
    num_clients: int,
    d: int,
    k: int,
    n_train: int,
    n_test: int,
    noise: float,
    seed: int,
    head_scale: float = 1.0,
    whiten: bool = False,
) -> tuple[DataBundle, list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Generate the pooled regression bundle, per-client train/test indices and ``B*``.

    Returns ``(bundle, client_train, client_test, B_star)``: ``bundle.task == "regression"``,
    ``num_classes == 1``, ``y`` float32 of shape (N,); ``bundle.meta`` holds ``B_star``
    (d, k) and ``heads`` (num_clients, k).
    """
    if num_clients < 1:
        raise ConfigError(f"data.num_clients={num_clients} is invalid: expected an integer >= 1")
    if d < 1:
        raise ConfigError(f"data.synthetic.d={d} is invalid: expected an integer >= 1")
    if not 1 <= k <= d:
        raise ConfigError(f"data.synthetic.k={k} is invalid: expected 1 <= k <= d={d}")
    if n_train < 1:
        raise ConfigError(f"data.synthetic.n_train={n_train} is invalid: expected an integer >= 1")
    if n_test < 1:
        raise ConfigError(f"data.synthetic.n_test={n_test} is invalid: expected an integer >= 1")
    if not noise >= 0:
        raise ConfigError(f"data.synthetic.noise={noise} is invalid: expected a number >= 0")
    if whiten and n_train < d:
        raise ConfigError(f"data.synthetic.whiten needs n_train >= d, got n_train={n_train} < d={d}")
    if not head_scale > 0:
        raise ConfigError(f"data.synthetic.head_scale={head_scale} is invalid: expected a number > 0")

    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((d, k)))
    b_star = q * np.sign(np.diag(r))[None, :]  # unique QR: positive diagonal of R
    heads = rng.standard_normal((num_clients, k)) * head_scale
    thetas = heads @ b_star.T  # (num_clients, d): theta_i = B* w*_i

    def split(n_per: int, white: bool = False) -> ArrayData:
        x = rng.standard_normal((num_clients * n_per, d))
        if white:
            for i in range(num_clients):
                rows = slice(i * n_per, (i + 1) * n_per)
                evals, evecs = np.linalg.eigh(x[rows].T @ x[rows] / n_per)
                x[rows] = x[rows] @ (evecs * evals ** -0.5) @ evecs.T
        owner = np.repeat(np.arange(num_clients, dtype=np.int64), n_per)
        y = np.einsum("nd,nd->n", x, thetas[owner]) + noise * rng.standard_normal(num_clients * n_per)
        return ArrayData(x.astype(np.float32), y.astype(np.float32), owner)

    train = split(n_train, whiten)
    test = split(n_test)
    client_train = [np.arange(i * n_train, (i + 1) * n_train, dtype=np.int64) for i in range(num_clients)]
    client_test = [np.arange(i * n_test, (i + 1) * n_test, dtype=np.int64) for i in range(num_clients)]
    bundle = DataBundle(
        train=train,
        test=test,
        num_classes=1,
        input_shape=(d,),
        task="regression",
        meta={"B_star": b_star.astype(np.float32), "heads": heads.astype(np.float32), "noise": float(noise)},
    )
    return bundle, client_train, client_test, b_star


def synthetic_params(data_cfg: Mapping) -> dict:
    """Validated ``make_linear_tasks`` keyword arguments from the ``data`` config."""
    syn = cfg_get(data_cfg, "synthetic", {})
    if not isinstance(syn, Mapping):
        raise ConfigError(f"data.synthetic={syn!r} is invalid: expected a mapping with d, k, n_train, n_test, noise")
    p = "data.synthetic."
    d = get_int(syn, "d", SYNTHETIC_DEFAULTS["d"], lo=1, prefix=p)
    return {
        "num_clients": get_int(data_cfg, "num_clients", DEFAULT_NUM_CLIENTS, lo=1),
        "d": d,
        "k": get_int(syn, "k", SYNTHETIC_DEFAULTS["k"], lo=1, hi=d, prefix=p),
        "n_train": get_int(syn, "n_train", SYNTHETIC_DEFAULTS["n_train"], lo=1, prefix=p),
        "n_test": get_int(syn, "n_test", SYNTHETIC_DEFAULTS["n_test"], lo=1, prefix=p),
        "noise": get_float(syn, "noise", SYNTHETIC_DEFAULTS["noise"], ge=0.0, prefix=p),
        "head_scale": get_float(syn, "head_scale", SYNTHETIC_DEFAULTS["head_scale"], gt=0.0, prefix=p),
        "seed": get_int(syn, "seed", SYNTHETIC_DEFAULTS["seed"], lo=0, prefix=p),
        "whiten": _get_bool(syn, "whiten", p),
    }


def _get_bool(syn: Mapping, key: str, prefix: str) -> bool:
    value = cfg_get(syn, key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{prefix}{key}={value!r} is invalid: expected true or false")
    return value


def bundle_from_cfg(data_cfg: Mapping) -> DataBundle:
    """The pooled synthetic bundle described by ``data_cfg`` (used by ``load_source``)."""
    bundle, _, _, _ = make_linear_tasks(**synthetic_params(data_cfg))
    return bundle
