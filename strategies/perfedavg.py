"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar 2020): FedAvg that learns an initial model which
each client personalises with one gradient step of rate α.

Client (``train``): from the received global model w, one meta-step per mini-batch of
``train.batch_size`` (``train.local_epochs`` epochs, or ``train.local_steps`` steps; a final
batch of one sample is skipped). The batch's first ``perfedavg.support_fraction`` is the support
set D (8 of 10), the rest the target set D' (2 of 10); w̃ = w − α∇f(w; D), g = ∇f(w̃; D'), and the
direction of the step is, by ``perfedavg.variant``:

- ``hf`` (the paper's Per-FedAvg (HF), Algorithm 1 with the Hessian-free product; FedRep's
  baseline): g − α·d, d = [∇f(w + δg; D'') − ∇f(w − δg; D'')]/(2δ) ≈ ∇²f(w; D'')·g on a third
  batch D'' of ``train.batch_size`` drawn independently of D and D' (a shuffle of its own),
  δ = ``perfedavg.hessian_delta``; the two gradients of d are computed in float32 even under
  ``train.precision=bf16``, where their difference would be rounding noise;
- ``fo`` (Per-FedAvg (FO)): g, the Hessian term dropped;
- ``official``: ∇f(w; D) + ∇f(w; D'), what the official FedRep code's ``LocalUpdateMAML``
  (models/Update.py) computes: its inner step w̃ is formed but the outer loss is taken at w, so
  w̃ is never used (and its ``lr_in = lr*0.001`` with it); it is plain SGD on the support and
  target losses summed. That class is never called. main_fedrep.py, the script that accepts
  ``--alg maml`` (since 2022-03-28; before, it defined no layers for it), loads every layer of a
  client's own last model and trains it with ``LocalUpdate``'s plain SGD: Local Only on the
  round's sampled clients, the average never used (algorithm=local_only here).

w ← w − β·direction through the client optimizer (β = ``train.lr``; ``train.momentum``,
``train.weight_decay``, ``train.decay_biases``: the official code's SGD with momentum 0.5 and
weight decay 1e-4 on all but biases). α = ``perfedavg.inner_lr``.

Server: FedAvg's (``train.aggregation``; with ``fedavg.local_model_accuracy`` clients also score
their trained model: the official code's number). Sent both ways: the whole model; kept on a
client between rounds: nothing.

Evaluation (``evaluate``), by ``perfedavg.eval_adaptation``: ``one_step`` (the paper, Section 5:
one step of local stochastic gradient descent at test time) scores w − α∇f(w; B), B one seeded
mini-batch of ``train.batch_size`` of the client's training data, on its local test split; the
adapted weights are discarded, never sent. ``none`` scores w itself: main_fedrep.py evaluates
``maml`` with no adaptation step (each client's latest local model: ``fedavg.local_model_accuracy``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from flwr.app import RecordDict
from omegaconf import MISSING, DictConfig
from torch.func import functional_call

from strategies.base import Algorithm, all_keys, register
from strategies.checks import RANGE, Range, one_of, positive, require
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from strategies.fedavg import LOCAL_ACCURACY, LOCAL_TEST_EXAMPLES, SCORE_LOCAL, FedAvgServer
from task.learning.engine import AUGMENTATIONS, batch_slices, loss_function, step_batches

VARIANTS = ("hf", "fo", "official")
ADAPTATIONS = ("one_step", "none")
HESSIAN_SALT = 0x4E55  # D'' is shuffled apart from the meta-steps' batches
ADAPT_SALT = 0xADA  # the evaluation's adaptation batch

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# -- the meta-step ---------------------------------------------------------------------------
def gradient(model: torch.nn.Module, weights: dict[str, torch.Tensor], batch: Batch,
             loss_fn: LossFn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """∇f(weights; batch) (one tensor per entry of ``weights``) and the loss, the model's
    parameters replaced by ``weights``."""
    leaves = {n: w.detach().requires_grad_(True) for n, w in weights.items()}
    x, y = batch
    loss = loss_fn(functional_call(model, leaves, (x,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for w, g in zip(leaves.values(), grads)], loss.detach()


def meta_direction(model: torch.nn.Module, support: Batch, target: Batch, loss_fn: LossFn, variant: str,
                   alpha: float, hessian: Batch | None = None,
                   delta: float = 0.0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The step direction of one meta-step at the model's parameters (one tensor per parameter)
    and the target loss; ``hessian`` (D'') and ``delta`` only for ``hf``."""
    w = {n: p.detach() for n, p in model.named_parameters()}
    g_support, _ = gradient(model, w, support, loss_fn)
    if variant == "official":
        g_target, loss = gradient(model, w, target, loss_fn)
        return [a + b for a, b in zip(g_support, g_target)], loss
    adapted = {n: p - alpha * g for (n, p), g in zip(w.items(), g_support)}
    g, loss = gradient(model, adapted, target, loss_fn)
    if variant == "fo":
        return g, loss
    if hessian is None or delta <= 0:
        raise ValueError("variant 'hf' needs a batch D'' and delta > 0")
    with torch.autocast(device_type=g[0].device.type, enabled=False):
        plus, _ = gradient(model, {n: p + delta * v for (n, p), v in zip(w.items(), g)}, hessian, loss_fn)
        minus, _ = gradient(model, {n: p - delta * v for (n, p), v in zip(w.items(), g)}, hessian, loss_fn)
    return [gi - alpha * (a - b) / (2 * delta) for gi, a, b in zip(g, plus, minus)], loss


def support_size(batch: int, fraction: float) -> int:
    """Samples of a batch of ``batch`` that form the support set (at least one, leaving one target)."""
    return min(max(int(fraction * batch + 1e-9), 1), batch - 1)


def samples(rt: ClientRuntime, idx: torch.Tensor, generator: torch.Generator) -> Batch:
    """The training samples at ``idx``, augmented as ``train.augment`` says (from ``generator``)."""
    x = rt.train.x[idx]
    if rt.augment is not None:
        x = AUGMENTATIONS[rt.augment](x, generator)
    return x, rt.train.y[idx]


def endless_batches(rt: ClientRuntime, generator: torch.Generator) -> Iterator[Batch]:
    """Mini-batches of ``train.batch_size`` from successive seeded shuffles (D'')."""
    while True:
        for idx in batch_slices(len(rt.train), int(rt.cfg.train.batch_size), generator, rt.train.y.device):
            yield samples(rt, idx, generator)


# -- client half -----------------------------------------------------------------------------
def train_meta(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Meta-steps from the received model; reply with the model (and, when asked, its local accuracy)."""
    rt.load(content[ARRAYS])
    config = round_config(content)
    server_round = int(config["server-round"])
    t, pf = rt.cfg.train, rt.cfg.perfedavg
    loss_fn = loss_function(rt.regression)
    params = list(rt.model.parameters())
    opt = rt.optimizer(server_round).build(params, rt.model)
    generator = rt.generator(server_round)
    third = endless_batches(rt, rt.generator(server_round, HESSIAN_SALT)) if pf.variant == "hf" else None
    losses = []
    rt.model.train()
    for idx in step_batches(len(rt.train), int(t.batch_size), generator, rt.train.y.device,
                            int(t.local_epochs), t.local_steps):
        if len(idx) < 2:
            continue
        x, y = samples(rt, idx, generator)
        cut = support_size(len(idx), float(pf.support_fraction))
        direction, loss = meta_direction(rt.model, (x[:cut], y[:cut]), (x[cut:], y[cut:]), loss_fn, str(pf.variant),
                                         float(pf.inner_lr), next(third) if third is not None else None,
                                         float(pf.hessian_delta))
        for p, d in zip(params, direction):
            p.grad = d
        opt.step()
        losses.append(loss)
    rt.model.zero_grad(set_to_none=True)
    metrics = {"train_loss": float(torch.stack(losses).mean()) if losses else 0.0, "local_steps": len(losses),
               NUM_EXAMPLES: len(rt.train)}
    if config.get(SCORE_LOCAL, False):
        scores = rt.evaluate_local()
        if "accuracy" in scores:
            metrics.update({LOCAL_ACCURACY: scores["accuracy"], LOCAL_TEST_EXAMPLES: scores[NUM_EXAMPLES]})
    return reply(rt.arrays(), **metrics)


def adapt(rt: ClientRuntime, server_round: int) -> None:
    """The paper's test-time personalisation, in place: w ← w − α∇f(w; B) on one seeded
    mini-batch B of ``train.batch_size`` of the client's training data."""
    generator = rt.generator(server_round, ADAPT_SALT)
    idx = next(batch_slices(len(rt.train), int(rt.cfg.train.batch_size), generator, rt.train.y.device))
    rt.model.train()
    weights = dict(rt.model.named_parameters())
    grads, _ = gradient(rt.model, weights, samples(rt, idx, generator), loss_function(rt.regression))
    with torch.no_grad():
        for p, g in zip(weights.values(), grads):
            p.sub_(g, alpha=float(rt.cfg.perfedavg.inner_lr))


def evaluate_adapted(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Score the received model after the configured adaptation on the local test split; the
    adapted weights are replaced by the received ones again and never sent."""
    rt.load(content[ARRAYS])
    config = round_config(content)
    if rt.cfg.perfedavg.eval_adaptation == "one_step" and len(rt.train):
        adapt(rt, int(config["server-round"]))
    scores = rt.evaluate_local(config)
    rt.load(content[ARRAYS])
    return reply(None, **scores)


# -- the ``perfedavg.*`` section -------------------------------------------------------------
OPEN_UNIT = Range(0.0, 1.0, True, True, "in (0, 1)")


@dataclass
class PerFedAvgConfig:
    """``perfedavg.*``."""

    variant: one_of(VARIANTS) = MISSING  # type: ignore[valid-type]  # hf | fo (the paper) | official (LocalUpdateMAML)
    inner_lr: float = positive()  # α: the inner step and the evaluation's adaptation step
    support_fraction: float = dataclasses.field(default=MISSING, metadata={RANGE: OPEN_UNIT})  # D's share of a batch
    hessian_delta: float = positive()  # δ of the Hessian-free finite difference (hf)
    eval_adaptation: one_of(ADAPTATIONS) = MISSING  # type: ignore[valid-type]  # one_step (the paper) | none (official)


def check(cfg: DictConfig) -> None:
    """A batch of ``train.batch_size`` splits into a non-empty support and target set."""
    batch, fraction = int(cfg.train.batch_size), float(cfg.perfedavg.support_fraction)
    cut = int(fraction * batch + 1e-9)
    require(1 <= cut < batch, "perfedavg.support_fraction",
            f"{fraction} of train.batch_size={batch} leaves the support or the target set empty "
            f"(needs 1 <= floor(fraction * batch) < batch)")


ALGORITHM = register(Algorithm(
    name="perfedavg",
    description="a meta-learned start that each client adapts in one step (Fallah et al. 2020)",
    make_strategy=FedAvgServer,
    handlers={"train": train_meta, "evaluate": evaluate_adapted},
    shared_keys=all_keys,
    config=PerFedAvgConfig,
    check=check,
))
