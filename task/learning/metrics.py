"""Evaluation-protocol arithmetic: spread over clients, final-window means."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def client_spread(values: Iterable[float]) -> dict[str, float]:
    """Mean, standard deviation and mean of the worst 10% (at least one) of per-client values."""
    arr = np.sort(np.asarray(list(values), dtype=np.float64))
    if arr.size == 0:
        return {"mean": float("nan"), "std": float("nan"), "worst10": float("nan")}
    worst = max(1, int(np.ceil(0.1 * arr.size)))
    return {"mean": float(arr.mean()), "std": float(arr.std()), "worst10": float(arr[:worst].mean())}


def final_window_mean(rounds: Sequence[int], values: Sequence[float | None], last_round: int, window: int) -> float | None:
    """Mean of the values measured in the final ``window`` rounds (rounds > last_round - window).

    Falls back to the last measured value when no measurement lies in the window.
    """
    used = final_window_rounds(rounds, values, last_round, window)
    if not used:
        return None
    return float(np.mean([v for r, v in zip(rounds, values) if r in used and v is not None]))


def final_window_rounds(rounds: Sequence[int], values: Sequence[float | None], last_round: int,
                        window: int) -> list[int]:
    """The rounds whose values :func:`final_window_mean` averages (the last measured round when
    none lies in the window; empty when nothing was measured)."""
    measured = [r for r, v in zip(rounds, values) if v is not None]
    inside = [r for r in measured if r > last_round - window]
    return inside if inside else measured[-1:]
