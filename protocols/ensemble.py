"""New Test (LG-FedAvg Table 1): after training, every client sends its own part once and the
server averages the outputs of all local models (each over the current global part) on the
global test set: their outputs as they are (logits; probabilities under ``model.output=softmax``)
or the softmax of their logits (``new_test.average``). Each client sends its final model, or with
``new_test.models=best`` the model of its best Local Test evaluation, chosen on its own test split
(the official main_local.py; algorithms that declare ``new_test_best``; LG-FedAvg's clients send
main_lg.py's selected models, see :mod:`strategies.lg_fedavg`).

It applies to algorithms whose server half answers ``local_part_messages`` (LG-FedAvg's local
parts, Local-only's whole models) and whose clients answer ``query.localpart``. Because it
uploads what otherwise never leaves a client, it runs only when asked (``new_test.enabled``,
on in the configs that reproduce the paper's tables) and says so in the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Literal

import torch
from flwr.common.logger import log
from omegaconf import MISSING, DictConfig

from protocols.base import PaperProtocol
from strategies import ALGORITHMS
from strategies.checks import require
from strategies.common import ARRAYS, failure_fields, fmt
from strategies.services import Services
from task.learning.inference import predict


@dataclass
class NewTestConfig:
    """``new_test.*``."""

    enabled: bool = MISSING  # upload every client's own part once after training (the paper's New Test)
    average: Literal["logits", "softmax"] = MISSING  # the models' outputs as they are, or their softmax
    models: Literal["final", "best"] = MISSING  # each client's final model, or its best evaluated one (official main_local.py)


#: ``new_test.average`` -> the transform of each model's logits before they are averaged. Averaging
#: log-softmax outputs (the official code's CNNs) ranks classes exactly as averaging logits: per
#: sample, the two differ by the models' mean log-partition, the same for every class.
AVERAGED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "logits": lambda z: z,
    "softmax": lambda z: z.softmax(dim=1),
}


def ensemble_predictions(outputs: Iterable[torch.Tensor], average: str) -> torch.Tensor | None:
    """The ensemble's class per sample from each model's logits (N, classes), averaged as
    ``average`` says (a running sum: one model's outputs in memory at a time); None without models."""
    transform, total = AVERAGED[average], None
    for z in outputs:
        total = transform(z.double()) if total is None else total + transform(z.double())
    return None if total is None else total.argmax(dim=1)


class NewTest(PaperProtocol):
    """The ensemble of all clients' own models on the global test set."""

    name = "new_test"
    config = NewTestConfig

    def check(self, cfg: DictConfig) -> None:
        """Softmax averaging of models whose outputs are already probabilities would apply softmax
        twice; ``models=best`` needs clients that keep their best evaluated model."""
        require(cfg.new_test.models == "final" or ALGORITHMS[cfg.algorithm].new_test_best, "new_test.models",
                f"best (each client's model of its best Local Test evaluation) is kept by the clients of "
                f"{', '.join(n for n, a in ALGORITHMS.items() if a.new_test_best)}, not by {cfg.algorithm}'s")
        require(cfg.new_test.average == "logits" or cfg.model.output == "logits", "new_test.average",
                "model.output=softmax already outputs probabilities, which average=logits averages as they are "
                "(the official ensemble); average=softmax would apply softmax to them again")

    def active(self, services: Services) -> bool:
        return bool(services.cfg.new_test.enabled) and "query.localpart" in ALGORITHMS[services.cfg.algorithm].handlers

    def after_training(self, services: Services) -> dict:
        t = services.last_main_round
        messages = services.strategy.local_part_messages(t, services)
        if messages is None:
            return {"round": t, "phase": "newtest",
                    "note": "training never left the FedAvg warm start: New Test equals the global accuracy"}
        log(WARNING, "[flrep] New Test (new_test.enabled): %d clients upload their own local part once, which "
            "otherwise never leaves them", len(messages))
        replies, failed = services.send(messages, "newtest")
        evaluator = services.evaluator
        test = evaluator.split(services.data.global_test)
        evaluator.load(services.get_arrays())  # shared part; each reply then replaces the whole own part

        def outputs() -> Iterator[torch.Tensor]:
            for rep in services.progress(replies, "New Test: the local models' outputs", len(replies), "model"):
                evaluator.load(rep.content[ARRAYS])
                yield predict(evaluator.model, test.x)

        average = str(services.cfg.new_test.average)
        predicted = ensemble_predictions(outputs(), average)
        record = {"round": t, "phase": "newtest", "new_test_models": len(replies), "new_test_average": average,
                  **failure_fields(failed)}
        if predicted is not None:
            record["new_test_accuracy"] = float((predicted == test.y).double().mean())
            log(INFO, "[flrep] New Test (%s of %d local models averaged): %s", average, len(replies),
                fmt(record["new_test_accuracy"]))
        return record

    def summary(self, records: list[dict], services: Services) -> dict:
        done = [r for r in records if r["phase"] == "newtest"]
        return {"new_test_accuracy": done[-1].get("new_test_accuracy")} if done else {}
