"""Fairness evaluation (LG-FedAvg Table 4): a fair model (``model.name=adult_fair``) is evaluated
on the clients, where the protected attributes live; every evaluation records the mean over
clients of the class ROC-AUC and of the local adversary's AUC per protected attribute, and the
final round asks the clients for the post-fit check (a fresh adversary trained on the frozen
representation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Message
from omegaconf import MISSING, DictConfig

from protocols.base import PaperProtocol
from strategies import ALGORITHMS
from strategies.checks import nonnegative, require
from strategies.common import ClientRuntime
from strategies.services import Services
from task.learning.engine import TrainResult
from task.learning.fairness import ATTRIBUTES, fairness_metrics, postfit_adversary_auc, train_fair
from task.learning.metrics import final_window_mean
from task.learning.models import FairMLP

FAIR_MODEL = "adult_fair"  # the model whose clients train with FairTraining

#: Per-client fairness metrics (client replies) averaged over clients each evaluated round.
FAIR_METRICS = ("class_auc", *(f"{kind}_auc_{a}" for kind in ("adversary", "postfit") for a in ATTRIBUTES))


@dataclass
class FairConfig:
    """``fair.*``: the fair model's training (LG-FedAvg Section 3.3) and its checks."""

    adversarial: bool = MISSING  # train local representations against a local adversary
    lambdas: list[float] = nonnegative()  # penalty weight per protected attribute
    pretrain_epochs: int = nonnegative()  # a new local part's pre-training (Table 4)
    postfit_epochs: int = nonnegative()  # the final post-fit adversary's epochs


class FairTraining:
    """The fair model's local objective on a client (LG-FedAvg Section 3.3): the classifier's loss,
    minus λ times a local adversary's loss with ``fair.adversarial``; its test metrics add class
    and adversary ROC-AUC, and the post-fit check when the round's config asks for it (``postfit``)."""

    def train(self, rt: ClientRuntime, config: ConfigRecord, lr: float | None, salt: int) -> TrainResult:
        server_round = int(config["server-round"])
        return train_fair(rt.model, rt.train, rt.optimizer(server_round, lr), int(rt.cfg.train.batch_size),
                          rt.generator(server_round, salt), int(rt.cfg.train.local_epochs),
                          list(rt.cfg.fair.lambdas), bool(rt.cfg.fair.adversarial))

    def test_metrics(self, rt: ClientRuntime, config: ConfigRecord | None) -> dict[str, float]:
        out = fairness_metrics(rt.model, rt.test, ATTRIBUTES)
        if config is not None and config.get("postfit", False):
            server_round = int(config["server-round"])
            out.update(postfit_adversary_auc(
                rt.model, rt.train, rt.test, ATTRIBUTES, rt.optimizer(server_round),
                int(rt.cfg.train.batch_size), int(rt.cfg.fair.postfit_epochs),
                rt.generator(server_round, salt=0xFA1)))
        return out


class Fairness(PaperProtocol):
    """Fairness metrics of a fair model, from the clients' evaluation replies."""

    name = "fairness"
    config = FairConfig
    section = "fair"

    def smoke(self, cfg: DictConfig) -> dict:
        if cfg.model.name != FAIR_MODEL:
            return {}
        return {"fair.pretrain_epochs": min(int(cfg.fair.pretrain_epochs), 1),
                "fair.postfit_epochs": min(int(cfg.fair.postfit_epochs), 1)}

    def check(self, cfg: DictConfig) -> None:
        fair = [n for n, a in ALGORITHMS.items() if a.trains_fair_model]
        require(cfg.model.name != FAIR_MODEL or ALGORITHMS[cfg.algorithm].trains_fair_model, "model.name",
                f"{FAIR_MODEL} trains with its own objective, which algorithm={cfg.algorithm} does not run; "
                f"algorithms that train it: {', '.join(fair)}")
        local = [n for n, a in ALGORITHMS.items() if a.local_representation]
        require(not cfg.fair.adversarial or ALGORITHMS[cfg.algorithm].local_representation, "fair.adversarial",
                f"the adversarial penalty trains local representations (algorithm={', '.join(local)}), not "
                f"'{cfg.algorithm}': a global model cannot be trained against a local adversary (LG-FedAvg Section 5.3)")

    def client_training(self, cfg: DictConfig) -> FairTraining | None:
        return FairTraining() if cfg.model.name == FAIR_MODEL else None

    def active(self, services: Services) -> bool:
        return isinstance(services.model, FairMLP)

    def clients_evaluate(self, services: Services) -> bool:
        return True

    def evaluate_config(self, server_round: int, services: Services) -> dict:
        return {"postfit": server_round == services.strategy.last_round(int(services.cfg.rounds))}

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
