"""L2GD (Hanzely & Richtárik, 2020): local models pulled toward their average, local steps and
aggregation steps chosen at random, with the FedRep paper's changes.

Every round involves every training client (as the L2GD paper and the official FedRep
``main_l2gd.py``). A seeded coin of the round makes it
- a local step with probability 1 − p (``l2gd.p``): each client trains its own model x_i
  (the run's common initial weights the first time) for the usual local epochs of SGD (the
  FedRep paper: several epochs instead of L2GD's one gradient step) at rate α/(n(1 − p)),
  α = ``l2gd.alpha``, n the number of training clients, and replies with metrics only;
- an aggregation step with probability p: each client sends x_i, the server averages them
  into x̄ (weights: ``train.aggregation``), and every client then moves
  x_i ← (1 − c)·x_i + c·x̄, with c = αλ/(np) (``l2gd.aggregation=paper``, the L2GD paper) or
  c = αλ/(n(1 − p)) (``official``: ``main_l2gd.py`` pulls with its local rate times λ).
The server sends x̄ once to each client, with the next message it sends it (training or
evaluation); the client applies the pull on receipt, once per aggregation round. So the local
models cross the wire in aggregation rounds only: that is L2GD's own step, and nothing else a
client holds leaves it. Evaluation scores each client's own x_i on its local test split; x̄ is
not scored as a global model.

``main_l2gd.py`` starts x̄ from the first client's model divided by n and then adds every
client's, the first one again; we average each model once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig

from strategies.flower_compat import checked_replies
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import below_one, positive, require
from strategies.common import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.services import Services
from strategies.state_store import keep_arrays, kept_arrays, load_kept_model
from task.learning.engine import derived_seed

OWN_MODEL = "local-model"
PULLED = "pulled-average"  # the aggregation round whose average the client's model has absorbed
STEP, LOCAL, AGGREGATE = "l2gd-step", "local", "aggregate"
AVERAGE_ROUND, LOCAL_LR, PULL = "l2gd-average-round", "l2gd-local-lr", "l2gd-pull"
COIN_SALT = 0x1260


class L2GDServer(ServerHooks, WeightedAverage):
    """Chooses each round's step, asks every training client, averages in aggregation steps and
    hands the average to each client once."""

    checkpointed = ("average_round",)
    node_keyed = ("delivered",)

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.average_as(cfg)
        self.seed, self.p = int(cfg.seed), float(cfg.l2gd.p)
        self.alpha, self.lam, self.form = float(cfg.l2gd.alpha), float(cfg.l2gd.lam), str(cfg.l2gd.aggregation)
        self.average_round = 0  # the round of the latest average held in the server's arrays (0: none)
        self.delivered: dict[int, int] = {}  # node id -> the average round it was last sent
        self.services: Services | None = None

    def on_start(self, services: Services) -> None:
        self.services = services
        local_lr, pull = self.rates()
        require(pull <= 1.0, "l2gd.lam", f"the pull toward the average c = {pull:.4g} (l2gd.aggregation={self.form}, "
                f"{len(services.trainable)} clients) must be at most 1; lower l2gd.lam or l2gd.alpha")

    def has_global_model(self, server_round: int) -> bool:
        """x̄ is what the local models are pulled toward, not a model L2GD trains or offers: runs are
        scored, and judged, by the clients' own models."""
        return False

    def is_aggregation(self, server_round: int) -> bool:
        """The round's seeded coin: an aggregation step with probability p."""
        return bool(np.random.default_rng(derived_seed(self.seed, server_round, COIN_SALT)).random() < self.p)

    def rates(self) -> tuple[float, float]:
        """The local rate α/(n(1 − p)) and the pull c toward the average."""
        n = len(self.services.trainable)
        local_lr = self.alpha / (n * (1.0 - self.p))
        pull = self.alpha * self.lam / (n * self.p) if self.form == "paper" else local_lr * self.lam
        return local_lr, pull

    def _messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, nodes: list[int],
                  message_type: str) -> list[Message]:
        """One message per node; the latest average goes to those not yet given it."""
        local_lr, pull = self.rates()
        config.update({"server-round": server_round, AVERAGE_ROUND: self.average_round,
                       LOCAL_LR: local_lr, PULL: pull})
        messages = []
        for node in nodes:
            content = RecordDict({CONFIG: ConfigRecord(dict(config))})
            if self.average_round and self.delivered.get(node, 0) < self.average_round:
                content[ARRAYS] = arrays
                self.delivered[node] = self.average_round
            messages.append(Message(content, dst_node_id=node, message_type=message_type))
        return messages

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.template = arrays
        config[STEP] = AGGREGATE if self.is_aggregation(server_round) else LOCAL
        nodes = self.services.nodes(self.services.trainable)  # every training client, every round
        return self._messages(server_round, arrays, config, nodes, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._messages(server_round, arrays, config, list(grid.get_node_ids()), MessageType.EVALUATE)

    def reply_template(self, message: Message) -> Mapping[str, ArrayRecord]:
        """Clients send their model in aggregation steps and nothing in local steps."""
        return {ARRAYS: self.template} if message.content[CONFIG][STEP] == AGGREGATE else {}

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.is_aggregation(server_round):
            arrays, metrics = super().aggregate_train(server_round, replies)
            if arrays is not None:
                self.average_round = server_round
            return arrays, metrics
        valid, _ = checked_replies(replies, is_train=True)
        contents = [m.content for m in valid if METRICS in m.content]
        return None, (self.train_metrics_aggr_fn(contents, self.weighted_by_key) if contents else None)


def make_strategy(cfg: DictConfig) -> Strategy:
    """L2GD's server half."""
    return L2GDServer(cfg)


def own_model(rt: ClientRuntime, content: RecordDict) -> None:
    """Load the client's x_i (initial weights the first time) and absorb an average it has not yet."""
    load_kept_model(rt, OWN_MODEL)
    config = round_config(content)
    pulled = kept_arrays(rt, PULLED)
    average_round = int(config[AVERAGE_ROUND])
    if ARRAYS not in content or (pulled is not None and int(pulled["round"]) >= average_round):
        return
    pull = float(config[PULL])
    state = rt.model.state_dict()
    with torch.no_grad():
        for key, average in content[ARRAYS].to_torch_state_dict().items():
            if state[key].is_floating_point():
                state[key].mul_(1.0 - pull).add_(average.to(state[key].device), alpha=pull)
    keep_arrays(rt, OWN_MODEL, rt.model.state_dict())
    keep_arrays(rt, PULLED, {"round": torch.tensor([average_round])})


def train_l2gd(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """A local step (train x_i, keep it, send metrics) or an aggregation step (send x_i)."""
    own_model(rt, content)
    config = round_config(content)
    if config[STEP] == AGGREGATE:
        return reply(rt.arrays(), **{NUM_EXAMPLES: len(rt.train)})
    result = rt.local_training(config, lr=float(config[LOCAL_LR]))
    keep_arrays(rt, OWN_MODEL, rt.model.state_dict())
    return reply(None, train_loss=result.mean_loss, local_steps=result.steps, **{NUM_EXAMPLES: len(rt.train)})


def evaluate_own_model(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score the client's own x_i (after absorbing an average sent with this message)."""
    own_model(rt, content)
    return reply(None, **rt.evaluate_local())


@dataclass
class L2GDConfig:
    """``l2gd.*``."""

    p: float = below_one()  # probability of an aggregation step (the FedRep paper: 0.9, local training in 10% of rounds)
    alpha: float = positive()  # α: the local rate is α/(n(1 − p))
    lam: float = positive()  # λ: the pull toward the average
    aggregation: Literal["paper", "official"] = MISSING  # the pull: αλ/(np) (paper) | αλ/(n(1 − p)) (official code)


def check(cfg: DictConfig) -> None:
    """p > 0 (some aggregation)."""
    require(float(cfg.l2gd.p) > 0, "l2gd.p", f"must be in (0, 1): 0 never aggregates, got {cfg.l2gd.p}")


ALGORITHM = register(Algorithm(
    name="l2gd",
    description="one model per client, random steps toward their mean (Hanzely & Richtárik 2020)",
    make_strategy=make_strategy,
    handlers={"train": train_l2gd, "evaluate": evaluate_own_model},
    shared_keys=all_keys,
    config=L2GDConfig,
    check=check,
))
