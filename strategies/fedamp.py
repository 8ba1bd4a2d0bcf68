"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, AAAI 2021): federated attentive message passing.

Every client i has its own model w_i. The server keeps the latest uploaded model of every client
and sends client i its personalised cloud model u_i = Σ_j ξ_ij·w_j with ξ_ij = α_k·A'(‖w_i − w_j‖²)
for j ≠ i, A'(x) = e^(−x/σ)/σ (the derivative of A(x) = 1 − e^(−x/σ)), and ξ_ii = 1 − Σ_{j≠i} ξ_ij:
similar clients attend to each other more. Nothing keeps ξ_ii ≥ 0: with many close models and
α_k/σ large, u_i extrapolates (each train record logs ``self_attention_mean`` and ``_min``).
Client: trains its own w_i (the run's initial weights the first time) on
f_i(w) + λ/(2α_k)·‖w − u_i‖² (the pull (λ/α_k)(w − u_i) enters the gradient, so the client's
momentum carries it), keeps w_i and uploads it. Evaluation (no arrays sent): each client scores its
own w_i on its local test split (a never-sampled client: the initial weights).

What crosses: down u_i, a mixture of models (never another client's raw w_j alone once more than
one client has uploaded); up w_i. The server holds every client's latest parameters (one float
vector per client: clients × model size), the whole federation's personal models, by the method's
design. Only parameters are sent, mixed and measured; buffers (batch-norm statistics) stay with
the client's model.

The paper has every client train every round; here the round's sampled clients do, and u_i is
computed when client i is sampled from what the server holds then (``fedamp.peers``: ``all``,
every training client, one that has not uploaded yet at the run's initial weights as the paper's
W⁰ | ``last_round``, PFLlib ``servers/serveramp.py``: only the models uploaded in the previous
training round, client i's own stored model weighted ξ_ii). ``fedamp.penalty``: ``paper`` |
``official``: PFLlib's ``clients/clientamp.py`` (since March 2023) adds 0.5·λ/α_k·‖w − u_i‖,
unsquared and built from detached weights (``p.data``), so it has no gradient and the client
trains f_i alone (its earlier versions had the paper's squared term). The defaults α_k = λ = σ = 1
are PFLlib's (its help calls α_k "λ/√(global iterations) according to the paper"); the paper's tuned
values are lost from our copy. Not implemented: HeurFedAMP (the paper's cosine-similarity heuristic).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from omegaconf import MISSING, DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, register
from strategies.checks import nonnegative, positive
from strategies.common import ARRAYS, CONFIG, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.flower_compat import checked_replies
from strategies.state_store import keep_arrays, load_kept_model
from task.learning.split_model import SplitModel

OWN_MODEL = "own-model"


def parameter_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """The model's parameters: what the server holds, mixes and sends."""
    return [name for name, _ in model.named_parameters()]


def no_global_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """The server's arrays stay the run's initial weights: no trained global model."""
    return []


def flat(record: ArrayRecord, keys: list[str]) -> np.ndarray:
    """The arrays of ``keys`` as one vector."""
    return np.concatenate([record[k].numpy().ravel() for k in keys])


def unflat(vector: np.ndarray, like: ArrayRecord) -> ArrayRecord:
    """``vector`` cut into arrays of ``like``'s keys, shapes and dtypes."""
    out, start = {}, 0
    for key, array in like.items():
        a = array.numpy()
        out[key] = Array(vector[start:start + a.size].reshape(a.shape).astype(a.dtype))
        start += a.size
    return ArrayRecord(out)


def square_distances(own: np.ndarray, peers: list[np.ndarray]) -> np.ndarray:
    """‖w_i − w_j‖² for each peer model w_j of ``own`` = w_i (in float64)."""
    own64 = own.astype(np.float64)
    return np.array([float(np.square(own64 - w).sum()) for w in peers])


def attention(sq: np.ndarray, alpha_k: float, sigma: float) -> np.ndarray:
    """ξ_ij = α_k·A'(‖w_i − w_j‖²) = α_k·e^(−‖w_i − w_j‖²/σ)/σ."""
    return alpha_k * np.exp(-sq / sigma) / sigma


def cloud_model(own: np.ndarray, peers: list[np.ndarray], counts: list[int], alpha_k: float,
                sigma: float) -> tuple[np.ndarray, float]:
    """u_i = ξ_ii·w_i + Σ_j ξ_ij·w_j (peer j standing for ``counts[j]`` clients with that model) and ξ_ii.
    Summed nearest peer first: an order of the values, not of node ids (a resumed run renumbers them)."""
    sq = square_distances(own, peers)
    order = np.argsort(sq, kind="stable")
    xi = (attention(sq, alpha_k, sigma) * np.asarray(counts, dtype=np.float64))[order]
    self_weight = 1.0 - float(xi.sum())
    u = self_weight * own.astype(np.float64)
    for weight, j in zip(xi, order):
        u += weight * peers[j]
    return u.astype(own.dtype), self_weight


class FedAMPServer(ServerHooks, FedAvg):
    """Keeps every client's latest model; sends each sampled client its cloud model u_i."""

    node_keyed = ("models", "last_uploaders")

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.alpha_k, self.sigma = float(cfg.fedamp.alpha_k), float(cfg.fedamp.sigma)
        self.every_client = cfg.fedamp.peers == "all"
        self.models: dict[int, np.ndarray] = {}  # node id -> its latest uploaded parameters, one vector
        self.last_uploaders: set[int] = set()  # the nodes whose models the previous training round stored
        self.population: set[int] = set()  # every training client's node id
        self.keys: list[str] = []  # the order of a stored vector (the server's arrays', set each round)
        self.self_weights: list[float] = []  # ξ_ii of this round's messages (for its record)

    def observe_population(self, sizes: dict[int, int]) -> None:
        self.population = set(sizes)

    def has_global_model(self, server_round: int) -> bool:
        """Only personal models exist."""
        return False

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.keys = list(arrays.keys())
        initial = flat(arrays, self.keys)
        sampled = list(grid.get_node_ids())
        pool = (self.population | set(sampled)) if self.every_client else self.last_uploaders
        config["server-round"] = server_round
        messages, self.self_weights = [], []
        for node in sampled:
            others = sorted(n for n in pool if n != node)
            stored = [self.models[n] for n in others if n in self.models]
            fresh = len(others) - len(stored)  # peers that have not uploaded: the run's initial weights
            peers, counts = stored + [initial] * bool(fresh), [1] * len(stored) + [fresh] * bool(fresh)
            u, self_weight = cloud_model(self.models.get(node, initial), peers, counts, self.alpha_k, self.sigma)
            self.self_weights.append(self_weight)
            messages.append(Message(RecordDict({ARRAYS: unflat(u, arrays), CONFIG: config}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return messages

    def _store(self, replies: Iterable[Message]) -> list[Message]:
        valid, _ = checked_replies(replies, is_train=True, weighted_by_key=self.weighted_by_key)
        for m in valid:
            self.models[m.metadata.src_node_id] = flat(m.content[ARRAYS], self.keys)
        self.last_uploaders = {m.metadata.src_node_id for m in valid}
        return valid

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Store the replying clients' models; average their metrics (the server's arrays stay)."""
        valid = self._store(replies)
        if not valid:
            return None, None
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        metrics["self_attention_mean"] = float(np.mean(self.self_weights))
        metrics["self_attention_min"] = float(np.min(self.self_weights))
        return None, metrics

    def aggregate_skipped(self, server_round: int, replies: Iterable[Message]) -> None:
        """The replying clients of a skipped round kept their trained models: the server stores them too."""
        self._store(replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return super().configure_evaluate(server_round, ArrayRecord(), config, grid)


def make_strategy(cfg: DictConfig) -> Strategy:
    """FedAMP's server half."""
    return FedAMPServer(cfg)


def train_fedamp(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Local epochs of the kept w_i on f_i + λ/(2α_k)‖w − u_i‖² (``official``: f_i alone); keep w_i, send it."""
    names = parameter_keys(rt.model, rt.cfg)
    cloud = content[ARRAYS].to_torch_state_dict()
    if set(cloud) != set(names):
        raise ValueError(f"expected a cloud model of the parameters {names}, got {sorted(cloud)}")
    load_kept_model(rt, OWN_MODEL)
    c = rt.cfg.fedamp
    pull = float(c.lam) / float(c.alpha_k) if c.penalty == "paper" else 0.0
    result = rt.local_training(round_config(content), prox_mu=pull, prox_anchor=[cloud[n] for n in names])
    keep_arrays(rt, OWN_MODEL, rt.model.state_dict())
    return reply(rt.arrays(names), train_loss=result.mean_loss, local_steps=result.steps,
                 **{NUM_EXAMPLES: len(rt.train)})


def evaluate_own(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score the client's own w_i on its local test split."""
    load_kept_model(rt, OWN_MODEL)
    return reply(None, **rt.evaluate_local())


@dataclass
class FedAMPConfig:
    """``fedamp.*``."""

    alpha_k: float = positive()  # α_k: ξ_ij = α_k·A'(‖w_i − w_j‖²); the client's pull is λ/α_k
    lam: float = nonnegative()  # λ: the weight of the attention regulariser
    sigma: float = positive()  # σ of A(x) = 1 − e^(−x/σ)
    penalty: Literal["paper", "official"] = MISSING  # the pull λ/α_k·(w − u_i) | PFLlib's gradient-free term
    peers: Literal["all", "last_round"] = MISSING  # u_i mixes every client's latest model | the last round's uploads


ALGORITHM = register(Algorithm(
    name="fedamp",
    description="personal models pulled toward attention-weighted mixtures of similar clients' models (Huang et al. 2021)",
    make_strategy=make_strategy,
    handlers={"train": train_fedamp, "evaluate": evaluate_own},
    shared_keys=parameter_keys,
    trained_global_keys=no_global_keys,
    config=FedAMPConfig,
))
