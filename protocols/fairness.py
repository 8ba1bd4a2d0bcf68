"""Fairness evaluation (LG-FedAvg Table 4): a fair model (``model.name=adult_fair``) is evaluated
on the clients, where the protected attributes live; every evaluation records the mean over
clients of the class ROC-AUC and of the local adversary's AUC per protected attribute, and the
final round asks the clients for the post-fit check (a fresh adversary trained on the frozen
representation).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Message

from protocols.base import PaperProtocol
from strategies.services import Services
from task.learning.fairness import ATTRIBUTES
from task.learning.metrics import final_window_mean
from task.learning.models import FairMLP

#: Per-client fairness metrics (client replies) averaged over clients each evaluated round.
FAIR_METRICS = ("class_auc", *(f"{kind}_auc_{a}" for kind in ("adversary", "postfit") for a in ATTRIBUTES))


class Fairness(PaperProtocol):
    """Fairness metrics of a fair model, from the clients' evaluation replies."""

    name = "fairness"

    def active(self, services: Services) -> bool:
        return isinstance(services.model, FairMLP)

    def clients_evaluate(self, services: Services) -> bool:
        return True

    def evaluate_config(self, server_round: int, services: Services) -> dict:
        return {"postfit": server_round == int(services.cfg.rounds)}

    def on_evaluate(self, server_round: int, record: dict, replies: list[Message], services: Services) -> None:
        for key in FAIR_METRICS:
            values = services.metric_of(replies, key)
            if values:
                record[key] = float(np.mean(list(values.values())))
        for kind in ("adversary", "postfit"):
            per_attr = [record[f"{kind}_auc_{a}"] for a in ATTRIBUTES if f"{kind}_auc_{a}" in record]
            if per_attr:
                record[f"{kind}_auc"] = float(np.mean(per_attr))

    def summary(self, records: list[dict], services: Services) -> dict:
        evals = [r for r in records if r["phase"] == "eval"]
        if not evals:
            return {}
        rounds, window = [r["round"] for r in evals], int(services.cfg.eval.final_window)
        out = {}
        for key in FAIR_METRICS + ("adversary_auc", "postfit_auc"):
            if key.startswith("postfit"):
                value = evals[-1].get(key)
            else:
                value = final_window_mean(rounds, [r.get(key) for r in evals], services.last_main_round, window)
            if value is not None:
                out[key] = value
        return out
