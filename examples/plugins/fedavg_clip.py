"""fedavg_clip: a plug-in template. Copy this file beside your experiments, rename it, change it.

FedAvg whose server clips the averaged update to norm ``clip.max_norm`` (server-side update
clipping, as in differentially private FedAvg without the noise). Run it with

    flrep run quickstart 'plugins=[fedavg_clip]' algorithm=fedavg_clip clip.max_norm=0.25

from the folder that holds this file (or with that folder on PYTHONPATH). Every process of the
run imports the module named in ``plugins`` before it reads the configuration, so the
``register`` call at the bottom runs in the server and in every client process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ArrayRecord, MetricRecord
from omegaconf import DictConfig

from strategies import Algorithm, register
from strategies.base import TAKE_ALL_NODES, ServerHooks, WeightedAverage, all_keys
from strategies.checks import positive
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config


@dataclass
class ClipConfig:
    """The plug-in's own config section, ``clip.*``, with its defaults (conf/base.yaml has none)."""

    max_norm: float = positive(0.5)  # the largest norm of the averaged update the server applies


class ClippedFedAvg(ServerHooks, WeightedAverage):
    """The server half: FedAvg (weighted as ``train.aggregation`` says, by
    :class:`~strategies.base.WeightedAverage`), then the averaged update scaled down to norm ``max_norm``."""

    def __init__(self, max_norm: float) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.max_norm = max_norm

    def configure_train(self, server_round, arrays, config, grid):
        self.sent = arrays  # the model the update is measured from
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, metrics
        old, new = self.sent.to_torch_state_dict(), arrays.to_torch_state_dict()
        norm = math.sqrt(sum(float(((new[k] - old[k]) ** 2).sum()) for k in new))
        scale = min(1.0, self.max_norm / max(norm, 1e-12))
        return ArrayRecord({k: old[k] + scale * (new[k] - old[k]) for k in new}), metrics


def local_sgd(rt: ClientRuntime, content):
    """The client half: the configured local epochs of SGD from the received model; the new model goes back."""
    rt.load(content[ARRAYS])
    result = rt.local_training(round_config(content))
    return reply(rt.arrays(), train_loss=result.mean_loss, **{NUM_EXAMPLES: len(rt.train)})


def make_strategy(cfg: DictConfig) -> ClippedFedAvg:
    """The server half, from the run's configuration."""
    return ClippedFedAvg(cfg.clip.max_norm).average_as(cfg)


ALGORITHM = register(Algorithm(
    name="fedavg_clip",
    description="FedAvg with the averaged update clipped to clip.max_norm (a plug-in template)",
    make_strategy=make_strategy,
    handlers={"train": local_sgd},
    shared_keys=all_keys,
    config=ClipConfig,
    section="clip",
))
