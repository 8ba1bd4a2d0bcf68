"""Local from average: each client trains its own model; its first one is the average of the
models trained in the last round. This is what the official FedRep code runs for Per-FedAvg
(``main_fedrep.py --alg maml``): it never calls ``LocalUpdateMAML``, trains every layer of each
sampled client's own last model with plain SGD, and a client not trained yet holds the global
model, because its ``w_locals`` entry aliases the global model's tensors until its first update.

Server: the average of the round's trained models (``train.aggregation``), sent to the sampled
clients (a first model) and at evaluation. Client: trains its own model if it has one, else
the received average, keeps it and sends it back. Evaluation and +FT (``finetune.part=full``,
with ``finetune.epochs=5`` the official script's final round) use the client's own model, or
the average for a client not trained yet, as the official code does.
Unlike Local-only, each client's model crosses the wire every round it trains.
"""

from __future__ import annotations

from flwr.app import RecordDict
from flwr.serverapp.strategy import Strategy
from omegaconf import DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.state_store import keep_arrays, kept_arrays

OWN_MODEL = "own-model"


class LocalFromAverageServer(ServerHooks, WeightedAverage):
    """The average of the round's trained models, sent as a first model."""


def make_strategy(cfg: DictConfig) -> Strategy:
    """The server half: Flower's FedAvg."""
    return LocalFromAverageServer(**TAKE_ALL_NODES).average_as(cfg)


def load_own_model(rt: ClientRuntime) -> None:
    """Put the client's own model over the received average (kept as is for a client not trained yet)."""
    own = kept_arrays(rt, OWN_MODEL)
    if own is not None:
        rt.model.load_state_dict(own)


def train_own_model(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Train the own model (the first time: the received average); keep it and send it."""
    rt.load(content[ARRAYS])
    load_own_model(rt)
    result = rt.local_training(round_config(content))
    keep_arrays(rt, OWN_MODEL, rt.model.state_dict())
    return reply(rt.arrays(), train_loss=result.mean_loss, local_steps=result.steps, **{NUM_EXAMPLES: len(rt.train)})


def evaluate_own_model(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score the own model (or the received average) on the local test split."""
    rt.load(content[ARRAYS])
    load_own_model(rt)
    return reply(None, **rt.evaluate_local())


ALGORITHM = register(Algorithm(
    name="local_from_average",
    description="own models, a client's first one the last round's average (the official FedRep code's --alg maml)",
    make_strategy=make_strategy,
    handlers={"train": train_own_model, "evaluate": evaluate_own_model},
    shared_keys=all_keys,
    supports_finetune=True,
    load_personal=load_own_model,
))
