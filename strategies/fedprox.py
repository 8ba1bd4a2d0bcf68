"""FedProx (Li et al.): FedAvg whose clients minimise f_i(w) + (mu/2)·||w − w_global||².

Server: Flower's FedProx, which puts ``proximal-mu`` into every training round's config, with
FedAvg's hooks (``train.aggregation``, ``fedavg.local_model_accuracy``).
Client: FedAvg's local SGD, which adds the proximal term when ``proximal-mu`` > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.serverapp.strategy import FedProx, Strategy
from omegaconf import DictConfig

from strategies.base import Algorithm, WeightedAverage, all_keys, register
from strategies.fedavg import FedAvgHooks, local_sgd
from strategies.checks import nonnegative


class FedProxServer(FedAvgHooks, FedProx, WeightedAverage):
    """Flower's FedProx: FedAvg that sends ``proximal-mu`` in every training round's config."""


def make_strategy(cfg: DictConfig) -> Strategy:
    """Flower's FedProx with ``fedprox.mu``."""
    return FedProxServer(cfg, proximal_mu=float(cfg.fedprox.mu))


@dataclass
class FedProxConfig:
    """``fedprox.*``."""

    mu: float = nonnegative()  # the proximal weight μ


ALGORITHM = register(Algorithm(
    name="fedprox",
    make_strategy=make_strategy,
    handlers={"train": local_sgd},
    shared_keys=all_keys,
    config=FedProxConfig,
    supports_finetune=True,
))
