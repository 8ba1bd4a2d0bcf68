"""FedAvg (McMahan et al.) with tau local epochs or exactly tau local steps (tau = 1: D-SGD).

Server: Flower's FedAvg (example-weighted average), or FedAvgM / FedAdam on the averaged
update when ``server_opt.name`` asks for a server optimizer.
Client: local SGD from the received global model; with ``proximal-mu`` in the round
config (sent by FedProx's server half) the proximal term is added.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, Strategy
from omegaconf import DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, all_keys, register
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config

SERVER_OPTS = ("none", "fedavgm", "fedadam")


class FedAvgServer(ServerHooks, FedAvg):
    """Flower's FedAvg (example-weighted average of the replies)."""


class FedAvgMServer(ServerHooks, FedAvgM):
    """Flower's FedAvgM: server momentum on the averaged update."""

    checkpointed = ("current_arrays", "momentum_vector")


class FedAdamServer(ServerHooks, FedAdam):
    """Flower's FedAdam on the averaged update; the new global arrays keep the dtypes of the
    model (Flower's FedAdam computes in float64, whose arrays the clients' float32 replies
    would then no longer match)."""

    checkpointed = ("current_arrays", "m_t", "v_t")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.dtypes = {k: a.dtype for k, a in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            arrays = ArrayRecord({k: Array(a.numpy().astype(self.dtypes.get(k, a.dtype))) for k, a in arrays.items()})
        return arrays, metrics


def make_strategy(cfg: DictConfig) -> Strategy:
    """FedAvg, or Flower's FedAvgM / FedAdam when a server optimizer is configured."""
    opt = cfg.server_opt
    if opt.name == "fedavgm":
        return FedAvgMServer(**TAKE_ALL_NODES, server_learning_rate=opt.lr, server_momentum=opt.momentum)
    if opt.name == "fedadam":
        return FedAdamServer(**TAKE_ALL_NODES, eta=opt.lr, eta_l=cfg.train.lr, beta_1=opt.beta_1, beta_2=opt.beta_2,
                             tau=opt.tau)
    return FedAvgServer(**TAKE_ALL_NODES)


def local_sgd(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Load the global model, run the local epochs/steps, return the model and metrics."""
    rt.load(content[ARRAYS])
    config = round_config(content)
    result = rt.local_training(config, prox_mu=float(config.get("proximal-mu", 0.0)))
    metrics = {"train_loss": result.mean_loss, "local_steps": result.steps, NUM_EXAMPLES: len(rt.train)}
    return reply(rt.arrays(), **metrics)


ALGORITHM = register(Algorithm(
    name="fedavg",
    make_strategy=make_strategy,
    handlers={"train": local_sgd},
    shared_keys=all_keys,
    server_opts=SERVER_OPTS,
    supports_finetune=True,
))
