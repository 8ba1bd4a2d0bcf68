"""New clients (FedRep Figure 6): held-out clients adapt only a fresh head on the frozen learned
representation.

Server: after training, sends each held-out client (``data.num_new_clients``) the shared body
(``train.newclient``) and records the mean local test accuracy after each head epoch.
Client: puts the run's common initial head on the received body, trains only the head on its
own data for ``new_clients.epochs`` epochs (body features computed once) and reports its local
test accuracy before the first epoch and after every epoch. Nothing is kept. It serves every
algorithm with a shared representation (for the global-model methods: the model minus its head).
Algorithms that train no shared model (Local-only, FedProto, FedAMP, Fed-MTL) leave their
held-out clients out of training and report no new-client accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from typing import Optional

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from omegaconf import DictConfig

from protocols.base import PaperProtocol
from strategies.checks import nonnegative, positive
from strategies import ALGORITHMS
from strategies.common import ARRAYS, CONFIG, NUM_EXAMPLES, ClientRuntime, body_keys, failure_fields, fmt, reply
from strategies.services import Services
from task.learning.heads import train_head_on_features
from task.learning.metrics import client_spread

SALT = 104729  # keeps new-client shuffles apart from training and fine-tuning


def adapt_head(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Fresh head on the received body; accuracy before and after each head epoch."""
    rt.load(content[ARRAYS])
    own = rt.model.state_dict()
    with torch.no_grad():
        for key in rt.head_keys():
            own[key].copy_(rt.initial_state[key])
    nc = rt.cfg.new_clients
    optimizer = rt.optimizer(int(rt.cfg.rounds), lr=nc.lr)  # null: the final round's rate
    generator = rt.generator(int(rt.cfg.rounds) + 1, SALT)
    metrics = {"accuracy_epoch_0": rt.evaluate_local().get("accuracy", float("nan"))}
    for epoch in range(1, int(nc.epochs) + 1):
        train_head_on_features(rt.model, rt.head, rt.train, optimizer, int(rt.cfg.train.batch_size), generator,
                               epochs=1, regression=rt.regression)
        metrics[f"accuracy_epoch_{epoch}"] = rt.evaluate_local().get("accuracy", float("nan"))
    return reply(None, **metrics, **{NUM_EXAMPLES: len(rt.train)})


@dataclass
class NewClientsConfig:
    """``new_clients.*``: head adaptation of the held-out clients (and the linear model's new tasks)."""

    epochs: int = nonnegative()
    lr: Optional[float] = positive()  # null: the final round's rate
    samples: list[int] = positive()  # synthetic_linear: samples of each new task
    tasks: int = positive()  # synthetic_linear: new tasks per sample count


class NewClients(PaperProtocol):
    """Head-only adaptation of the held-out clients after training."""

    name = "new_clients"
    config = NewClientsConfig
    handlers = {"train.newclient": adapt_head}

    def smoke(self, cfg: DictConfig) -> dict:
        return {"new_clients.epochs": min(int(cfg.new_clients.epochs), 1)} if cfg.data.num_new_clients else {}

    def active(self, services: Services) -> bool:
        if not services.data.new_clients or "B_star" in services.data.bundle.meta:
            return False
        algorithm = ALGORITHMS[services.cfg.algorithm]
        trained = algorithm.trained_global_keys or algorithm.shared_keys
        if trained is None or not trained(services.model, services.cfg):
            log(INFO, "[flrep] new clients: %s trains no shared model for them to adapt; the %d held-out clients "
                "stay out of training and have no new-client accuracy", algorithm.name, len(services.data.new_clients))
            return False
        return True

    def after_training(self, services: Services) -> dict:
        cfg, arrays = services.cfg, services.get_arrays()
        body = body_keys(services.model, cfg)
        config = ConfigRecord({"epochs": int(cfg.new_clients.epochs), "variant": cfg.label})
        content = RecordDict({ARRAYS: ArrayRecord({k: arrays[k] for k in arrays if k in body}), CONFIG: config})
        messages = [Message(content, dst_node_id=n, message_type="train.newclient")
                    for n in services.nodes(services.data.new_clients)]
        replies, failed = services.send(messages, "newclient")
        curve = []
        for epoch in range(int(cfg.new_clients.epochs) + 1):
            accs = services.metric_of(replies, f"accuracy_epoch_{epoch}")
            curve.append(client_spread(accs.values())["mean"] if accs else None)
        last = services.metric_of(replies, f"accuracy_epoch_{int(cfg.new_clients.epochs)}")
        log(INFO, "[flrep] new clients (%d): head-only accuracy by epoch %s", len(messages),
            " ".join(fmt(a) for a in curve))
        return {"round": int(cfg.rounds), "phase": "newclients", "newclient_accuracy_by_epoch": curve,
                "client_accuracy": {str(k): v for k, v in sorted(last.items())}, **failure_fields(failed)}

    def summary(self, records: list[dict], services: Services) -> dict:
        out: dict = {}
        for record in records:
            if record["phase"] == "newclients" and "newclient_accuracy_by_epoch" in record:
                out["newclient_accuracy"] = record["newclient_accuracy_by_epoch"][-1]
                out["newclient_accuracy_by_epoch"] = record["newclient_accuracy_by_epoch"]
        return out
