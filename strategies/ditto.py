"""Ditto (Li, Hu, Beirami, Smith, 2021, Algorithm 1): FedAvg on a global model w, and a personal
model v on each client, kept there, trained on f_i(v) + (λ/2)·‖v − w‖².

Server: FedAvg of w (weights: ``train.aggregation``).
Client: from the received w^t, the usual local epochs of SGD on f_i (the reply: the new w);
then its own v trained for the same local epochs toward w^t, λ = ``ditto.lam``. A client's first v
is ``ditto.start``: ``initial`` (the run's common initial weights, w⁰ as in Ditto's Algorithm 1) or
``received`` (the w^t it first receives: the official ``main_ditto.py``, whose ``w_locals`` alias
the global model's tensors until a client's first update). Where the pull
λ(v − w^t) enters is ``ditto.pull``: ``gradient`` (Ditto's objective; the client's momentum
carries it) or ``after_momentum`` (the official FedRep code, ``models/Update.py``
``LocalUpdateDitto``: v ← v_step − lr·λ(v − w^t) after the momentum step). v never leaves the client.
Evaluation (the server sends no arrays) scores v on the client's local test split (a never-sampled client: the initial
weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import nonnegative, one_of
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.state_store import PERSONAL_STARTS, keep_arrays, load_kept_model
from task.learning.engine import PROX_PULLS

PERSONAL = "personal-model"
PERSONAL_SALT = 0xD1770  # the personal model's batches are shuffled apart from the global model's


class DittoServer(ServerHooks, WeightedAverage):
    """FedAvg of the global model w; evaluation asks the clients to score their own v (no arrays sent)."""

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return super().configure_evaluate(server_round, ArrayRecord(), config, grid)


def make_strategy(cfg: DictConfig) -> Strategy:
    """Ditto's server half: plain FedAvg."""
    return DittoServer(**TAKE_ALL_NODES).average_as(cfg)


def train_ditto(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Local SGD of w from w^t (sent back), then of the kept v pulled toward w^t (kept)."""
    config = round_config(content)
    rt.load(content[ARRAYS])
    received = [p.detach().clone() for p in rt.model.parameters()]
    start = {k: v.clone() for k, v in rt.model.state_dict().items()} if rt.cfg.ditto.start == "received" else None
    global_result = rt.local_training(config)
    new_global = rt.arrays()
    load_kept_model(rt, PERSONAL, fallback=start)
    personal_result = rt.local_training(config, prox_mu=float(rt.cfg.ditto.lam), prox_pull=str(rt.cfg.ditto.pull),
                                        prox_anchor=received, salt=PERSONAL_SALT)
    keep_arrays(rt, PERSONAL, rt.model.state_dict())
    return reply(new_global, train_loss=global_result.mean_loss, personal_loss=personal_result.mean_loss,
                 local_steps=global_result.steps, **{NUM_EXAMPLES: len(rt.train)})


def evaluate_personal(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score the client's own v on its local test split."""
    load_kept_model(rt, PERSONAL)
    return reply(None, **rt.evaluate_local())


@dataclass
class DittoConfig:
    """``ditto.*``."""

    lam: float = nonnegative()  # λ: the pull of the personal model toward the global one
    pull: one_of(PROX_PULLS) = MISSING  # type: ignore[valid-type]  # where λ(v − w^t) enters the personal step
    start: one_of(PERSONAL_STARTS) = MISSING  # type: ignore[valid-type]  # a client's first v


ALGORITHM = register(Algorithm(
    name="ditto",
    description="personal models regularised toward a FedAvg global model (Li et al. 2021)",
    make_strategy=make_strategy,
    handlers={"train": train_ditto, "evaluate": evaluate_personal},
    shared_keys=all_keys,
    config=DittoConfig,
))
