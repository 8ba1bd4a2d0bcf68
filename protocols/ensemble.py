"""New Test (LG-FedAvg Table 1): after training, every client sends its own part once and the
server averages the logits of all local models (each over the current global part) on the
global test set.

It applies to algorithms whose server half answers ``local_part_messages`` (LG-FedAvg's local
parts, Local-only's whole models) and whose clients answer ``query.localpart``. Because it
uploads what otherwise never leaves a client, it runs only when asked (``new_test.enabled``,
on in the configs that reproduce the paper's tables) and says so in the log.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.common.logger import log
from omegaconf import MISSING

from protocols.base import PaperProtocol
from strategies import ALGORITHMS
from strategies.common import ARRAYS, failure_fields, fmt
from strategies.services import Services
from task.learning.engine import predict


@dataclass
class NewTestConfig:
    """``new_test.*``."""

    enabled: bool = MISSING  # upload every client's own part once after training (the paper's New Test)


class NewTest(PaperProtocol):
    """The ensemble of all clients' own models on the global test set."""

    name = "new_test"
    config = NewTestConfig

    def active(self, services: Services) -> bool:
        return bool(services.cfg.new_test.enabled) and "query.localpart" in ALGORITHMS[services.cfg.algorithm].handlers

    def after_training(self, services: Services) -> dict:
        t = int(services.cfg.rounds)
        messages = services.strategy.local_part_messages(t, services)
        if messages is None:
            return {"round": t, "phase": "newtest",
                    "note": "training never left the FedAvg warm start: New Test equals the global accuracy"}
        log(WARNING, "[flrep] New Test (new_test.enabled): %d clients upload their own local part once, which "
            "otherwise never leaves them", len(messages))
        replies, failed = services.send(messages, "newtest")
        evaluator = services.evaluator
        test = evaluator.split(services.data.global_test)
        logits = None
        evaluator.load(services.get_arrays())  # shared part; each reply then replaces the whole own part
        for rep in replies:
            evaluator.load(rep.content[ARRAYS])
            out = predict(evaluator.model, test.x).double()
            logits = out if logits is None else logits + out
        record = {"round": t, "phase": "newtest", "new_test_models": len(replies), **failure_fields(failed)}
        if logits is not None:
            record["new_test_accuracy"] = float((logits.argmax(dim=1) == test.y).double().mean())
            log(INFO, "[flrep] New Test (logits of %d local models averaged): %s", len(replies),
                fmt(record["new_test_accuracy"]))
        return record

    def summary(self, records: list[dict], services: Services) -> dict:
        done = [r for r in records if r["phase"] == "newtest"]
        return {"new_test_accuracy": done[-1].get("new_test_accuracy")} if done else {}
