"""New clients (FedRep Figure 6): adapt only a fresh head on the frozen learned representation.

After training, the ServerApp sends each held-out client the shared body (``train.newclient``).
The client puts the run's common initial head on top, trains only the head on its own data
for ``new_clients.epochs`` epochs (body features computed with the frozen body), and reports
its local test accuracy before the first epoch and after every epoch. Nothing is kept.
The same protocol serves every algorithm with a shared representation (FedAvg, FedProx,
FedRep, FedPer; the whole model minus the head for the global-model methods).
"""

from __future__ import annotations

import torch
from flwr.app import RecordDict

from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply
from task.learning.engine import train_head_on_features

SALT = 104729  # keeps new-client shuffles apart from training and fine-tuning


def adapt_head(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Fresh head on the received body; accuracy before and after each head epoch."""
    rt.load(content[ARRAYS])
    own = rt.model.state_dict()
    with torch.no_grad():
        for key in rt.head_keys():
            own[key].copy_(rt.initial_state[key])
    nc = rt.cfg.new_clients
    optimizer = rt.optimizer(lr=nc.lr)
    generator = rt.generator(int(rt.cfg.rounds) + 1, SALT)
    head = rt.head
    metrics = {"accuracy_epoch_0": rt.evaluate_local().get("accuracy", float("nan"))}
    for epoch in range(1, int(nc.epochs) + 1):
        train_head_on_features(rt.model, head, rt.train, optimizer, int(rt.cfg.train.batch_size), generator,
                               epochs=1, regression=rt.regression)
        metrics[f"accuracy_epoch_{epoch}"] = rt.evaluate_local().get("accuracy", float("nan"))
    return reply(None, **metrics, **{NUM_EXAMPLES: len(rt.train)})
