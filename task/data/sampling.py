"""Client sampling: a pure function of (seed, round), identical for every algorithm."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLING_STREAM = 0x5A3  # separates the sampling stream from other uses of the run seed


def sample_clients(candidates: Sequence[int], num_sampled: int, seed: int, server_round: int) -> list[int]:
    """``num_sampled`` distinct ids from ``candidates`` for ``server_round``, sorted."""
    if not 1 <= num_sampled <= len(candidates):
        raise ValueError(f"cannot sample {num_sampled} of {len(candidates)} clients")
    rng = np.random.default_rng([SAMPLING_STREAM, int(seed), int(server_round)])
    chosen = rng.choice(np.asarray(sorted(candidates)), size=num_sampled, replace=False)
    return sorted(int(c) for c in chosen)
