"""FedRoD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning"), its
linear personal head: one model with a generic head trained for the federation, a personal head per client.

Server: FedAvg (weights: ``train.aggregation``) of the whole model, body and generic head: the
generic model, scored on the global test set.
Client: for each mini-batch, body features z; the body and generic head g take one step of
``train.*``'s SGD on the balanced softmax loss CE(g(z) + log n_i, y), n_i the client's training
examples per class (a class it lacks gets −inf: it is never predicted in training); then its
personal head p (the head's architecture, the run's initial head at first, kept) takes one plain
SGD step at the round's rate on CE(g(z) + p(z), y), z and g(z) detached, from the same batch's
pre-step features (PFLlib ``clientrod.py``). It sends the model and keeps p. Evaluation scores
g(z) + p(z) with the received model on its local test split (never trained: the initial p).
The paper's hypernetwork personal head (FedRoD (hyper)) is not implemented.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from flwr.app import RecordDict
from torch import nn
from torch.nn import functional as F

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import require
from strategies.common import ARRAYS, NUM_EXAMPLES, VALIDATION_ACCURACY, ClientRuntime, reply, round_config, round_lr
from strategies.state_store import keep_arrays, kept_arrays
from task.learning.engine import TensorData, training_batches

PERSONAL_HEAD = "personal-head"


class GenericAverage(ServerHooks, WeightedAverage):
    """FedAvg of the generic model (body and generic head)."""


def make_strategy(cfg) -> GenericAverage:
    """FedRoD's server half."""
    return GenericAverage(**TAKE_ALL_NODES).average_as(cfg)


def personal_head(rt: ClientRuntime) -> nn.Sequential:
    """The client's personal head: the head's layers with its kept weights (the initial head's at first)."""
    head = copy.deepcopy(nn.Sequential(OrderedDict((g, rt.model.get_submodule(g)) for g in rt.head)))
    kept = kept_arrays(rt, PERSONAL_HEAD)
    head.load_state_dict(kept if kept is not None else {k: rt.initial_state[k] for k in rt.head_keys()})
    return head


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """CE(logits + log counts, y): the balanced softmax of Ren et al. 2020, FedRoD's generic objective."""
    return F.cross_entropy(logits + counts.to(logits.dtype).log().unsqueeze(0), y)


def train_fedrod(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Per batch: the model's balanced-softmax step, then the personal head's step; send the model."""
    config = round_config(content)
    rt.load(content[ARRAYS])
    server_round = int(config["server-round"])
    t = rt.cfg.train
    head = personal_head(rt)
    opt = rt.optimizer(server_round).build(list(rt.model.parameters()), rt.model)
    opt_head = torch.optim.SGD(head.parameters(), lr=round_lr(rt.cfg, server_round))
    counts = None
    rt.model.train()
    total, samples, steps = 0.0, 0, 0
    for xb, yb in training_batches(rt.train, int(t.batch_size), rt.generator(server_round), int(t.local_epochs),
                                   t.local_steps, rt.augment):
        z = rt.model.features(xb, rt.head)
        generic = rt.model.head_forward(z, rt.head)
        if counts is None:
            counts = torch.bincount(rt.train.y, minlength=generic.shape[1])
        loss = balanced_softmax_loss(generic, yb, counts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        personal_loss = F.cross_entropy(generic.detach() + head(z.detach()), yb)
        opt_head.zero_grad(set_to_none=True)
        personal_loss.backward()
        opt_head.step()
        total += loss.item() * len(yb)
        samples += len(yb)
        steps += 1
    keep_arrays(rt, PERSONAL_HEAD, head.state_dict())
    return reply(rt.arrays(), train_loss=total / max(samples, 1), local_steps=steps, **{NUM_EXAMPLES: len(rt.train)})


@torch.no_grad()
def personalized_scores(rt: ClientRuntime, head: nn.Module, data: TensorData) -> tuple[float, float]:
    """Accuracy and loss of g(z) + p(z) on ``data`` (eval mode, in evaluation batches)."""
    rt.model.eval()
    head.eval()
    correct, loss, batch = 0, 0.0, int(rt.cfg.eval.batch_size)
    for start in range(0, len(data), batch):
        part = data.subset(torch.arange(start, min(start + batch, len(data)), device=data.y.device))
        z = rt.model.features(part.x, rt.head)
        out = rt.model.head_forward(z, rt.head) + head(z)
        correct += int((out.argmax(1) == part.y).sum())
        loss += float(F.cross_entropy(out, part.y, reduction="sum"))
    return correct / max(len(data), 1), loss / max(len(data), 1)


def evaluate_fedrod(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """The received generic model plus the client's personal head on its local test split."""
    rt.load(content[ARRAYS])
    head = personal_head(rt)
    accuracy, loss = personalized_scores(rt, head, rt.test)
    metrics = {"accuracy": accuracy, "loss": loss, NUM_EXAMPLES: float(len(rt.test))}
    if rt.validation is not None and len(rt.validation):
        metrics[VALIDATION_ACCURACY] = personalized_scores(rt, head, rt.validation)[0]
    return reply(None, **metrics)


def check_model(cfg, data, model: nn.Module) -> None:
    """Classification only (the balanced softmax needs classes)."""
    require(data.bundle.task != "regression", "algorithm", "fedrod trains a balanced softmax: it needs a "
            f"classification dataset, data.name={cfg.data.name!r} is a regression task")


ALGORITHM = register(Algorithm(
    name="fedrod",
    description="a generic head trained with balanced softmax and averaged, a personal head added on each client "
                "(Chen & Chao 2022)",
    make_strategy=make_strategy,
    handlers={"train": train_fedrod, "evaluate": evaluate_fedrod},
    shared_keys=all_keys,
    check_model=check_model,
))
