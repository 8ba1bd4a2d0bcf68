"""A round's line on a terminal: short enough for 100 columns with Flower's level prefix.

The full line (clients that replied, traffic, every metric) is logged when stderr is not a
terminal (a log file), and every number is in ``metrics.jsonl`` either way.
"""

from __future__ import annotations

from strategies.common import fmt

#: Progress-line fields shown when a round reports them (regression and linear-representation runs):
#: (key in the eval record, name in the full line, name on a terminal).
EXTRA_PROGRESS = (("personalized_loss", "personalized loss", "test loss"),
                  ("representation_distance", "dist(B,B*)", "dist(B,B*)"),
                  ("global_grad_norm", "grad norm", "grad norm"))
#: Columns a round line may take on a terminal, Flower's level prefix included.
TERMINAL_COLUMNS = 100
#: What Flower's console handler writes before a line: ``INFO :      ``.
LEVEL_PREFIX_COLUMNS = 12


def clock(seconds: float) -> str:
    """``seconds`` in a few characters: ``14.7s``, ``12m03s``, ``3h05m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def round_line(t: int, rounds: int, train: dict, evaluation: dict | None, elapsed_s: float,
               seconds_per_round: float, whole_run: str = "") -> str:
    """Round ``t`` in one line: training loss, clients that replied, traffic so far, the
    accuracies when evaluated, training-and-evaluation time so far and the ETA (``whole_run``:
    the variant's place in a run of several and the whole run's ETA)."""
    asked = train.get("asked", len(train["clients"]))  # more than the sampled: Local-only's clients=all
    replied = asked - len(train.get("failed_clients", []))
    parts = [f"round {t}/{rounds}", "skipped" if train.get("skipped") else f"train loss {fmt(train.get('train_loss'))}",
             f"{replied}/{asked} clients replied",
             f"up {train['bytes_up'] / 1e6:.1f} MB, down {train['bytes_down'] / 1e6:.1f} MB"]
    if evaluation is not None:
        parts.append(f"personalized acc {fmt(evaluation['personalized_accuracy'])}")
        parts.append(f"global acc {fmt(evaluation.get('global_accuracy'))}")
        parts += [f"{name} {fmt(evaluation.get(key))}" for key, name, _ in EXTRA_PROGRESS
                  if evaluation.get(key) is not None
                  and (key != "personalized_loss" or evaluation["personalized_accuracy"] is None)]
    parts.append(f"elapsed {elapsed_s:.1f}s | ETA {seconds_per_round * (rounds - t):.1f}s")
    if whole_run:
        parts.append(whole_run)
    return "[flrep] " + " | ".join(parts)


def terminal_round_line(t: int, rounds: int, train: dict, evaluation: dict | None, elapsed_s: float,
                        eta_s: float) -> str:
    """Round ``t`` for a terminal: training loss, the clients that replied only when some did not,
    the accuracies (or the regression and linear-representation numbers) when evaluated, time
    so far and the ETA; cut with ``…`` at :data:`TERMINAL_COLUMNS` in the rare case it is longer."""
    parts = [f"round {t}/{rounds}", "skipped" if train.get("skipped") else f"loss {fmt(train.get('train_loss'))}"]
    asked = train.get("asked", len(train["clients"]))
    failed = len(train.get("failed_clients", []))
    if failed:
        parts.append(f"{asked - failed}/{asked} replied")
    if evaluation is not None:
        accuracy = evaluation.get("personalized_accuracy")
        if accuracy is not None:
            shared = evaluation.get("global_accuracy")
            parts.append(f"acc {fmt(accuracy)}" + (f", global {fmt(shared)}" if shared is not None else ""))
        parts += [f"{name} {fmt(evaluation[key])}" for key, _, name in EXTRA_PROGRESS
                  if evaluation.get(key) is not None and (key != "personalized_loss" or accuracy is None)]
    parts.append(f"{clock(elapsed_s)}, ETA {clock(eta_s)}")
    line = "[flrep] " + " | ".join(parts)
    room = TERMINAL_COLUMNS - LEVEL_PREFIX_COLUMNS
    return line if len(line) <= room else line[:room - 1] + "…"
