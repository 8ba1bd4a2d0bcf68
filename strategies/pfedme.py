"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020, Algorithm 1): personalized models θ_i from Moreau
envelopes, a local model w_i pulled toward them, β-mixing on the server.

Client: from the received w^t, w_i := w^t and θ_i := w^t; for each mini-batch D of the usual local
epochs/steps, K = ``pfedme.inner_steps`` gradient steps on D of f_i(θ; D) + (λ/2)‖θ − w_i‖²
(+ (μ/2)‖θ‖², ``pfedme.mu``: the official optimizer's small L2, 0 in the paper) at the personal rate
``pfedme.personal_lr``, then w_i ← w_i − η·λ·(w_i − θ_i) at the round's rate η (``train.lr``). It
sends w_i and keeps θ_i, which its evaluation scores (never trained: the run's initial weights).
pFedMe's steps are its own plain gradient steps: ``train.momentum`` and ``train.weight_decay``
do not enter them.
Server: w^{t+1} = (1 − β)·w^t + β·(average of the w_i), β = ``pfedme.beta`` (β = 1: FedAvg's
average). In the paper every client updates and the server samples whom it averages; here the
round's sampled clients train, as in PFLlib.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from omegaconf import DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import nonnegative, positive, require
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config, round_lr
from strategies.state_store import keep_arrays, load_kept_model
from task.learning.engine import loss_function, training_batches

PERSONAL = "personal-model"


class BetaMixing(ServerHooks, WeightedAverage):
    """FedAvg's average mixed with the model sent, (1 − β)·w^t + β·average; evaluation sends no arrays."""

    def __init__(self, beta: float) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.beta = beta
        self.sent: dict[str, np.ndarray] = {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.sent = {k: a.numpy().copy() for k, a in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        average, metrics = super().aggregate_train(server_round, replies)
        if average is None or self.beta == 1.0:
            return average, metrics
        return mix(self.sent, average, self.beta), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No arrays: each client scores its own θ_i."""
        return super().configure_evaluate(server_round, ArrayRecord(), config, grid)


def mix(sent: dict[str, np.ndarray], average: ArrayRecord, beta: float) -> ArrayRecord:
    """(1 − β)·sent + β·average, key by key, in each array's own dtype (integers rounded)."""
    out = ArrayRecord()
    for key, array in average.items():
        value = (1.0 - beta) * sent[key].astype(np.float64) + beta * array.numpy().astype(np.float64)
        dtype = array.numpy().dtype
        out[key] = Array(np.asarray(np.rint(value) if np.issubdtype(dtype, np.integer) else value).astype(dtype))
    return out


def make_strategy(cfg: DictConfig) -> BetaMixing:
    """pFedMe's server half."""
    return BetaMixing(float(cfg.pfedme.beta)).average_as(cfg)


def train_pfedme(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """K Moreau-envelope steps of θ per batch, then w's step toward θ; send w, keep θ."""
    config = round_config(content)
    rt.load(content[ARRAYS])
    server_round = int(config["server-round"])
    section, t = rt.cfg.pfedme, rt.cfg.train
    lam, mu, personal_lr = float(section.lam), float(section.mu), float(section.personal_lr)
    eta = round_lr(rt.cfg, server_round)
    theta = list(rt.model.parameters())  # θ lives in the model; w_i beside it
    local = [p.detach().clone() for p in theta]
    loss_fn = loss_function(rt.regression)
    rt.model.train()
    total, samples, steps = 0.0, 0, 0
    for xb, yb in training_batches(rt.train, int(t.batch_size), rt.generator(server_round), int(t.local_epochs),
                                   t.local_steps, rt.augment):
        for _ in range(int(section.inner_steps)):
            rt.model.zero_grad(set_to_none=True)
            loss = loss_fn(rt.model(xb), yb)
            loss.backward()
            with torch.no_grad():
                for p, w in zip(theta, local):
                    if p.grad is not None:
                        p.sub_(p.grad + lam * (p - w) + mu * p, alpha=personal_lr)
        with torch.no_grad():
            for p, w in zip(theta, local):
                w.sub_(w - p, alpha=eta * lam)
        total += loss.item() * len(yb)
        samples += len(yb)
        steps += 1
    keep_arrays(rt, PERSONAL, rt.model.state_dict())
    with torch.no_grad():
        for p, w in zip(theta, local):
            p.copy_(w)
    return reply(rt.arrays(), train_loss=total / max(samples, 1), local_steps=steps, **{NUM_EXAMPLES: len(rt.train)})


def evaluate_personal(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score the client's θ_i on its local test split."""
    load_kept_model(rt, PERSONAL)
    return reply(None, **rt.evaluate_local())


@dataclass
class PFedMeConfig:
    """``pfedme.*``."""

    lam: float = positive()  # λ: the Moreau envelope's pull between θ_i and w_i
    inner_steps: int = positive()  # K: steps of θ per mini-batch
    personal_lr: float = positive()  # the rate of θ's steps
    beta: float = positive()  # β: the server's mixing of its model and the average
    mu: float = nonnegative()  # the official optimizer's L2 on θ (0: the paper)


def check(cfg: DictConfig) -> None:
    """w's step toward θ must not overshoot it."""
    require(float(cfg.pfedme.lam) * float(cfg.train.lr) <= 1.0, "pfedme.lam",
            f"lam * train.lr = {float(cfg.pfedme.lam) * float(cfg.train.lr):g} > 1: w_i would step past theta_i")


def smoke(cfg: DictConfig) -> dict:
    """One inner step per batch."""
    return {"pfedme.inner_steps": 1}


ALGORITHM = register(Algorithm(
    name="pfedme",
    description="personalized models from Moreau envelopes, local models pulled toward them, "
                "beta-mixed server average (Dinh et al. 2020)",
    make_strategy=make_strategy,
    handlers={"train": train_pfedme, "evaluate": evaluate_personal},
    shared_keys=all_keys,
    config=PFedMeConfig,
    check=check,
    smoke=smoke,
))
