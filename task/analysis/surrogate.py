"""The surrogate-loss theory of local update methods on quadratic federations.

Charles & Konečný (2021), "Convergence and Accuracy Trade-Offs in Federated Learning and
Meta-Learning": client i has f_i(x) = ½‖A_i^{1/2}(x − c_i)‖² with μI ⪯ A_i ⪯ LI and
‖c_i‖ ≤ C. LocalUpdate(α, γ, Θ) with full-batch clients sends ∇f̃_i(x) where
f̃_i = ½‖(Q_i A_i)^{1/2}(x − c_i)‖² and Q_i = Σ_k θ_k (I − γ(A_i + αI))^{k−1} (eq. 6–8).
Everything here is numpy; the names follow the paper's equations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MOMENTUM_TYPES = ("none", "nesterov", "heavy_ball")


@dataclass(frozen=True)
class Theta:
    """Gradient weights Θ = (θ_1, ..., θ_K) of a local update method (eq. 4–5).

    ``kind`` is ``prefix`` (Θ_{1:K}: FedAvg, Reptile, FedProx, FedSGD), ``last`` (Θ_K:
    FOMAML; Θ_1 is mini-batch SGD) or ``list`` (the explicit ``values``). ``prefix`` and
    ``last`` are kept symbolic so K may be large (10⁶) in the analysis.
    """

    kind: str
    K: int
    values: tuple[float, ...] = ()

    @classmethod
    def prefix(cls, K: int) -> Theta:
        return cls("prefix", int(K))

    @classmethod
    def last(cls, K: int) -> Theta:
        return cls("last", int(K))

    @classmethod
    def of(cls, values) -> Theta:
        """An explicit list; trailing zeros are dropped (K(Θ) = max{k : θ_k > 0})."""
        vals = [float(v) for v in values]
        if not vals or any(v < 0 or not math.isfinite(v) for v in vals) or not any(v > 0 for v in vals):
            raise ValueError(f"Θ must be finite weights >= 0 with at least one > 0, got {list(values)!r}")
        while vals[-1] == 0:
            vals.pop()
        return cls("list", len(vals), tuple(vals))

    def __post_init__(self) -> None:
        if self.kind not in ("prefix", "last", "list") or self.K < 1:
            raise ValueError(f"Θ needs kind prefix|last|list and K >= 1, got {self.kind!r}, K={self.K}")

    def weight(self, k: int) -> float:
        """θ_k for k = 1..K (0 beyond K)."""
        if k < 1 or k > self.K:
            return 0.0
        if self.kind == "prefix":
            return 1.0
        if self.kind == "last":
            return 1.0 if k == self.K else 0.0
        return self.values[k - 1]

    def total(self) -> float:
        """w(Θ) = Σ θ_k."""
        return float(self.K) if self.kind == "prefix" else 1.0 if self.kind == "last" else float(sum(self.values))

    def poly(self, r: np.ndarray) -> np.ndarray:
        """Σ_k θ_k r^{k−1}, elementwise (the eigenvalues of Q_i for r = 1 − γ(λ + α))."""
        r = np.asarray(r, dtype=float)
        if self.kind == "prefix":
            with np.errstate(divide="ignore", invalid="ignore"):
                geometric = (1.0 - r**self.K) / (1.0 - r)
            return np.where(np.isclose(r, 1.0, rtol=0, atol=1e-15), float(self.K), geometric)
        if self.kind == "last":
            return r ** (self.K - 1)
        return np.polynomial.polynomial.polyval(r, np.asarray(self.values))


@dataclass(frozen=True)
class QuadraticFederation:
    """Clients f_i(x) = ½‖A_i^{1/2}(x − c_i)‖², weighted by ``p`` (default uniform)."""

    A: np.ndarray  # (n, d, d) symmetric positive definite
    c: np.ndarray  # (n, d)
    p: np.ndarray | None = None  # (n,) client probabilities

    @property
    def weights(self) -> np.ndarray:
        n = self.A.shape[0]
        return np.full(n, 1.0 / n) if self.p is None else np.asarray(self.p, dtype=float) / np.sum(self.p)

    def loss(self, x: np.ndarray) -> float:
        """f(x) = E_i f_i(x)."""
        diff = x[None, :] - self.c
        return float(self.weights @ (0.5 * np.einsum("nd,nde,ne->n", diff, self.A, diff)))

    def minimizer(self) -> np.ndarray:
        """x* = (E A_i)⁻¹ E[A_i c_i]."""
        w = self.weights
        return np.linalg.solve(np.einsum("n,nde->de", w, self.A), np.einsum("n,nde,ne->d", w, self.A, self.c))


def random_basis(d: int, rng: np.random.Generator) -> np.ndarray:
    """A random orthogonal d×d matrix."""
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return q


def random_spd(d: int, mu: float, L: float, rng: np.random.Generator, basis: np.ndarray | None = None) -> np.ndarray:
    """A random symmetric A with eigenvalues in [μ, L], μ and L among them (cond(A) = L/μ),
    with random eigenvectors or the columns of ``basis`` (μ on the first, L on the last)."""
    q = random_basis(d, rng) if basis is None else basis
    eig = rng.uniform(mu, L, size=d)
    eig[0], eig[-1] = mu, L
    if d == 1:
        eig[0] = L
    return (q * eig) @ q.T


def random_federation(num_clients: int, d: int, mu: float, L: float, C: float, rng: np.random.Generator,
                      shared_basis: bool = False) -> QuadraticFederation:
    """Random A_i (μI ⪯ A_i ⪯ LI, each with both extremes) and c_i uniform in the ball ‖c‖ ≤ C.
    With ``shared_basis`` the A_i commute (one eigenbasis, μ and L on the same directions), so
    the surrogate's condition number is exactly κ(α, γ, Θ) of eq. 9."""
    basis = random_basis(d, rng) if shared_basis else None
    A = np.stack([random_spd(d, mu, L, rng, basis) for _ in range(num_clients)])
    direction = rng.standard_normal((num_clients, d))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    radius = C * rng.uniform(size=(num_clients, 1)) ** (1.0 / d)
    return QuadraticFederation(A, direction * radius)


def distortion(A: np.ndarray, alpha: float, gamma: float, theta: Theta) -> np.ndarray:
    """Q(α, γ, Θ) = Σ_k θ_k (I − γ(A + αI))^{k−1} (eq. 6) for one A or a stack (n, d, d)."""
    lam, vec = np.linalg.eigh(A)
    q = theta.poly(1.0 - gamma * (lam + alpha))
    return (vec * q[..., None, :]) @ np.swapaxes(vec, -1, -2)


def surrogate_hessian(fed: QuadraticFederation, alpha: float, gamma: float, theta: Theta) -> np.ndarray:
    """∇²f̃ = E_i[Q_i A_i] (eq. 7–8)."""
    QA = distortion(fed.A, alpha, gamma, theta) @ fed.A
    return np.einsum("n,nde->de", fed.weights, QA)


def surrogate_gradient(fed: QuadraticFederation, x: np.ndarray, alpha: float, gamma: float,
                       theta: Theta) -> np.ndarray:
    """∇f̃(x, α, γ, Θ) = E_i[Q_i A_i (x − c_i)], what Theorem 1 says the clients send on average."""
    QA = distortion(fed.A, alpha, gamma, theta) @ fed.A
    return np.einsum("n,nde,ne->d", fed.weights, QA, x[None, :] - fed.c)


def surrogate_minimizer(fed: QuadraticFederation, alpha: float, gamma: float, theta: Theta) -> np.ndarray:
    """x*(α, γ, Θ) = (E Q_i A_i)⁻¹ E[Q_i A_i c_i]."""
    QA = distortion(fed.A, alpha, gamma, theta) @ fed.A
    w = fed.weights
    return np.linalg.solve(np.einsum("n,nde->de", w, QA), np.einsum("n,nde,ne->d", w, QA, fed.c))


def client_update(A: np.ndarray, c: np.ndarray, x: np.ndarray, alpha: float, gamma: float, theta: Theta) -> np.ndarray:
    """Algorithm 2 with full-batch gradients on f_i, step by step: Σ_k θ_k g_k."""
    xk, out = x.copy(), np.zeros_like(x)
    for k in range(1, theta.K + 1):
        g = A @ (xk - c) + alpha * (xk - x)
        out += theta.weight(k) * g
        xk = xk - gamma * g
    return out


def kappa(fed: QuadraticFederation, alpha: float, gamma: float, theta: Theta) -> float:
    """κ(α, γ, Θ) = E_i λ_max(Q_i A_i) / E_i λ_min(Q_i A_i) (eq. 9); Q_i and A_i commute."""
    lam = np.linalg.eigvalsh(fed.A)
    qa = theta.poly(1.0 - gamma * (lam + alpha)) * lam
    w = fed.weights
    return float((w @ qa.max(axis=1)) / (w @ qa.min(axis=1)))


def phi(lam: float, alpha: float, gamma: float, K: int) -> float:
    """φ(λ, α, γ, K) = Σ_{k=1}^K (1 − γ(λ + α))^{k−1} λ (eq. 10)."""
    return float(Theta.prefix(K).poly(1.0 - gamma * (lam + alpha)) * lam)


def psi(lam: float, alpha: float, gamma: float, K: int) -> float:
    """ψ(λ, α, γ, K) = (1 − γ(λ + α))^{K−1} λ (eq. 12)."""
    return float((1.0 - gamma * (lam + alpha)) ** (K - 1) * lam)


def kappa_prefix(mu: float, L: float, alpha: float, gamma: float, K: int) -> float:
    """The bound (11) on κ(α, γ, Θ_{1:K}): φ(L)/φ(μ) (needs γ < 1/(L + α))."""
    return phi(L, alpha, gamma, K) / phi(mu, alpha, gamma, K)


def kappa_last(mu: float, L: float, alpha: float, gamma: float, K: int) -> float:
    """The bound (13) on κ(α, γ, Θ_K): ((1 − γ(L+α))/(1 − γ(μ+α)))^{K−1} L/μ (needs γ < 1/(KL + α))."""
    return ((1.0 - gamma * (L + alpha)) / (1.0 - gamma * (mu + alpha))) ** (K - 1) * L / mu


def rate(kappa_value: float, momentum: str = "none") -> float:
    """ρ of Table 2 for server gradient descent with no, Nesterov or heavy-ball momentum."""
    k = float(kappa_value)
    if momentum == "none":
        return (k - 1.0) / (k + 1.0)
    if momentum == "nesterov":
        return 1.0 - 2.0 / math.sqrt(3.0 * k + 1.0)
    if momentum == "heavy_ball":
        return (math.sqrt(k) - 1.0) / (math.sqrt(k) + 1.0)
    raise ValueError(f"momentum: unknown type {momentum!r}; allowed: {', '.join(MOMENTUM_TYPES)}")


def suboptimality(kappa0: float, kappa_value: float) -> float:
    """Δ = (√κ₀ − √κ)/(√κ₀ + √κ) (eq. 17), κ₀ = L/μ."""
    a, b = math.sqrt(kappa0), math.sqrt(kappa_value)
    return (a - b) / (a + b)


def tuned_server(mu: float, L: float, momentum: str = "none") -> tuple[float, float]:
    """Server learning rate and momentum attaining ρ of Table 2 on a μ-strongly convex,
    L-smooth quadratic (Lessard et al. 2016, Proposition 1)."""
    k = L / mu
    if momentum == "none":
        return 2.0 / (L + mu), 0.0
    if momentum == "nesterov":
        s = math.sqrt(3.0 * k + 1.0)
        return 4.0 / (3.0 * L + mu), (s - 2.0) / (s + 2.0)
    if momentum == "heavy_ball":
        return 4.0 / (math.sqrt(L) + math.sqrt(mu)) ** 2, ((math.sqrt(k) - 1.0) / (math.sqrt(k) + 1.0)) ** 2
    raise ValueError(f"momentum: unknown type {momentum!r}; allowed: {', '.join(MOMENTUM_TYPES)}")
