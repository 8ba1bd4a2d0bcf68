"""LocalUpdate(α, γ, Θ, ServerOpt) and MAML clients (Charles & Konečný 2021, Algorithms 1–2).

Client (Algorithm 2): from the broadcast x_t, K(Θ) steps of mini-batch SGD (batch
``train.batch_size``, learning rate γ = ``local_update.client_lr``) on
f_i(x) + (α/2)‖x − x_t‖²; the reply is the pseudo-gradient Σ_k θ_k g_k (parameters only).
The MAML client instead runs K steps from x, evaluates the loss on one more mini-batch at
the end point X_K(x) and replies with its gradient ∇_x m_K(x), differentiating through the
K steps (second order).
Server (Algorithm 1): q_t = the average of the replies (uniform 1/M as in the paper, or
example-weighted), then ServerOpt(x_t, q_t): gradient descent and heavy-ball momentum are
Flower's FedAvgM (which steps on x_t − model, fed the model x_t − q_t); Nesterov momentum and
bias-corrected Adam are implemented here (Flower's FedAdam corrects with t = round + 1,
not the number of steps taken).

Presets (``local_update.preset``, Table 1 of the paper): ``fedavg`` (Θ_{1:K}, α = 0;
FedAvg and Reptile), ``fedsgd`` (Θ_{1:K}, γ = 0), ``minibatch_sgd`` (Θ_1), ``fedprox``
(Θ_{1:K}, α > 0), ``fomaml`` (Θ_K), ``maml`` (the MAML client, α = 0) and ``custom``
(``local_update.theta``: any list of weights θ_1..θ_K).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedAvgM, Strategy
from omegaconf import MISSING, DictConfig
from torch.func import functional_call

from strategies.flower_compat import checked_replies
from strategies.checks import nonnegative, one_of, positive, require
from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, all_keys, register
from strategies.common import ARRAYS, METRICS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from task.learning.engine import loss_function, step_batches
from strategies.services import Services
from task.analysis.surrogate import Theta
from task.errors import ConfigError

PRESETS = ("fedavg", "fedsgd", "minibatch_sgd", "fedprox", "fomaml", "maml", "custom")
SERVER_OPTS = ("none", "heavy_ball", "nesterov", "adam")  # none: plain gradient descent
WEIGHTINGS = ("uniform", "examples")

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def preset_theta(cfg: DictConfig) -> Theta:
    """Θ of the configured preset (``maml``: the K steps it runs, Θ_K)."""
    lu = cfg.local_update
    preset, K = str(lu.preset), int(lu.steps)
    if preset == "custom":
        return Theta.of(list(lu.theta))
    if preset == "minibatch_sgd":
        return Theta.last(1)
    if preset in ("fomaml", "maml"):
        return Theta.last(K)
    return Theta.prefix(K)


def preset_problem(cfg: DictConfig) -> str | None:
    """Why ``local_update`` contradicts its preset's conditions (Table 1), or None."""
    lu = cfg.local_update
    preset, alpha, gamma = str(lu.preset), float(lu.alpha), float(lu.client_lr)
    if preset == "custom" and not lu.theta:
        return "local_update.theta: preset=custom needs a list of weights [θ_1, ..., θ_K]"
    if preset != "custom" and lu.theta is not None:
        return f"local_update.theta: set only with preset=custom (preset={preset} defines Θ)"
    if preset in ("fedavg", "fomaml", "maml") and alpha != 0:
        return f"local_update.alpha: preset={preset} has α = 0 (use fedprox or custom for a proximal term)"
    if preset == "fedprox" and alpha <= 0:
        return "local_update.alpha: preset=fedprox needs α > 0"
    if preset == "fedsgd" and (gamma != 0 or alpha != 0):
        return "local_update.client_lr: preset=fedsgd is Θ_{1:K} with γ = 0 and α = 0: set local_update.client_lr=0"
    if preset in ("fedavg", "fedprox", "fomaml", "maml") and gamma <= 0:
        return f"local_update.client_lr: preset={preset} needs γ > 0 (γ = 0 is fedsgd)"
    return None


# -- client half ---------------------------------------------------------------------------


def pseudo_gradient(model: torch.nn.Module, batches: Iterator[Batch], loss_fn: LossFn, alpha: float,
                    gamma: float, theta: Theta) -> tuple[dict[str, torch.Tensor], float]:
    """Algorithm 2: K(Θ) steps x_{k+1} = x_k − γ g_k with g_k the mini-batch gradient of
    f_i + (α/2)‖x − x_t‖² at x_k; returns Σ_k θ_k g_k by parameter name and the mean loss."""
    params = dict(model.named_parameters())
    anchor = {n: p.detach().clone() for n, p in params.items()}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    losses = []
    model.train()
    for k in range(1, theta.K + 1):
        xb, yb = next(batches)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        losses.append(loss.detach())
        weight = theta.weight(k)
        with torch.no_grad():
            for n, p in params.items():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if alpha:
                    g = g + alpha * (p - anchor[n])
                if weight:
                    total[n].add_(g, alpha=weight)
                if gamma:
                    p.sub_(g, alpha=gamma)
    model.zero_grad(set_to_none=True)
    return total, float(torch.stack(losses).mean())


def maml_gradient(model: torch.nn.Module, batches: Iterator[Batch], loss_fn: LossFn, gamma: float,
                  steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """MAML: X_K(x) by K mini-batch steps of size γ, then ∇_x f(X_K(x); S_{K+1}) through the
    steps (second order); returns the gradient by parameter name and the outer loss."""
    model.train()
    start = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    fast = dict(start)
    for _ in range(steps):
        xb, yb = next(batches)
        loss = loss_fn(functional_call(model, fast, (xb,)), yb)
        grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
        fast = {n: w - gamma * g for (n, w), g in zip(fast.items(), grads)}
    xb, yb = next(batches)
    outer = loss_fn(functional_call(model, fast, (xb,)), yb)
    grads = torch.autograd.grad(outer, list(start.values()))
    return {n: g.detach() for n, g in zip(start, grads)}, float(outer.detach())


def client_batches(rt: ClientRuntime, server_round: int, count: int) -> Iterator[Batch]:
    """``count`` mini-batches of ``train.batch_size`` from the client's seeded shuffles."""
    idx = step_batches(len(rt.train), int(rt.cfg.train.batch_size), rt.generator(server_round),
                       rt.train.y.device, None, count)
    return ((rt.train.x[i], rt.train.y[i]) for i in idx)


def local_update_train(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """The client half: reply with the pseudo-gradient (or the MAML gradient)."""
    rt.load(content[ARRAYS])
    server_round = int(round_config(content).get("server-round", 0))
    lu = rt.cfg.local_update
    theta, gamma = preset_theta(rt.cfg), float(lu.client_lr)
    loss_fn = loss_function(rt.regression)
    if str(lu.preset) == "maml":
        grads, loss = maml_gradient(rt.model, client_batches(rt, server_round, theta.K + 1), loss_fn, gamma, theta.K)
    else:
        grads, loss = pseudo_gradient(rt.model, client_batches(rt, server_round, theta.K), loss_fn,
                                      float(lu.alpha), gamma, theta)
    arrays = ArrayRecord({n: g.cpu() for n, g in grads.items()})
    return reply(arrays, train_loss=loss, local_steps=theta.K, **{NUM_EXAMPLES: len(rt.train)})


# -- server half ---------------------------------------------------------------------------


class PseudoGradientAverage(ServerHooks, FedAvg):
    """Averages the clients' pseudo-gradients into q_t (kept as ``pseudo_gradient``) and
    returns the model x_t − q_t: plain gradient descent with step 1, and what a Flower server
    optimizer that works on averaged models (FedAvgM) turns back into q_t."""

    def __init__(self, weighting: str = "uniform", **kwargs) -> None:
        super().__init__(**TAKE_ALL_NODES, **kwargs)
        if weighting not in WEIGHTINGS:
            raise ValueError(f"local_update.weighting: unknown value {weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
        self.weighting = weighting
        self.pseudo_gradient: dict[str, np.ndarray] | None = None
        self._sent: ArrayRecord | None = None
        self.parameter_keys: set[str] = set()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._sent = arrays
        config["server-round"] = server_round
        return super().configure_train(server_round, arrays, config, grid)

    def on_start(self, services: Services) -> None:
        """Learn which state keys are parameters: only they carry pseudo-gradients."""
        self.parameter_keys = {name for name, _ in services.model.named_parameters()}

    def reply_template(self, message: Message) -> dict[str, ArrayRecord]:
        """A pseudo-gradient for every parameter of the model the client was sent."""
        arrays = message.content[ARRAYS]
        return {ARRAYS: ArrayRecord({k: arrays[k] for k in arrays if k in self.parameter_keys})}

    def average(self, replies: Iterable[Message]) -> MetricRecord | None:
        """Set ``pseudo_gradient`` to q_t of the valid replies; their aggregated metrics (None
        when no reply carries arrays)."""
        valid, _ = checked_replies(replies, is_train=True)
        valid = [m for m in valid if ARRAYS in m.content]
        self.pseudo_gradient = None
        if not valid or self._sent is None:
            return None
        weights = np.array([1.0 if self.weighting == "uniform" else float(m.content[METRICS][NUM_EXAMPLES])
                            for m in valid])
        weights /= weights.sum()
        grads = [m.content[ARRAYS].to_numpy_ndarrays() for m in valid]
        keys = list(valid[0].content[ARRAYS].keys())
        self.pseudo_gradient = {k: sum(w * g[j].astype(np.float64) for w, g in zip(weights, grads))
                                for j, k in enumerate(keys)}
        return self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        metrics = self.average(replies)
        if self.pseudo_gradient is None:
            return None, None
        q = self.pseudo_gradient
        moved = {k: Array(np.asarray(v - q[k].astype(v.dtype)) if k in q else v)
                 for k, v in ((k, a.numpy()) for k, a in self._sent.items())}
        return ArrayRecord(moved), metrics


class ServerStep(PseudoGradientAverage):
    """A server optimizer implemented here: ``step`` moves the broadcast x_t by the exact q_t."""

    def step(self, x: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new values of the keys of ``q`` (x's other keys stay)."""
        raise NotImplementedError

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        metrics = self.average(replies)
        if self.pseudo_gradient is None:
            return None, None
        x = {k: a.numpy() for k, a in self._sent.items()}
        stepped = self.step({k: x[k] for k in self.pseudo_gradient}, self.pseudo_gradient)
        return ArrayRecord({k: Array(np.asarray(stepped[k], dtype=v.dtype) if k in stepped else v)
                            for k, v in x.items()}), metrics


class LocalUpdateGD(FedAvgM, PseudoGradientAverage):
    """Gradient descent (momentum 0) or heavy-ball momentum: Flower's FedAvgM on x_t − q_t
    (v ← βv + q, x ← x − ηv)."""

    checkpointed = ("current_arrays", "momentum_vector")

    def __init__(self, lr: float, momentum: float, weighting: str) -> None:
        PseudoGradientAverage.__init__(self, weighting)
        self.server_learning_rate, self.server_momentum = float(lr), float(momentum)
        self.server_opt = self.server_momentum != 0.0 or self.server_learning_rate != 1.0
        self.current_arrays, self.momentum_vector = None, None


class LocalUpdateNesterov(ServerStep):
    """Nesterov momentum in its momentum form (PyTorch's): v ← βv + q, x ← x − η(q + βv);
    the broadcast model is the look-ahead point where Nesterov evaluates its gradient."""

    checkpointed = ("velocity",)

    def __init__(self, lr: float, momentum: float, weighting: str) -> None:
        super().__init__(weighting)
        self.lr, self.momentum = float(lr), float(momentum)
        self.velocity: dict[str, np.ndarray] = {}

    def step(self, x: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for k, g in q.items():
            v = self.momentum * self.velocity.get(k, np.zeros_like(g)) + g
            self.velocity[k] = v
            out[k] = x[k] - self.lr * (g + self.momentum * v)
        return out


class LocalUpdateAdam(ServerStep):
    """Adam (Kingma & Ba) on q_t with bias correction by the number of server steps t:
    x ← x − η m̂/(√v̂ + ε), ε = ``server_opt.tau``."""

    checkpointed = ("m", "v", "t")

    def __init__(self, lr: float, beta_1: float, beta_2: float, eps: float, weighting: str) -> None:
        super().__init__(weighting)
        self.lr, self.beta_1, self.beta_2, self.eps = float(lr), float(beta_1), float(beta_2), float(eps)
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.t = 0

    def step(self, x: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.t += 1
        out = {}
        for k, g in q.items():
            self.m[k] = self.beta_1 * self.m.get(k, np.zeros_like(g)) + (1 - self.beta_1) * g
            self.v[k] = self.beta_2 * self.v.get(k, np.zeros_like(g)) + (1 - self.beta_2) * g * g
            m_hat = self.m[k] / (1 - self.beta_1**self.t)
            v_hat = self.v[k] / (1 - self.beta_2**self.t)
            out[k] = x[k] - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)
        return out


def make_strategy(cfg: DictConfig) -> Strategy:
    """The LocalUpdate server with the configured ServerOpt."""
    opt, weighting = cfg.server_opt, str(cfg.local_update.weighting)
    if opt.name == "nesterov":
        return LocalUpdateNesterov(opt.lr, opt.momentum, weighting)
    if opt.name == "adam":
        return LocalUpdateAdam(opt.lr, opt.beta_1, opt.beta_2, opt.tau, weighting)
    if opt.name not in ("none", "heavy_ball"):
        raise ValueError(f"server_opt.name: {opt.name!r} is not a LocalUpdate server optimizer; allowed: {', '.join(SERVER_OPTS)}")
    return LocalUpdateGD(opt.lr, opt.momentum if opt.name == "heavy_ball" else 0.0, weighting)


@dataclass
class LocalUpdateConfig:
    """``local_update.*``."""

    preset: one_of(PRESETS) = MISSING  # type: ignore[valid-type]
    theta: Optional[list[float]] = MISSING  # preset=custom: θ_1..θ_K (checked with the preset)
    steps: int = positive()  # K
    client_lr: float = nonnegative()  # γ
    alpha: float = nonnegative()  # α
    weighting: one_of(WEIGHTINGS) = MISSING  # type: ignore[valid-type]


def check(cfg: DictConfig) -> None:
    """θ and the conditions of each preset (the paper's Table 1)."""
    theta = cfg.local_update.theta
    if theta is not None:
        try:
            ok = Theta.of(list(theta)) is not None
        except ValueError:
            ok = False
        require(ok, "local_update.theta", f"got {theta!r}, expected null or a list of weights >= 0, at least one > 0")
    problem = preset_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)


ALGORITHM = register(Algorithm(
    name="local_update",
    description="weighted local steps, a proximal α and a server optimizer (Charles & Konečný 2021)",
    make_strategy=make_strategy,
    handlers={"train": local_update_train},
    shared_keys=all_keys,
    config=LocalUpdateConfig,
    check=check,
    server_opts=SERVER_OPTS,
))
