"""Local-only: every client trains its own model on its own data; nothing is averaged.

Server: sends the round config only and aggregates the clients' training metrics. Which
clients train each round is ``local_only.clients``: ``sampled`` (the round's sampled clients,
as every algorithm here) or ``all`` (every training client, every round: the official
LG-FedAvg and FedRep ``main_local.py``, which train each client for all epochs).
Client: keeps its whole model in ``context.state`` across rounds (starting from the run's
common initial weights) and sends back metrics only. +FT (``finetune.part=full``) trains that
own model further: with ``finetune.epochs=5`` the official FedRep ``--alg maml`` final round.
New Test (``new_test.enabled``): every client sends its own model once; with
``new_test.models=best`` the model of its best Local Test evaluation (chosen on its test split,
the earliest of ties), as the official LG-FedAvg main_local.py. The summary gives each client's
best evaluated accuracy too (``local_test_best_over_rounds``), that code's Local Test.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from omegaconf import MISSING, DictConfig

from strategies.flower_compat import checked_replies, messages_to
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, register
from strategies.common import CONFIG, METRICS, NUM_EXAMPLES, ClientRuntime, best_over_rounds, reply, round_config
from strategies.services import Services
from strategies.state_store import keep_arrays, kept_arrays, load_kept_model

STATE_KEY = "local-model"
BEST_MODEL_KEY = "best-local-test-model"  # new_test.models=best: the model of the best Local Test so far ...
BEST_ACCURACY_KEY = "best-local-test"  # ... and its accuracy


class LocalOnly(ServerHooks, FedAvg):
    """Sends configs without arrays (to the sampled clients, or with ``all_clients`` to every
    training client as well); aggregates metrics, returns no arrays."""

    def __init__(self, all_clients: bool = False) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.all_clients = all_clients
        self.services: Services | None = None

    def on_start(self, services: Services) -> None:
        self.services = services

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        config["server-round"] = server_round
        record = RecordDict({CONFIG: config})
        nodes = list(grid.get_node_ids())
        if self.all_clients and self.services is not None:
            nodes += [n for n in self.services.nodes(self.services.trainable) if n not in nodes]
        return messages_to(record, nodes, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = checked_replies(replies, is_train=True)
        contents = [m.content for m in valid if METRICS in m.content]
        if not contents:
            return None, None
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        if self.all_clients:
            metrics["trained_clients"] = len(contents)
        return None, metrics

    def local_part_messages(self, server_round: int, services: Services) -> list[Message]:
        """New Test (LG-FedAvg Table 1's Local-only row): every client sends its own model once."""
        return own_model_requests(services)

    def summary_extra(self, records: list[dict]) -> dict:
        return best_evaluated_rounds(records)


def best_evaluated_rounds(records: list[dict]) -> dict:
    """The official main_local.py's (and main_mtl.py's) Local Test: each client's best evaluated
    round, the earliest of ties."""
    return best_over_rounds([r for r in records if r["phase"] == "eval"], latest_on_ties=False)


def own_model_requests(services: Services) -> list[Message]:
    """New Test of whole local models: ask every training client for its own model once."""
    config = ConfigRecord({"variant": services.cfg.label})
    return [Message(RecordDict({CONFIG: config}), dst_node_id=n, message_type="query.localpart")
            for n in services.nodes(services.trainable)]


def make_strategy(cfg: DictConfig) -> Strategy:
    """The Local-only server half."""
    return LocalOnly(all_clients=cfg.local_only.clients == "all")


def train_locally(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Train the client's own model for the configured local epochs and keep it."""
    load_kept_model(rt, STATE_KEY)
    result = rt.local_training(round_config(content))
    keep_arrays(rt, STATE_KEY, rt.model.state_dict())
    return reply(None, train_loss=result.mean_loss, local_steps=result.steps, **{NUM_EXAMPLES: len(rt.train)})


def evaluate_own_model(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Evaluate the client's own model on its local test split (and keep it if it is the best
    so far, when New Test asks for each client's best model)."""
    load_kept_model(rt, STATE_KEY)
    metrics = rt.evaluate_local()
    if keeps_best_model(rt.cfg):
        keep_if_best(rt, metrics["accuracy"])
    return reply(None, **metrics)


def keeps_best_model(cfg: DictConfig) -> bool:
    """Whether New Test asks for each client's best evaluated model (``new_test.models=best``)."""
    return bool(cfg.new_test.enabled) and cfg.new_test.models == "best"


def keep_if_best(rt: ClientRuntime, accuracy: float) -> None:
    """Keep the current model as this client's best if its Local Test accuracy beats every earlier
    one (strictly: the earliest of ties, as the official main_local.py)."""
    best = kept_arrays(rt, BEST_ACCURACY_KEY)  # in the same store as the model: a restarted node finds both
    if best is None or accuracy > float(best["accuracy"]):
        keep_arrays(rt, BEST_MODEL_KEY, rt.model.state_dict())
        keep_arrays(rt, BEST_ACCURACY_KEY, {"accuracy": torch.tensor(float(accuracy), dtype=torch.float64)})


def load_own_model(rt: ClientRuntime) -> None:
    """+FT starts from the client's own model (there is no global one)."""
    load_kept_model(rt, STATE_KEY)


def send_own_model(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """New Test: send the client's own model to the server once: its final one, or with
    ``new_test.models=best`` the one of its best Local Test evaluation (final if never evaluated)."""
    if not (keeps_best_model(rt.cfg) and load_kept_model(rt, BEST_MODEL_KEY)):
        load_kept_model(rt, STATE_KEY)
    return reply(rt.arrays(), **{NUM_EXAMPLES: len(rt.train)})


@dataclass
class LocalOnlyConfig:
    """``local_only.*``."""

    clients: Literal["sampled", "all"] = MISSING  # who trains each round


ALGORITHM = register(Algorithm(
    name="local_only",
    description="every client trains alone, nothing is shared (baseline)",
    make_strategy=make_strategy,
    handlers={"train": train_locally, "evaluate": evaluate_own_model, "query.localpart": send_own_model},
    shared_keys=None,
    config=LocalOnlyConfig,
    supports_finetune=True,
    load_personal=load_own_model,
    new_test_best=True,
))
