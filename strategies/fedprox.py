"""FedProx (Li et al.): FedAvg whose clients minimise f_i(w) + (mu/2)·||w − w_global||².

Server: Flower's FedProx, which puts ``proximal-mu`` into every training round's config, plus
``proximal-pull`` (``fedprox.pull``), with FedAvg's hooks (``train.aggregation``,
``fedavg.local_model_accuracy``).
Client: FedAvg's local SGD, which adds the proximal term when ``proximal-mu`` > 0, its pull
μ(w − w_global) entering where ``proximal-pull`` says: ``gradient`` (the objective's gradient, which
the client's momentum carries: the paper) or ``after_momentum`` (the official FedRep code's FedProx
optimizer, which adds it after momentum, so at momentum β the same μ pulls 1/(1 − β) times less at
steady state).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedProx, Strategy
from omegaconf import MISSING, DictConfig

from strategies.base import Algorithm, WeightedAverage, all_keys, register
from strategies.fedavg import FedAvgHooks, local_sgd
from strategies.checks import nonnegative, one_of
from task.learning.engine import PROX_PULLS


class FedProxServer(FedAvgHooks, FedProx, WeightedAverage):
    """Flower's FedProx: FedAvg that sends ``proximal-mu`` (and ``proximal-pull``) in every
    training round's config."""

    def __init__(self, cfg: DictConfig, **kwargs: Any) -> None:
        super().__init__(cfg, **kwargs)
        self.pull = str(cfg.fedprox.pull)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        config["proximal-pull"] = self.pull
        return super().configure_train(server_round, arrays, config, grid)


def make_strategy(cfg: DictConfig) -> Strategy:
    """Flower's FedProx with ``fedprox.mu`` and ``fedprox.pull``."""
    return FedProxServer(cfg, proximal_mu=float(cfg.fedprox.mu))


@dataclass
class FedProxConfig:
    """``fedprox.*``."""

    mu: float = nonnegative()  # the proximal weight μ
    pull: one_of(PROX_PULLS) = MISSING  # type: ignore[valid-type]  # where μ(w − w_global) enters the local step


ALGORITHM = register(Algorithm(
    name="fedprox",
    description="FedAvg with a proximal pull of local training toward the global model (Li et al. 2020)",
    make_strategy=make_strategy,
    handlers={"train": local_sgd},
    shared_keys=all_keys,
    config=FedProxConfig,
    supports_finetune=True,
))
