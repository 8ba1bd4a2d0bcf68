"""FedALA (Zhang et al., AAAI 2023, Algorithm 1): FedAvg, each client starting its local training
from an adaptive local aggregation (ALA) of the received global model Θ with its own last model θ_i.

Server: FedAvg of whole models (``train.aggregation``). Client: θ̂ = Θ on every state key but the
top ``fedala.layer_idx`` parameter tensors (the official ``layer_idx``; 0: all of them), where
θ̂ = θ_i + (Θ − θ_i) ⊙ W_i with element-wise weights W_i in [0, 1]. W_i (ones at first) is learned
on a contiguous ``fedala.rand_percent``% of the client's training data (start drawn with
``rt.generator``; unshuffled batches of ``train.batch_size``) by W ← clip(W − η ∂L(θ̂)/∂W, 0, 1),
η = ``fedala.eta``, θ̂ rebuilt after each batch: in the client's first ALA until the std of the
last ``fedala.num_pre_loss`` epoch losses (each its last batch's) is below ``fedala.threshold``,
later one pass. Then θ_i := θ̂, the usual local training, θ_i and W_i kept, θ_i sent. W_i never
leaves the client. A client without a θ_i takes Θ as is (``fedala.start=received``), or starts
from the run's initial weights Θ⁰ (``initial``: every official client holds Θ⁰ at first); where Θ
equals θ_i on the top tensors (round 1 under ``initial``) ALA is skipped (the official code tests
the first parameter tensor only).
Evaluation (the server sends Θ): the model the client would train from now, θ̂ built from Θ by
the same ALA (W learned on its own draw of the data), neither θ̂ nor W kept; the official
code also scores θ̂ right after its ``local_initialization`` (and then trains from that θ̂ and W).

Differences from the official code (PFLlib ``utils/ALA.py``, ``clientala.py``, ``serverala.py``):
it runs ALA on every client every round (sampled or not, a non-sampled client keeping θ̂) and
evaluates them all after that; here only a sampled client runs ALA (Algorithm 1). Its start phase
never stops if the losses do not settle (``fedala.max_start_epochs`` bounds it; null: as official).
It composes parameters only: buffers (BatchNorm statistics) stay the client's own and its server
never averages them; here every non-top key, buffers included, is Θ's. Where ``rand_percent``% of a
client's data is under one example, W learns on one (the official loader is empty and fails).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from flwr.app import RecordDict
from flwr.serverapp.strategy import Strategy
from omegaconf import MISSING, DictConfig
from torch.func import functional_call

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.checks import nonnegative, one_of, positive, require
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.state_store import keep_arrays, kept_arrays
from task.learning.engine import TensorData, loss_function
from task.learning.split_model import SplitModel

LOCAL = "local-model"  # θ_i: the client's last trained model (what it also sends)
WEIGHTS = "ala-weights"  # W_i: private
ALA_SALT = 0xA1A0  # the ALA data draw of a training round
EVAL_SALT = 0xA1A1  # the ALA data draw of an evaluation
STARTS = ("received", "initial")


class FedALAServer(ServerHooks, WeightedAverage):
    """FedAvg of whole models; evaluation sends the global model, which each client adapts itself."""


def make_strategy(cfg: DictConfig) -> Strategy:
    """FedALA's server half: plain FedAvg."""
    return FedALAServer(**TAKE_ALL_NODES).average_as(cfg)


def top_keys(model: torch.nn.Module, layer_idx: int) -> list[str]:
    """The last ``layer_idx`` parameter tensors' names (0: every parameter)."""
    names = [name for name, _ in model.named_parameters()]
    return names[len(names) - layer_idx:] if layer_idx else names


def ala_subset(rt: ClientRuntime, generator: torch.Generator) -> TensorData:
    """A contiguous ``rand_percent``% of the training data at a random start (at least one example)."""
    n = len(rt.train)
    size = min(n, max(1, int(int(rt.cfg.fedala.rand_percent) / 100 * n)))
    start = int(torch.randint(0, n - size + 1, (1,), generator=generator))
    return rt.train.subset(torch.arange(start, start + size, device=rt.train.y.device))


def compose(local: dict[str, torch.Tensor], received: dict[str, torch.Tensor],
            weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ̂ = θ + (Θ − θ) ⊙ W on the weighted keys."""
    return {k: local[k] + (received[k] - local[k]) * w for k, w in weights.items()}


def learn_weights(rt: ClientRuntime, received: dict[str, torch.Tensor], local: dict[str, torch.Tensor],
                  weights: dict[str, torch.Tensor], data: TensorData, converge: bool) -> tuple[dict, int]:
    """W by clipped gradient descent on the loss of θ̂ (one pass, or until the losses settle); W and its epochs."""
    cfg = rt.cfg.fedala
    eta, window, batch = float(cfg.eta), int(cfg.num_pre_loss), int(rt.cfg.train.batch_size)
    cap = cfg.max_start_epochs
    loss_fn = loss_function(rt.regression)
    fixed = {k: v for k, v in received.items() if k not in weights}
    rt.model.train()
    losses: list[float] = []
    while True:
        for start in range(0, len(data), batch):
            top = {k: v.requires_grad_(True) for k, v in compose(local, received, weights).items()}
            out = functional_call(rt.model, {**fixed, **top}, (data.x[start:start + batch],))
            loss = loss_fn(out, data.y[start:start + batch])
            grads = torch.autograd.grad(loss, list(top.values()))
            weights = {k: torch.clamp(weights[k] - eta * g * (received[k] - local[k]), 0.0, 1.0)
                       for k, g in zip(top, grads)}
        losses.append(float(loss.detach()))
        settled = len(losses) > window and float(np.std(losses[-window:])) < float(cfg.threshold)
        if not converge or settled or (cap is not None and len(losses) >= int(cap)):
            return weights, len(losses)


def adapt(rt: ClientRuntime, server_round: int, salt: int) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Turn the loaded Θ into θ̂ in place; the W it learned (None: no ALA) and its epochs."""
    cfg = rt.cfg.fedala
    local = kept_arrays(rt, LOCAL)
    if local is None and cfg.start == "initial":
        local = rt.initial_state
    if local is None or len(rt.train) == 0:
        return None, 0
    state = rt.model.state_dict()
    keys = top_keys(rt.model, int(cfg.layer_idx))
    received = {k: v.detach().clone() for k, v in state.items()}
    local = {k: local[k].to(rt.device) for k in keys}
    if all(torch.equal(local[k], received[k]) for k in keys):
        return None, 0
    kept = kept_arrays(rt, WEIGHTS)
    weights = ({k: kept[k].to(rt.device) for k in keys} if kept is not None
               else {k: torch.ones_like(received[k]) for k in keys})
    data = ala_subset(rt, rt.generator(server_round, salt))
    weights, epochs = learn_weights(rt, received, local, weights, data, converge=kept is None)
    with torch.no_grad():
        for k, v in compose(local, received, weights).items():
            state[k].copy_(v)
    return weights, epochs


def train_fedala(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """ALA of the received Θ with the kept θ_i, local training; keep θ_i and W_i, send θ_i."""
    config = round_config(content)
    rt.load(content[ARRAYS])
    weights, epochs = adapt(rt, int(config["server-round"]), ALA_SALT)
    result = rt.local_training(config)
    keep_arrays(rt, LOCAL, rt.model.state_dict())
    if weights is not None:
        keep_arrays(rt, WEIGHTS, weights)
    return reply(rt.arrays(), train_loss=result.mean_loss, local_steps=result.steps, ala_epochs=epochs,
                 **{NUM_EXAMPLES: len(rt.train)})


def evaluate_fedala(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score θ̂, the ALA of the received Θ with the kept θ_i (not kept)."""
    rt.load(content[ARRAYS])
    adapt(rt, int(round_config(content)["server-round"]), EVAL_SALT)
    return reply(None, **rt.evaluate_local())


@dataclass
class FedALAConfig:
    """``fedala.*``."""

    eta: float = nonnegative()  # η: the step of W
    rand_percent: int = positive()  # s: percent of the training data W learns on
    layer_idx: int = nonnegative()  # p: top parameter tensors aggregated adaptively (0: all)
    threshold: float = nonnegative()  # the start phase ends when the losses' std is below it ...
    num_pre_loss: int = positive()  # ... over this many last epochs
    max_start_epochs: Optional[int] = positive()  # a bound on the start phase's epochs (null: none)
    start: one_of(STARTS) = MISSING  # type: ignore[valid-type]  # θ_i of a client that has none


def check(cfg: DictConfig) -> None:
    """A percentage is at most 100."""
    require(int(cfg.fedala.rand_percent) <= 100, "fedala.rand_percent",
            f"got {cfg.fedala.rand_percent}, expected a percentage in 1..100")


def check_model(cfg: DictConfig, data, model: SplitModel) -> None:
    """The top tensors exist."""
    count = len(list(model.parameters()))
    require(int(cfg.fedala.layer_idx) <= count, "fedala.layer_idx",
            f"got {cfg.fedala.layer_idx}, but model {cfg.model.name} has {count} parameter tensors (0: all)")


ALGORITHM = register(Algorithm(
    name="fedala",
    description="FedAvg, each client adaptively aggregating the global model into its own (Zhang et al. 2023)",
    make_strategy=make_strategy,
    handlers={"train": train_fedala, "evaluate": evaluate_fedala},
    shared_keys=all_keys,
    config=FedALAConfig,
    check=check,
    check_model=check_model,
))
