"""FedAvg (McMahan et al.) with tau local epochs or exactly tau local steps (tau = 1: D-SGD).

Server: Flower's FedAvg (the average weighted as ``train.aggregation`` says), or FedAvgM /
FedAdam on the averaged update when ``server_opt.name`` asks for a server optimizer.
Client: local SGD from the received global model; with ``proximal-mu`` in the round
config (sent by FedProx's server half) the proximal term is added, where ``proximal-pull`` says.

With ``fedavg.local_model_accuracy`` (FedAvg and FedProx) every training client also scores
its freshly trained model on its own test split (one evaluation pass, reported in the training
reply), and the server records, beside our personalized accuracy (the global model on each
client's test split), the number the official FedRep code prints for FedAvg and FedProx
(main_fedrep.py, "Average accuracy final 10 rounds"): each training client's latest local
model on its test split, the current global model for a client not trained yet, pooled over
the test samples of all training clients.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvgM, Strategy
from omegaconf import MISSING, DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.common import ARRAYS, METRICS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.services import Services
from task.learning.metrics import final_window_mean

SERVER_OPTS = ("none", "fedavgm", "fedadam")
SCORE_LOCAL = "local-accuracy"  # round config: score the trained model on the client's test split
LOCAL_ACCURACY = "local_model_accuracy"  # reply metric and train-record key
LOCAL_TEST_EXAMPLES = "local_test_examples"  # reply metric: the test split it was scored on
OFFICIAL_ACCURACY = "official_local_accuracy"  # eval-record and summary key


class FedAvgHooks(ServerHooks):
    """What FedAvg's server halves (FedAvg, FedAvgM, FedAdam, FedProx) add to Flower's: the
    averaging weights of ``train.aggregation`` and, with ``fedavg.local_model_accuracy``, the
    clients' local-model accuracies (mixed with :class:`WeightedAverage`, last among the bases)."""

    node_keyed = ("local_scores",)

    def __init__(self, cfg: DictConfig, **kwargs: Any) -> None:
        super().__init__(**TAKE_ALL_NODES, **kwargs)
        self.average_as(cfg)
        self.scoring = bool(cfg.fedavg.local_model_accuracy)
        self.final_window = int(cfg.eval.final_window)
        self.local_scores: dict[int, list[float]] = {}  # node id -> [accuracy, test examples] of its latest local model
        self.services: Services | None = None

    def on_start(self, services: Services) -> None:
        self.services = services

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.scoring:
            config[SCORE_LOCAL] = True
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if self.scoring and metrics is not None:
            fresh = self._keep_scores(replies)
            metrics.pop(LOCAL_TEST_EXAMPLES, None)
            if fresh:  # the plain mean over this round's clients (Flower's would weigh them)
                metrics[LOCAL_ACCURACY] = float(np.mean(fresh))
        return arrays, metrics

    def aggregate_skipped(self, server_round: int, replies: Iterable[Message]) -> None:
        """The clients of a skipped round trained all the same: their local models count."""
        if self.scoring:
            self._keep_scores(replies)

    def _keep_scores(self, replies: Iterable[Message]) -> list[float]:
        """Keep each reply's local-model accuracy and test size by node; the accuracies."""
        fresh = []
        for m in replies:
            metrics = m.content[METRICS] if METRICS in m.content else {}
            if LOCAL_ACCURACY in metrics:
                fresh.append(float(metrics[LOCAL_ACCURACY]))
                self.local_scores[m.metadata.src_node_id] = [fresh[-1], float(metrics[LOCAL_TEST_EXAMPLES])]
        return fresh

    def observe_eval(self, server_round: int, record: dict, services: Services) -> None:
        """Add the official code's accuracy: every training client's latest local model (the
        global model for one not trained yet), pooled over test samples."""
        global_accuracy = record.get("client_accuracy")
        if not self.scoring or not global_accuracy:
            return
        s = services
        scored = []
        for pid, node in zip(s.trainable, s.nodes(s.trainable)):
            if node in self.local_scores:
                scored.append(self.local_scores[node])
            elif str(pid) in global_accuracy:
                scored.append([global_accuracy[str(pid)], len(s.data.client_test[pid])])
        total = sum(n for _, n in scored)
        record[OFFICIAL_ACCURACY] = sum(a * n for a, n in scored) / total if total else None

    def summary_extra(self, records: list[dict]) -> dict:
        """Final-window means of the official code's accuracy and of this round's local models."""
        if not self.scoring or self.services is None:
            return {}
        last = self.services.last_main_round

        def final(phase: str, key: str) -> float | None:
            rows = [r for r in records if r["phase"] == phase]
            return final_window_mean([r["round"] for r in rows], [r.get(key) for r in rows], last, self.final_window)

        return {OFFICIAL_ACCURACY: final("eval", OFFICIAL_ACCURACY), LOCAL_ACCURACY: final("train", LOCAL_ACCURACY)}


class FedAvgServer(FedAvgHooks, WeightedAverage):
    """Flower's FedAvg."""


class FedAvgMServer(FedAvgHooks, FedAvgM, WeightedAverage):
    """Flower's FedAvgM: server momentum on the averaged update."""

    checkpointed = ("current_arrays", "momentum_vector")


class FedAdamServer(FedAvgHooks, FedAdam, WeightedAverage):
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
        return FedAvgMServer(cfg, server_learning_rate=opt.lr, server_momentum=opt.momentum)
    if opt.name == "fedadam":
        return FedAdamServer(cfg, eta=opt.lr, eta_l=cfg.train.lr, beta_1=opt.beta_1, beta_2=opt.beta_2, tau=opt.tau)
    return FedAvgServer(cfg)


def local_sgd(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Load the global model, run the local epochs/steps, return the model and metrics (and
    the trained model's accuracy on the local test split when the round config asks)."""
    rt.load(content[ARRAYS])
    config = round_config(content)
    result = rt.local_training(config, prox_mu=float(config.get("proximal-mu", 0.0)),
                               prox_pull=str(config.get("proximal-pull", "gradient")))
    metrics = {"train_loss": result.mean_loss, "local_steps": result.steps, NUM_EXAMPLES: len(rt.train)}
    if config.get(SCORE_LOCAL, False):
        scores = rt.evaluate_local()
        if "accuracy" in scores:
            metrics.update({LOCAL_ACCURACY: scores["accuracy"], LOCAL_TEST_EXAMPLES: scores[NUM_EXAMPLES]})
    return reply(rt.arrays(), **metrics)


@dataclass
class FedAvgConfig:
    """``fedavg.*``: FedAvg's client (also FedProx's)."""

    local_model_accuracy: bool = MISSING  # clients score their trained model; the official code's accuracy


ALGORITHM = register(Algorithm(
    name="fedavg",
    description="the average of the clients' locally trained models (McMahan et al. 2017)",
    make_strategy=make_strategy,
    handlers={"train": local_sgd},
    shared_keys=all_keys,
    config=FedAvgConfig,
    server_opts=SERVER_OPTS,
    supports_finetune=True,
    trains_fair_model=True,
))
