"""APFL's local loops: a global model w and a personal model v trained side by side on the same
batches, v through the mixture v̄ = αv + (1 − α)w (Deng, Kamani, Mahdavi 2020, Algorithm 1), or
as the official FedRep code's ``LocalUpdateAPFL`` writes it."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from task.learning.engine import OptimizerConfig, TensorData, TrainResult, loss_function, training_batches


def mixed_state(personal: dict[str, torch.Tensor], global_: dict[str, torch.Tensor],
                alpha: float) -> dict[str, torch.Tensor]:
    """αv + (1 − α)w for every floating-point entry; other entries (counters) from w."""
    return {k: alpha * personal[k] + (1.0 - alpha) * w if w.is_floating_point() else w for k, w in global_.items()}


def train_mixture(global_model: nn.Module, personal_model: nn.Module, alpha: float, data: TensorData,
                  optimizer: OptimizerConfig, batch_size: int, generator: torch.Generator,
                  epochs: int | None = 1, steps: int | None = None, adaptive: bool = False,
                  regression: bool = False, augment: str | None = None) -> tuple[TrainResult, float]:
    """Train both models in place; returns w's training result and the (possibly updated) α.

    Each batch: w ← w − lr·∇f(w); v ← v − lr·∇_v f(v̄) = v − lr·α∇f(v̄), v̄ formed with the
    w of before the step; with ``adaptive``, also α ← α − lr·∂f(v̄)/∂α = α − lr·⟨v − w, ∇f(v̄)⟩,
    kept in [0, 1]. Each model has its own optimizer (momentum, weight decay) of ``optimizer``.
    """
    loss_fn = loss_function(regression)
    names = [name for name, _ in personal_model.named_parameters()]
    weights_w, weights_v = list(global_model.parameters()), list(personal_model.parameters())
    opt_w, opt_v = optimizer.build(weights_w, global_model), optimizer.build(weights_v, personal_model)
    a = torch.tensor(float(alpha), device=data.y.device, requires_grad=adaptive)
    global_model.train()
    personal_model.train()
    total = torch.zeros((), device=data.y.device)
    num_steps, samples = 0, 0
    for xb, yb in training_batches(data, batch_size, generator, epochs, steps, augment):
        opt_w.zero_grad(set_to_none=True)
        loss = loss_fn(global_model(xb), yb)
        loss.backward()
        opt_v.zero_grad(set_to_none=True)
        mixed = {n: a * v + (1 - a) * w.detach() for n, v, w in zip(names, weights_v, weights_w)}
        loss_fn(functional_call(personal_model, mixed, (xb,)), yb).backward()
        opt_w.step()
        opt_v.step()
        if adaptive:
            with torch.no_grad():
                a.sub_(a.grad, alpha=optimizer.lr).clamp_(0.0, 1.0)
                a.grad = None
        total += loss.detach() * len(yb)
        samples += len(yb)
        num_steps += 1
    return TrainResult(float(total) / max(samples, 1), num_steps, samples), float(a.detach())


def train_mixture_official(global_model: nn.Module, personal_model: nn.Module, alpha: float, data: TensorData,
                           optimizer: OptimizerConfig, batch_size: int, generator: torch.Generator,
                           epochs: int | None = 1, steps: int | None = None, regression: bool = False,
                           augment: str | None = None) -> TrainResult:
    """The official FedRep code's ``LocalUpdateAPFL`` step, in place; returns w's training result.

    Each batch, with one optimizer (one momentum buffer) for both steps: w takes its SGD step on
    f(w); the model is set to u = αv + αw (w of before that step: the code's slip for
    αv + (1 − α)w), steps on α·f(u), and v moves by that step, v ← v + (u' − u); then w is restored.
    Only parameters are mixed and stepped (buffers stay w's).
    """
    loss_fn = loss_function(regression)
    weights_w, weights_v = list(global_model.parameters()), list(personal_model.parameters())
    opt = optimizer.build(weights_w, global_model)
    global_model.train()
    total = torch.zeros((), device=data.y.device)
    num_steps, samples = 0, 0
    for xb, yb in training_batches(data, batch_size, generator, epochs, steps, augment):
        before = [w.detach().clone() for w in weights_w]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(global_model(xb), yb)
        loss.backward()
        opt.step()
        stepped = [w.detach().clone() for w in weights_w]
        with torch.no_grad():
            for w, v, w0 in zip(weights_w, weights_v, before):
                w.copy_(alpha * v + alpha * w0)
        opt.zero_grad(set_to_none=True)
        (alpha * loss_fn(global_model(xb), yb)).backward()
        opt.step()
        with torch.no_grad():
            for w, v, w0, w1 in zip(weights_w, weights_v, before, stepped):
                v.add_(w - (alpha * v + alpha * w0))  # u' − u, u recomputed bit for bit
                w.copy_(w1)
        total += loss.detach() * len(yb)
        samples += len(yb)
        num_steps += 1
    return TrainResult(float(total) / max(samples, 1), num_steps, samples)
