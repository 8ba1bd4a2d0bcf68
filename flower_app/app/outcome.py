"""A run's outcome in words: where it writes, what its final numbers average, and why it failed
(no round could aggregate, no final metric, no better than chance). The round loop calls these."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from task.data.federated_data import FederatedData

#: Set by ``flrep`` to the command's start (epoch seconds) so that a run in its simulation counts the
#: engine's start-up as start-up too.
COMMAND_START_ENV = "FLREP_COMMAND_START"


def command_startup_s(app_started_at: float) -> float:
    """Seconds between the ``flrep`` command's start and this app's, for the command's first run
    only (0 outside ``flrep run`` and for a comparison's later variants)."""
    try:
        return max(0.0, app_started_at - float(os.environ.pop(COMMAND_START_ENV)))
    except (KeyError, ValueError):
        return 0.0


def describe_window(rounds: list[int]) -> str:
    """The evaluations a final number averages, in words: ``mean of rounds 3-5 (3 evaluations)``."""
    if not rounds:
        return "no evaluation"
    if len(rounds) == 1:
        return f"round {rounds[0]}"
    return f"mean of rounds {rounds[0]}-{rounds[-1]} ({len(rounds)} evaluations)"


def output_dir(cfg: DictConfig) -> Path:
    """``resume`` (a resumed run goes on writing where it started), ``out_dir``, or
    ``outputs/<experiment>-<timestamp>`` under the current directory."""
    if cfg.resume:
        return Path(str(cfg.resume)).expanduser().resolve()
    if cfg.out_dir:
        return Path(str(cfg.out_dir)).expanduser().resolve()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return (Path.cwd() / "outputs" / f"{cfg.experiment}-{stamp}").resolve()


def skipped_too_many(trains: list[dict], limit: float) -> str | None:
    """Why the run learned nothing worth reporting: more of its training rounds were skipped (every
    reply failed or was rejected) than ``faults.max_skipped_fraction`` (``limit``) allows; None otherwise."""
    skipped = [r["round"] for r in trains if r.get("skipped")]
    if not trains or (len(skipped) < len(trains) and len(skipped) <= limit * len(trains)):
        return None
    return (f"{len(skipped)} of {len(trains)} training rounds were skipped (rounds {skipped[:10]}"
            f"{' ...' if len(skipped) > 10 else ''}; faults.max_skipped_fraction={limit:g}): "
            "see the failures in metrics.jsonl")


def no_final_metric(summary: dict, global_loss: float | None, final_window: int) -> str | None:
    """Why the run has no result: no evaluation of its final window produced a loss (every
    client's evaluation failed or was rejected, e.g. a diverged model's NaN); None otherwise."""
    if summary["personalized_loss"] is not None or global_loss is not None:
        return None
    return (f"no evaluation of the final {final_window} rounds produced a metric: every "
            "client's evaluation failed or was rejected (see the failures in metrics.jsonl)")


def no_better_than_chance(summary: dict, data: FederatedData, scored_clients: list[int]) -> str | None:
    """Why a classification run learned nothing: its final accuracy (global, else personalized,
    over ``scored_clients``' test data) is no better than always predicting the most frequent class
    of the test labels it was scored on; None otherwise."""
    if data.bundle.task == "regression":
        return None
    key = next((k for k in ("global_accuracy", "personalized_accuracy") if summary.get(k) is not None), None)
    if key is None:
        return None
    idx = data.global_test if key == "global_accuracy" else np.concatenate(
        [data.client_test[p] for p in scored_clients])
    labels = np.asarray(data.bundle.test.y)[idx].astype(np.int64)
    if labels.size == 0:
        return None
    majority = float(np.bincount(labels).max() / labels.size)
    if summary[key] > majority:
        return None
    return (f"its final {key.replace('_', ' ')} {summary[key]:.4f} is no better than always predicting the most "
            f"frequent class of its test labels ({majority:.4f}): the run learned nothing")
