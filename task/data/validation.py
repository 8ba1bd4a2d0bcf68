"""The validation split (``data.validation_fraction``): each client's training data cut into the
part it trains on and a held-out part on which it reports validation accuracy.

Client ``pid`` with ``n`` training samples holds out ``floor(f · n + 1/2)`` of them (``f`` the
fraction), drawn uniformly without replacement by a generator of (run seed, ``pid``) alone, so the
split is a pure function of the seed and the client and draws from no other random stream. Both
parts keep the order of the client's training indices. A fraction of 0 leaves every client as it
is; one that would leave a client without a training sample is a ConfigError.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from task.data.sources import get_float
from task.errors import ConfigError

_SALT = 0x7A11D  # keeps the split's generator apart from every other seeded draw


def validation_fraction(data_cfg: Mapping) -> float:
    """The validated ``data.validation_fraction`` (default 0: no validation split)."""
    return get_float(data_cfg, "validation_fraction", 0.0, ge=0.0, lt=1.0)


def validation_size(num_train: int, fraction: float) -> int:
    """How many of ``num_train`` training samples a client holds out: ``fraction · num_train`` rounded half up."""
    return int(math.floor(fraction * num_train + 0.5 + 1e-9))


def split_client(train_idx: np.ndarray, fraction: float, seed: int, pid: int) -> tuple[np.ndarray, np.ndarray]:
    """Client ``pid``'s training indices cut into (training part, validation part)."""
    n = len(train_idx)
    held = validation_size(n, fraction)
    if n and held >= n:
        raise ConfigError(f"data.validation_fraction={fraction} is invalid: client {pid} has {n} training "
                          f"sample(s) and would hold out {held}, keeping none to train on; lower it")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), _SALT, int(pid)]))
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, size=held, replace=False)] = True
    return train_idx[~mask], train_idx[mask]


def split_clients(parts: Sequence[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every client's (partition id = position) training indices cut by :func:`split_client`."""
    pairs = [split_client(idx, fraction, seed, pid) for pid, idx in enumerate(parts)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


__all__ = ["split_client", "split_clients", "validation_fraction", "validation_size"]
