"""FedProto (Tan et al., AAAI 2022, Algorithm 1): clients share class prototypes, never weights.

Client: keeps its whole model (body: the groups before ``model.head``) and trains it on CE + λ·pull,
the pull being the mean squared distance of each sample's body features to its label's global
prototype, over batch and features, samples of labels without one adding zero (both official codes'
``MSELoss``; CE alone before any prototype exists). It sends each held class's mean body feature
(``fedproto.prototypes``: ``during_training``, train-mode features of every local batch, Algorithm 1
and both codes; ``after_training``, eval-mode features under the trained model, Eq. 4 read literally)
and the class's examples |D_ij| (presence only under ``uniform``).
Server: averages each class over the replies holding it, by |D_ij| (``fedproto.weighting=examples``,
Eq. 6, whose extra factor 1/|N_j| we read as a slip) or uniformly (PFLlib's and the authors' code);
a class no reply holds is dropped (PFLlib) or keeps its last prototype (``fedproto.keep_absent``).
It holds only the prototypes (its arrays stay empty: no global model) and sends them with every
training and evaluation message.
Evaluation, own model: ``accuracy`` is the paper's nearest global prototype (L2, eval-mode body
features, every class that has one, as PFLlib); ``head_accuracy`` the head's; ``loss`` the head's CE.
Not implemented: Eq. 8's pull of per-batch class means (both codes pull each sample).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from omegaconf import MISSING, DictConfig
from torch.nn import functional as F

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, register
from strategies.checks import nonnegative, require
from strategies.common import (CONFIG, NUM_EXAMPLES, VALIDATION_ACCURACY, ClientRuntime, configured_head, reply,
                               round_config)
from strategies.flower_compat import checked_replies, messages_to
from strategies.services import Services
from strategies.state_store import keep_arrays, load_kept_model
from task.learning.engine import TensorData, TrainResult, training_batches

MODEL = "own-model"  # the client's whole model, kept
GLOBAL = "global-prototypes"  # server → client: "prototypes" (classes × features), "present" (classes,)
LOCAL = "prototypes"  # client → server: "prototypes" (classes × features), "counts" (classes,)
NUM_CLASSES = "num-classes"  # in the training config: the shape of the reply
HEAD_ACCURACY = "head_accuracy"


def aggregate_prototypes(prototypes: np.ndarray, counts: np.ndarray, weighting: str) -> tuple[np.ndarray, np.ndarray]:
    """Global prototypes (classes × features) and which classes have one, from the clients'
    ``prototypes`` (clients × classes × features) and ``counts`` (clients × classes; 0: absent)."""
    weights = counts.astype(np.float64) if weighting == "examples" else (counts > 0).astype(np.float64)
    total = weights.sum(axis=0)
    present = total > 0
    mean = np.einsum("mc,mcd->cd", weights, prototypes.astype(np.float64)) / np.where(present, total, 1.0)[:, None]
    return mean.astype(np.float32), present


class FedProtoServer(ServerHooks, FedAvg):
    """Sends the global prototypes (none before the first aggregation) and averages the replies' prototypes."""

    checkpointed = ("prototypes", "present")

    def __init__(self, weighting: str, keep_absent: bool) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.weighting, self.keep_absent = weighting, keep_absent
        self.prototypes: np.ndarray | None = None  # classes × features, float32
        self.present: np.ndarray | None = None  # classes, bool
        self.shape = (0, 0)  # (classes, features), known at on_start

    def on_start(self, services: Services) -> None:
        model, bundle = services.model, services.data.bundle
        x = torch.zeros(1, *bundle.input_shape, device=next(model.parameters()).device)
        with torch.no_grad():
            features = model.eval().features(x, configured_head(model, services.cfg)).numel()
        self.shape = (int(bundle.num_classes), int(features))

    def _messages(self, server_round: int, config: ConfigRecord, grid: Grid, kind: str) -> list[Message]:
        config["server-round"], config[NUM_CLASSES] = server_round, self.shape[0]
        record = RecordDict({CONFIG: config})
        if self.prototypes is not None:
            record[GLOBAL] = ArrayRecord({"prototypes": Array(self.prototypes),
                                          "present": Array(self.present.astype(np.float32))})
        return messages_to(record, list(grid.get_node_ids()), kind)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self._messages(server_round, config, grid, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._messages(server_round, config, grid, MessageType.EVALUATE)

    def reply_template(self, message: Message) -> Mapping[str, ArrayRecord]:
        classes, features = self.shape
        return {LOCAL: ArrayRecord({"prototypes": Array(np.zeros((classes, features), np.float32)),
                                    "counts": Array(np.zeros(classes, np.float32))})}

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        contents = [m.content for m in checked_replies(replies, is_train=True)[0]]
        if not contents:
            return None, None
        mean, present = aggregate_prototypes(np.stack([c[LOCAL]["prototypes"].numpy() for c in contents]),
                                             np.stack([c[LOCAL]["counts"].numpy() for c in contents]), self.weighting)
        if self.keep_absent and self.prototypes is not None:
            mean[~present] = self.prototypes[~present]
            present = present | self.present
        self.prototypes, self.present = mean, present
        return None, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def has_global_model(self, server_round: int) -> bool:
        """The prototypes are no model: every model stays on its client."""
        return False


def make_strategy(cfg: DictConfig) -> Strategy:
    """FedProto's server half."""
    return FedProtoServer(str(cfg.fedproto.weighting), bool(cfg.fedproto.keep_absent))


# -- the client half ----------------------------------------------------------------------------
def received_prototypes(rt: ClientRuntime, content: RecordDict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The global prototypes (classes × features) and their presence mask, or None before any exists."""
    record = content[GLOBAL] if GLOBAL in content else None
    return None if record is None else (torch.as_tensor(record["prototypes"].numpy()).to(rt.device),
                                        torch.as_tensor(record["present"].numpy()).to(rt.device) > 0)


@torch.no_grad()
def body_features(rt: ClientRuntime, x: torch.Tensor) -> torch.Tensor:
    """Eval-mode float32 body features of ``x``, flattened per sample, in chunks of ``eval.batch_size``."""
    rt.model.eval()
    step = int(rt.cfg.eval.batch_size)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return torch.cat([rt.model.features(x[i:i + step], rt.head).flatten(1).float() for i in range(0, len(x), step)])


def train_toward_prototypes(rt: ClientRuntime, prototypes, server_round: int,
                            classes: int) -> tuple[TrainResult, torch.Tensor, torch.Tensor]:
    """Local SGD on CE + λ·pull; the result and the per-class sums and numbers of the batches' features."""
    t, lam = rt.cfg.train, float(rt.cfg.fedproto.lam)
    opt = rt.optimizer(server_round).build(list(rt.model.parameters()), rt.model)
    rt.model.train()
    device = rt.train.y.device
    sums, seen, total, samples, steps = None, torch.zeros(classes, device=device), torch.zeros((), device=device), 0, 0
    for xb, yb in training_batches(rt.train, int(t.batch_size), rt.generator(server_round), int(t.local_epochs),
                                   t.local_steps, rt.augment):
        opt.zero_grad(set_to_none=True)
        z = rt.model.features(xb, rt.head)
        loss = F.cross_entropy(rt.model.head_forward(z, rt.head), yb)
        flat = z.flatten(1)
        if prototypes is not None:
            target = torch.where(prototypes[1][yb, None], prototypes[0][yb].to(flat.dtype), flat.detach())
            loss = loss + lam * F.mse_loss(flat, target)
        loss.backward()
        opt.step()
        sums = torch.zeros(classes, flat.shape[1], device=device) if sums is None else sums
        sums.index_add_(0, yb, flat.detach().float())
        seen += torch.bincount(yb, minlength=classes).to(seen.dtype)
        total += loss.detach() * len(yb)
        samples, steps = samples + len(yb), steps + 1
    return TrainResult(float(total) / max(samples, 1), steps, samples), sums, seen


def train_fedproto(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Train the kept model toward the global prototypes, keep it, send the local prototypes."""
    config = round_config(content)
    server_round, classes = int(config["server-round"]), int(config[NUM_CLASSES])
    load_kept_model(rt, MODEL)
    result, sums, seen = train_toward_prototypes(rt, received_prototypes(rt, content), server_round, classes)
    if rt.cfg.fedproto.prototypes == "after_training":
        features = body_features(rt, rt.train.x)
        sums = torch.zeros(classes, features.shape[1], device=features.device).index_add_(0, rt.train.y, features)
        seen = torch.bincount(rt.train.y, minlength=classes).to(sums.dtype)
    keep_arrays(rt, MODEL, rt.model.state_dict())
    counts = torch.bincount(rt.train.y, minlength=classes).float() * (seen > 0)
    if rt.cfg.fedproto.weighting == "uniform":
        counts = (counts > 0).float()  # presence only: the uniform average needs no class sizes
    content = reply(None, train_loss=result.mean_loss, local_steps=result.steps, **{NUM_EXAMPLES: len(rt.train)})
    content[LOCAL] = ArrayRecord({"prototypes": (sums / seen.clamp(min=1)[:, None]).cpu(), "counts": counts.cpu()})
    return content


def prototype_accuracy(rt: ClientRuntime, data: TensorData, prototypes) -> float:
    """The share of ``data`` whose body features lie nearest (L2) the global prototype of their label."""
    if prototypes is None or not bool(prototypes[1].any()) or len(data) == 0:
        return 0.0
    distances = torch.cdist(body_features(rt, data.x), prototypes[0].float())
    distances[:, ~prototypes[1]] = math.inf
    return float((distances.argmin(dim=1) == data.y).float().mean())


def evaluate_fedproto(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """The own model: prototype inference as ``accuracy`` (and validation accuracy), the head's as ``head_accuracy``."""
    load_kept_model(rt, MODEL)
    prototypes, metrics = received_prototypes(rt, content), rt.evaluate_local()
    metrics[HEAD_ACCURACY] = metrics["accuracy"]
    metrics["accuracy"] = prototype_accuracy(rt, rt.test, prototypes)
    if VALIDATION_ACCURACY in metrics:
        metrics[VALIDATION_ACCURACY] = prototype_accuracy(rt, rt.validation, prototypes)
    return reply(None, **metrics)


@dataclass
class FedProtoConfig:
    """``fedproto.*``."""

    lam: float = nonnegative()  # λ, the weight of the pull toward the global prototypes
    weighting: Literal["examples", "uniform"] = MISSING  # the server's average of the clients' prototypes
    prototypes: Literal["during_training", "after_training"] = MISSING  # which features a local prototype averages
    keep_absent: bool = MISSING  # a class no reply holds keeps its last global prototype (else it is dropped)


def check_model(cfg: DictConfig, data, model: torch.nn.Module) -> None:
    """Prototypes are class means: a classification task."""
    require(data.bundle.task != "regression", "algorithm", f"fedproto averages features per class: "
            f"data.name={cfg.data.name!r} is a regression task")


ALGORITHM = register(Algorithm(
    name="fedproto",
    description="clients share class prototypes only; every model stays on its client (Tan et al. 2022)",
    make_strategy=make_strategy,
    handlers={"train": train_fedproto, "evaluate": evaluate_fedproto},
    shared_keys=None,
    config=FedProtoConfig,
    check_model=check_model,
))
