"""+FT (FedAvg+FT, FedProx+FT, SCAFFOLD+FT; FedPer and FedRep from each client's own head): after
training, each client fine-tunes the final model on its own data.

Server: sends the final global model to every training client (``train.finetune``) and records
the mean local test accuracy before and after fine-tuning (and its spread over clients).
Client: measures its local test accuracy, fine-tunes the head (on body features computed once,
or, as the official FedRep code, in train mode on augmented batches: ``finetune.head_features``)
or the full model (``finetune.part``; in train mode on augmented batches, as local training, with
the FedProx term toward the received model where ``finetune.prox_mu`` > 0, as the official FedRep
code's FedProx+FT) for ``finetune.epochs`` epochs, measures again and keeps the fine-tuned copy
on the client: only metrics go back.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from typing import Literal, Optional

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from omegaconf import MISSING, DictConfig

from protocols.base import PaperProtocol
from strategies import ALGORITHMS
from strategies.checks import nonnegative, one_of, positive, require
from strategies.common import ARRAYS, CONFIG, NUM_EXAMPLES, ClientRuntime, failure_fields, fmt, reply
from strategies.services import Services
from task.learning.engine import PROX_PULLS, train
from task.learning.heads import train_head_in_train_mode, train_head_on_features
from task.learning.metrics import client_spread

SALT = 7919  # keeps fine-tuning shuffles distinct from any training round's


def finetune(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Fine-tune the received model (with the client's own part, where its algorithm keeps one);
    report local test accuracy before and after."""
    rt.load(content[ARRAYS])
    load_personal = ALGORITHMS[rt.cfg.algorithm].load_personal
    if load_personal is not None:
        load_personal(rt)
    ft = rt.cfg.finetune
    before = rt.evaluate_local()
    optimizer = rt.optimizer(int(rt.cfg.rounds), lr=ft.lr)  # null: the final round's rate
    generator = rt.generator(int(rt.cfg.rounds) + 1, SALT)
    batch = int(rt.cfg.train.batch_size)
    if ft.part == "head" and ft.head_features == "train_mode":
        train_head_in_train_mode(rt.model, rt.head, rt.train, optimizer, batch, generator, int(ft.epochs),
                                 rt.regression, augment=rt.augment)
    elif ft.part == "head":
        train_head_on_features(rt.model, rt.head, rt.train, optimizer, batch, generator, int(ft.epochs), rt.regression)
    else:  # the whole model, as local training: train mode, train.augment on every batch
        train(rt.model, rt.train, optimizer, batch, generator, epochs=int(ft.epochs), regression=rt.regression,
              augment=rt.augment, prox_mu=float(ft.prox_mu), prox_pull=str(ft.prox_pull))
    after = rt.evaluate_local()
    rt.state[rt.state_key("finetuned-model")] = rt.arrays()
    metrics = {f"{k}_before": v for k, v in before.items() if k != NUM_EXAMPLES}
    metrics.update({f"{k}_after": v for k, v in after.items() if k != NUM_EXAMPLES})
    return reply(None, **metrics, **{NUM_EXAMPLES: before[NUM_EXAMPLES]})


@dataclass
class FineTuneConfig:
    """``finetune.*``: +FT after training."""

    enabled: bool = MISSING
    part: Literal["head", "full"] = MISSING
    epochs: int = nonnegative()
    lr: Optional[float] = positive()  # null: the final round's rate
    # head fine-tuning: on body features computed once, in eval mode without augmentation (``eval``), or
    # with the whole model in train mode on every (augmented) batch, as the official FedRep code (``train_mode``)
    head_features: Literal["eval", "train_mode"] = MISSING
    # full fine-tuning: the FedProx term (prox_mu/2)·||w − w_received||², its pull entering as ``fedprox.pull``
    # does (the official FedRep code's FedProx+FT keeps its FedProx optimizer: after_momentum); 0: none
    prox_mu: float = nonnegative()
    prox_pull: one_of(PROX_PULLS) = MISSING  # type: ignore[valid-type]


class FineTuning(PaperProtocol):
    """+FT after training, for the algorithms that declare ``supports_finetune``."""

    name = "finetune"
    config = FineTuneConfig
    handlers = {"train.finetune": finetune}

    def smoke(self, cfg: DictConfig) -> dict:
        return {"finetune.epochs": min(int(cfg.finetune.epochs), 1)} if cfg.finetune.enabled else {}

    def check(self, cfg: DictConfig) -> None:
        supported = [n for n, a in ALGORITHMS.items() if a.supports_finetune]
        require(not cfg.finetune.enabled or cfg.algorithm in supported, "finetune.enabled",
                f"+FT is available for {', '.join(supported)}, not '{cfg.algorithm}'")
        require(cfg.finetune.head_features == "eval" or cfg.finetune.part == "head", "finetune.head_features",
                "train_mode applies to head fine-tuning (finetune.part=head)")
        require(cfg.finetune.prox_mu == 0 or cfg.finetune.part == "full", "finetune.prox_mu",
                "the proximal term applies to full fine-tuning (finetune.part=full)")

    def active(self, services: Services) -> bool:
        return bool(services.cfg.finetune.enabled)

    def after_training(self, services: Services) -> dict:
        cfg = services.cfg
        config = ConfigRecord({"epochs": int(cfg.finetune.epochs), "variant": cfg.label})
        content = RecordDict({ARRAYS: services.get_arrays(), CONFIG: config})
        messages = [Message(content, dst_node_id=n, message_type="train.finetune")
                    for n in services.nodes(services.trainable)]
        replies, failed = services.send(messages, "finetune")
        before, after = services.metric_of(replies, "accuracy_before"), services.metric_of(replies, "accuracy_after")
        record = {
            "round": int(cfg.rounds),
            "phase": "finetune",
            "accuracy_before": client_spread(before.values())["mean"] if before else None,
            "accuracy_after": client_spread(after.values())["mean"] if after else None,
            "accuracy_after_std": client_spread(after.values())["std"] if after else None,
            "accuracy_after_worst10": client_spread(after.values())["worst10"] if after else None,
            "client_accuracy_after": {str(k): v for k, v in sorted(after.items())},
            **failure_fields(failed),
        }
        log(INFO, "[flrep] +FT: personalized acc before %s, after %s fine-tuning",
            fmt(record["accuracy_before"]), fmt(record["accuracy_after"]))
        return record

    def summary(self, records: list[dict], services: Services) -> dict:
        done = [r for r in records if r["phase"] == "finetune"]
        if not done:
            return {}
        last = done[-1]
        return {"finetune_accuracy_before": last["accuracy_before"], "finetune_accuracy_after": last["accuracy_after"],
                "finetune_accuracy_after_std": last["accuracy_after_std"],
                "finetune_accuracy_after_worst10": last["accuracy_after_worst10"]}

