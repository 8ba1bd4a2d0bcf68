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
    why = "see the failures in metrics.jsonl"
    first = next(r for r in trains if r.get("skipped"))
    non_finite = next((f"client {pid}'s reply: {reason.removeprefix('rejected: ')}"
                       for pid, reason in first.get("failures", {}).items() if "NaN or Inf" in reason), None)
    if non_finite is not None:
        why = f"round {first['round']}: {non_finite}: the run diverged"
    return (f"{len(skipped)} of {len(trains)} training rounds were skipped (rounds {skipped[:10]}"
            f"{' ...' if len(skipped) > 10 else ''}; faults.max_skipped_fraction={limit:g}): {why}")


def unserved_partitions(records: list[dict]) -> dict[str, int]:
    """Partition id -> the number of rounds in which no node answered for it (any phase)."""
    rounds: dict[int, set[int]] = {}
    for record in records:
        for pid in record.get("unserved_clients", []):
            rounds.setdefault(int(pid), set()).add(int(record["round"]))
    return {str(pid): len(rounds[pid]) for pid in sorted(rounds)}


def incomplete(unserved: dict[str, int]) -> str | None:
    """Why a run that went through its rounds is ``incomplete``: partitions that went unserved; None otherwise."""
    if not unserved:
        return None
    shown = ", ".join(f"{pid} ({n} round{'s' if n > 1 else ''})" for pid, n in list(unserved.items())[:10])
    return (f"no node answered for partition(s) {shown}: the results leave them out there; "
            "faults.allow_unserved=true accepts such a run")


def no_final_metric(summary: dict, global_loss: float | None, final_window: int) -> str | None:
    """Why the run has no result: no evaluation of its final window produced a loss (every
    client's evaluation failed or was rejected, e.g. a diverged model's NaN); None otherwise."""
    if summary["personalized_loss"] is not None or global_loss is not None:
        return None
    return (f"no evaluation of the final {final_window} rounds produced a metric: every "
            "client's evaluation failed or was rejected (see the failures in metrics.jsonl)")


#: An evaluation loss above this many times ln(classes) (always guessing uniformly) has exploded.
EXPLODED_LOSS_FACTOR = 10.0
LOSS_KEYS = ("train_loss", "personalized_loss", "global_loss")


def diverged(records: list[dict], num_classes: int | None) -> str | None:
    """Why the run diverged: a loss that is not a finite number in any round, or, for
    classification, a final evaluation loss above ``EXPLODED_LOSS_FACTOR`` × ln(classes); None otherwise."""
    for record in records:
        for key in LOSS_KEYS:
            value = record.get(key)
            if value is not None and not np.isfinite(value):
                return f"round {record['round']}: {key.replace('_', ' ')} is {value}: the run diverged"
    evals = [r for r in records if r.get("phase") == "eval"]
    if not evals or not num_classes or num_classes < 2:
        return None
    limit = EXPLODED_LOSS_FACTOR * float(np.log(num_classes))
    for key in ("personalized_loss", "global_loss"):
        value = evals[-1].get(key)
        if value is not None and value > limit:
            return (f"round {evals[-1]['round']}: {key.replace('_', ' ')} {value:.4g} is above {EXPLODED_LOSS_FACTOR:g} × "
                    f"ln({num_classes}) = {limit:.3g}, the loss of guessing uniformly: the run diverged")
    return None


def _majority(labels: np.ndarray) -> float | None:
    """The accuracy of always predicting the most frequent of ``labels``."""
    return float(np.bincount(labels).max() / labels.size) if labels.size else None


def no_better_than_chance(summary: dict, data: FederatedData, scored_clients: list[int]) -> str | None:
    """Why a classification run learned nothing; None otherwise. A global model's final accuracy
    must beat always predicting the most frequent class of the global test labels; a run without
    one must beat, in personalized accuracy, each client always predicting its own most frequent
    test label (averaged over ``scored_clients`` as personalized accuracy is: one client, one vote)."""
    if data.bundle.task == "regression":
        return None
    labels = np.asarray(data.bundle.test.y).astype(np.int64)
    if summary.get("global_accuracy") is not None:
        key, reached = "global_accuracy", summary["global_accuracy"]
        baseline = _majority(labels[data.global_test])
        what = "always predicting the most frequent class of its test labels"
    elif summary.get("personalized_accuracy") is not None:
        key, reached = "personalized_accuracy", summary["personalized_accuracy"]
        own = [m for p in scored_clients if (m := _majority(labels[data.client_test[p]])) is not None]
        baseline = float(np.mean(own)) if own else None
        what = "each client always predicting its own most frequent test label"
    else:
        return None
    if baseline is None or reached > baseline or (reached == baseline == 1.0):
        return None
    return (f"its final {key.replace('_', ' ')} {reached:.4f} is no better than {what} ({baseline:.4f}): "
            "the run learned nothing")
