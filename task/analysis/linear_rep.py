"""Measurements of the multi-task linear representation experiments (FedRep §4–5.1, FedAvg-FT §3, §5.1).

The model is ``linear_rep``: body ``B`` (stored as ``body.weight`` = Bᵀ, k × d) and head
``w``. These functions read a model's weights and the generator's ground truth ``B*``;
they never train anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from task.learning.engine import TensorData


def principal_angle_distance(b: np.ndarray, b_star: np.ndarray) -> float:
    """dist(B, B*) = ‖B̂⊥ᵀ B̂*‖₂: the sine of the largest principal angle between col(B) and col(B*)."""
    q, _ = np.linalg.qr(np.asarray(b, dtype=np.float64))
    q_star, _ = np.linalg.qr(np.asarray(b_star, dtype=np.float64))
    residual = q_star - q @ (q.T @ q_star)  # (I − QQᵀ) B̂*, whose norm equals ‖B̂⊥ᵀ B̂*‖
    return float(np.linalg.norm(residual, ord=2))


def representation_of(model: nn.Module) -> np.ndarray:
    """B (d × k) of a ``linear_rep`` model."""
    return model.get_submodule("body").weight.detach().cpu().double().numpy().T


def global_gradient_norm(model: nn.Module, data: TensorData) -> float:
    """‖∇θ (1/N) Σ_i n_i f_i(θ)‖ for the mean-squared-error training loss over all clients' data."""
    params = [p for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(data.x).squeeze(-1), data.y)
    grads = torch.autograd.grad(loss, params)
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))


def new_client_errors(
    b: np.ndarray,
    b_star: np.ndarray,
    samples: Sequence[int],
    tasks: int,
    noise: float,
    head_scale: float,
    seed: int,
) -> dict[str, dict[int, float]]:
    """Error ‖B w − B* w*‖² of new clients that fit only a head on ``n`` samples, per ``n``.

    Each of ``tasks`` new clients draws w* ~ N(0, I_k)·head_scale, x ~ N(0, I_d) and
    y = ⟨B* w*, x⟩ + noise, and solves the least-squares head on the features xᵀB (FedRep
    Figure 4). ``local_only`` is the minimum-norm least-squares fit of θ ∈ R^d on the same
    samples without any representation, the Local Only reference of that figure.
    """
    b = np.asarray(b, dtype=np.float64)
    b_star = np.asarray(b_star, dtype=np.float64)
    d, k = b_star.shape
    rng = np.random.default_rng([0x4E3, int(seed)])
    heads = rng.standard_normal((tasks, k)) * head_scale
    errors: dict[str, dict[int, float]] = {"head_on_learned_b": {}, "local_only": {}}
    for n in samples:
        learned, local = [], []
        for w_star in heads:
            theta = b_star @ w_star
            x = rng.standard_normal((int(n), d))
            y = x @ theta + noise * rng.standard_normal(int(n))
            w = np.linalg.lstsq(x @ b, y, rcond=None)[0]
            learned.append(float(np.sum((b @ w - theta) ** 2)))
            local.append(float(np.sum((np.linalg.lstsq(x, y, rcond=None)[0] - theta) ** 2)))
        errors["head_on_learned_b"][int(n)] = float(np.mean(learned))
        errors["local_only"][int(n)] = float(np.mean(local))
    return errors


def scaled_orthonormal_init(model: nn.Module, lr: float, generator: torch.Generator) -> None:
    """B0 = Q / sqrt(2·lr) with Q a random orthonormal d × k matrix, head w0 = 0.

    FedAvg-FT Theorem 1 asks for ‖I − αB0ᵀB0‖ ≈ 0 and a small w0, with α the step on the
    ½‖·‖² loss; the engine's mean-squared error has twice that gradient, so α = 2·lr.
    """
    body, head = model.get_submodule("body"), model.get_submodule("head")
    d, k = body.weight.shape[1], body.weight.shape[0]
    q, r = torch.linalg.qr(torch.randn(d, k, generator=generator, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    with torch.no_grad():
        body.weight.copy_((q / np.sqrt(2.0 * lr)).T.to(body.weight.dtype))
        head.weight.zero_()
