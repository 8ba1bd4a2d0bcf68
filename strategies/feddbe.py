"""FedDBE (Zhang et al., NeurIPS 2023, "Eliminating Domain Bias for Federated Learning in
Representation Space"): FedAvg with a domain bias eliminator (DBE) on every client.

The model is a body (every group before ``model.head``) whose features z feed the head.
Client: it adds its personalized representation bias memory (PRBM), a trainable vector μ_i of
z's shape (zeros at first), to z before the head, and trains the whole model and μ_i on

    CE(head(z + μ_i), y) + κ · (1/K) Σ_k ½ (z̄_i,k − z̄ᵍ_k)²        (MR: mean regularization)

where z̄_i is a running mean of the batch means of z, z̄_i ← (1 − m) z̄_i + m · mean_batch(z),
restarted at zero every round and detached after every step (the gradient passes through the
current batch's mean only); κ = ``feddbe.kappa``, m = ``feddbe.momentum``. The model steps with
``train.*``'s SGD, μ_i with plain SGD at the round's learning rate. It sends the whole model and
keeps μ_i, which never leaves it. Evaluation scores head(body(x) + μ_i) with the received model
on the local test split (a client never trained has μ_i = 0: the global model).
Server: FedAvg of the whole model (weights: ``train.aggregation``); its global score is
head(body(x)), without any μ. Before round 1 (PFLlib's initialization period) it asks every
training client (``query.dbemean``) to train one round's local epochs from the initial model with
CE alone (no PRBM, no MR) and to send the final running mean z̄_i only; that training is thrown
away, as PFLlib's ``send_models`` overwrites it. z̄ᵍ = Σ_i (n_i / n) z̄_i over the clients that
answered stays fixed for the run and goes down with every training message.

Checked against the authors' code (PFLlib ``clientdbe.py`` and ``serverdbe.py``, equal to their
DBE repository's ``clientDBE.py``/``serverDBE.py``). Differences: PFLlib hands each client z̄ᵍ
once and the client holds it, here it travels with each training message (K more floats, same
numbers); PFLlib's model optimizer is plain SGD, here ``train.momentum``/``weight_decay`` apply
as for every algorithm (0 gives PFLlib's step); with ``train.lr_decay`` < 1 PFLlib's μ keeps the
undecayed rate, here it takes the round's. The paper's own text could not be read here (see
conf/base.yaml for the defaults' sources).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import fraction, nonnegative
from strategies.common import (ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, ClientRuntime, failure_fields, reply,
                               round_config, round_lr)
from strategies.services import Services
from strategies.state_store import keep_arrays, kept_arrays
from task.learning.engine import loss_function, training_batches

MEAN_QUERY = "query.dbemean"  # the initialization period: a client's running feature mean
MEAN_PHASE = "dbe-means"
GLOBAL_MEAN = "dbe-global-mean"  # server -> client with every training message: z̄ᵍ
CLIENT_MEAN = "dbe-client-mean"  # client -> server once: z̄_i
MEMORY = "bias-memory"  # the kept PRBM μ_i
MEAN_SALT = 0xDBE  # the initialization period shuffles apart from round 1


class FedDBEServer(ServerHooks, WeightedAverage):
    """FedAvg of the whole model; z̄ᵍ from an initialization period before round 1."""

    checkpointed = ("global_mean",)

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.average_as(cfg)
        self.label = str(cfg.label)
        self.global_mean: torch.Tensor | None = None

    def prepare_round(self, server_round: int, services: Services) -> dict | None:
        """Once, before the first round: every training client's z̄_i; z̄ᵍ their weighted mean."""
        if self.global_mean is not None:
            return None
        config = ConfigRecord({"variant": self.label, "server-round": server_round})
        messages = [Message(RecordDict({ARRAYS: services.get_arrays(), CONFIG: config}), dst_node_id=node,
                            message_type=MEAN_QUERY) for node in services.nodes(services.trainable)]
        replies, failed = services.send(messages, MEAN_PHASE)
        if not replies:
            raise RuntimeError(f"no client sent its feature mean (failed: {failed})")
        self.global_mean = weighted_mean(replies)
        return {"round": server_round - 1, "phase": MEAN_PHASE, "clients": list(services.trainable),
                "global_mean_norm": float(self.global_mean.norm()), **failure_fields(failed)}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.global_mean is None:
            return messages
        mean = ArrayRecord({"mean": self.global_mean})
        return [Message(RecordDict({**dict(m.content.items()), GLOBAL_MEAN: mean}), dst_node_id=m.metadata.dst_node_id,
                        message_type=MessageType.TRAIN) for m in messages]


def weighted_mean(replies: list[Message]) -> torch.Tensor:
    """z̄ᵍ = Σ_i (n_i / n) z̄_i over the replies (PFLlib: weights by training examples)."""
    counts = [float(r.content[METRICS][NUM_EXAMPLES]) for r in replies]
    if sum(counts) <= 0:
        raise RuntimeError("the clients that sent a feature mean hold no training examples")
    means = [torch.as_tensor(r.content[CLIENT_MEAN]["mean"].numpy()) for r in replies]
    return sum((n / sum(counts)) * mean for n, mean in zip(counts, means))


def make_strategy(cfg: DictConfig) -> Strategy:
    """FedDBE's server half."""
    return FedDBEServer(cfg)


def dbe_training(rt: ClientRuntime, server_round: int, global_mean: torch.Tensor | None,
                 memory: torch.Tensor | None, salt: int = 0) -> tuple[dict[str, float], torch.Tensor | None]:
    """The round's local epochs (or steps) of model and ``memory`` (μ_i) on CE + κ·MR; without
    ``global_mean`` on CE alone, μ_i unused (PFLlib's initialization period). Its metrics and the
    final running mean z̄_i (None without data)."""
    t, kappa, m = rt.cfg.train, float(rt.cfg.feddbe.kappa), float(rt.cfg.feddbe.momentum)
    optimizers = [rt.optimizer(server_round).build(list(rt.model.parameters()), rt.model)]
    if global_mean is not None:
        optimizers.append(torch.optim.SGD([memory], lr=round_lr(rt.cfg, server_round)))
    loss_fn = loss_function(rt.regression)
    rt.model.train()
    running, ce_sum, reg_sum, steps, samples = None, 0.0, 0.0, 0, 0
    batches = training_batches(rt.train, int(t.batch_size), rt.generator(server_round, salt), int(t.local_epochs),
                               t.local_steps, rt.augment)
    for xb, yb in batches:
        z = rt.model.features(xb, rt.head)
        batch_mean = z.float().mean(0)
        running = m * batch_mean if running is None else (1 - m) * running.detach() + m * batch_mean
        if global_mean is None:
            ce, reg = loss_fn(rt.model.head_forward(z, rt.head), yb), torch.zeros((), device=z.device)
        else:
            ce = loss_fn(rt.model.head_forward(z + memory, rt.head), yb)
            reg = kappa * (0.5 * (running - global_mean) ** 2).mean()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        (ce + reg).backward()
        for opt in optimizers:
            opt.step()
        ce_sum += float(ce.detach()) * len(yb)
        reg_sum += float(reg.detach()) * len(yb)
        steps, samples = steps + 1, samples + len(yb)
    metrics = {"train_loss": ce_sum / max(samples, 1), "mr_loss": reg_sum / max(samples, 1), "local_steps": steps,
               NUM_EXAMPLES: len(rt.train)}
    return metrics, None if running is None else running.detach()


def train_dbe(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Train the received model with the kept μ_i toward the received z̄ᵍ; keep μ_i, send the model."""
    rt.load(content[ARRAYS])
    server_round = int(round_config(content)["server-round"])
    global_mean = memory = None
    if GLOBAL_MEAN in content:
        global_mean = content[GLOBAL_MEAN].to_torch_state_dict()["mean"].to(rt.device)
        kept = kept_arrays(rt, MEMORY)
        start = kept["mu"].to(rt.device) if kept is not None else torch.zeros_like(global_mean)
        memory = start.clone().requires_grad_(True)
    metrics, _ = dbe_training(rt, server_round, global_mean, memory)
    if memory is not None:
        keep_arrays(rt, MEMORY, {"mu": memory.detach()})
    return reply(rt.arrays(), **metrics)


def feature_mean(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """``query.dbemean``: a round of CE training from the received model; only z̄_i goes back, nothing is kept."""
    rt.load(content[ARRAYS])
    metrics, running = dbe_training(rt, int(round_config(content)["server-round"]), None, None, MEAN_SALT)
    if running is None:
        raise ValueError(f"client {rt.partition_id} has no training data to take a feature mean of")
    out = reply(None, **{NUM_EXAMPLES: metrics[NUM_EXAMPLES], "train_loss": metrics["train_loss"]})
    out[CLIENT_MEAN] = ArrayRecord({"mean": running.cpu()})
    return out


def evaluate_dbe(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """head(body(x) + μ_i) with the received model on the local test split."""
    rt.load(content[ARRAYS])
    kept = kept_arrays(rt, MEMORY)
    if kept is None:
        return reply(None, **rt.evaluate_local(round_config(content)))
    memory = kept["mu"].to(rt.device)
    hook = rt.model.get_submodule(rt.head[0]).register_forward_pre_hook(lambda _, args: (args[0] + memory, *args[1:]))
    try:
        return reply(None, **rt.evaluate_local(round_config(content)))
    finally:
        hook.remove()


@dataclass
class FedDBEConfig:
    """``feddbe.*``."""

    kappa: float = nonnegative()  # κ: the weight of mean regularization (PFLlib's kl_weight)
    momentum: float = fraction()  # m: the running feature mean's weight of the current batch


ALGORITHM = register(Algorithm(
    name="feddbe",
    description="FedAvg + a per-client feature bias vector and features' mean pulled to a global mean (Zhang et al. 2023)",
    make_strategy=make_strategy,
    handlers={"train": train_dbe, "evaluate": evaluate_dbe, MEAN_QUERY: feature_mean},
    shared_keys=all_keys,
    config=FedDBEConfig,
))
