"""TCT stage 2 (Yu et al., 2022): standardised eNTK features and one client's least-squares
problem, whose M local gradient-descent steps are computed exactly in closed form.

A client's problem is f(W) = (1/2n)·‖Z W − Y‖²_F over W ∈ R^{p×C} (Z: its n standardised
feature rows, Y: one-hot targets), with gradient (1/n)·Zᵀ(Z W − Y) as in the official code
(the paper writes the loss without the ½; its η = 5e-5 is stable only with this gradient).
SCAFFOLD's local step is W ← W − η(∇f(W) + d) with the constant correction d = c − c_i.
Because f is quadratic, M such steps are an affine map of W: in the eigenbasis of the smaller
Gram matrix (ZZᵀ when n ≤ p, ZᵀZ otherwise) every mode is a scalar recursion with a
geometric-series solution, so a round costs three passes over Z instead of 2M.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

FEATURE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NUMPY_STORAGE = {torch.float16: np.float16, torch.bfloat16: np.int16, torch.float32: np.float32}


def open_feature_file(path: Path, shape: tuple[int, int] | None = None,
                      dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A disk-backed (n, p) tensor in ``path`` (``.npy``): created with ``shape`` when given,
    else opened read-write. bfloat16 is stored as its 16-bit pattern."""
    if shape is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        array = np.lib.format.open_memmap(path, mode="w+", dtype=_NUMPY_STORAGE[dtype], shape=shape)
    else:
        array = np.load(path, mmap_mode="r+")
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def feature_moments(raw: torch.Tensor, block_rows: int = 4096) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, per-feature sums, per-feature sums of squares) of the stored features, in float64."""
    sums = torch.zeros(raw.shape[1], dtype=torch.float64)
    squares = torch.zeros(raw.shape[1], dtype=torch.float64)
    for start in range(0, raw.shape[0], block_rows):
        block = raw[start:start + block_rows].to(torch.float64)
        sums += block.sum(0)
        squares += (block * block).sum(0)
    return raw.shape[0], sums, squares


def standardization(count: int, sums: torch.Tensor, squares: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (population) standard deviation from aggregated moments; a constant
    feature gets std 1, so it standardises to 0 instead of dividing by zero."""
    mean = sums / count
    var = (squares / count - mean * mean).clamp_min(0.0)
    std = var.sqrt()
    std[std <= 1e-12 * mean.abs().clamp_min(1.0)] = 1.0
    return mean.float(), std.float()


class FeatureMatrix:
    """Stored features Z (n, p), optionally standardised ((Z − mean)/std), read as float32 row
    blocks on ``device`` so memory stays at one block (``block_bytes``)."""

    def __init__(self, raw: torch.Tensor, mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
                 device: torch.device | str = "cpu", block_bytes: int = 1 << 28) -> None:
        self.raw, self.device = raw, torch.device(device)
        self.mean = None if mean is None else mean.to(self.device, torch.float32)
        self.inv_std = None if std is None else (1.0 / std).to(self.device, torch.float32)
        self.block_rows = max(1, block_bytes // (4 * max(1, raw.shape[1])))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.raw.shape)  # type: ignore[return-value]

    def blocks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """(row slice, standardised float32 block on the device), in order."""
        for start in range(0, self.raw.shape[0], self.block_rows):
            rows = slice(start, min(start + self.block_rows, self.raw.shape[0]))
            block = self.raw[rows].to(self.device, non_blocking=True).float()
            if self.mean is not None:
                block = (block - self.mean) * self.inv_std
            yield rows, block

    def matmul(self, w: torch.Tensor) -> torch.Tensor:
        """Z W, (n, C)."""
        w = w.to(self.device, torch.float32)
        return torch.cat([block @ w for _, block in self.blocks()]) if self.raw.shape[0] else w.new_zeros((0, w.shape[1]))

    def rmatmul(self, a: torch.Tensor) -> torch.Tensor:
        """Zᵀ A, (p, C)."""
        a = a.to(self.device, torch.float32)
        out = torch.zeros(self.raw.shape[1], a.shape[1], device=self.device)
        for rows, block in self.blocks():
            out += block.T @ a[rows]
        return out

    def gram(self) -> torch.Tensor:
        """The smaller Gram matrix in float64: Z Zᵀ (n ≤ p) or Zᵀ Z."""
        n, p = self.shape
        if p < n:
            out = torch.zeros(p, p, dtype=torch.float64, device=self.device)
            for _, block in self.blocks():
                out += (block.T @ block).double()
            return out
        out = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        blocks = list(self.blocks()) if n * p * 4 <= 1 << 30 else None
        for rows_i, block_i in (blocks or self.blocks()):
            for rows_j, block_j in (blocks or self.blocks()):
                if rows_j.start > rows_i.start:
                    break
                product = (block_i @ block_j.T).double()
                out[rows_i, rows_j] = product
                out[rows_j, rows_i] = product.T
        return out


def one_hot_targets(labels: torch.Tensor, num_classes: int, centered: bool) -> torch.Tensor:
    """One-hot targets (the paper), minus 1/C when ``centered`` (the official code)."""
    y = torch.nn.functional.one_hot(labels.long(), num_classes).float()
    return y - 1.0 / num_classes if centered else y


def _series(a: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For β = 1 − a: (β^M, S1 = Σ_{m<M} β^m, S2 = Σ_{m<M} Σ_{s<m} β^s), stable for small a."""
    m = float(steps)
    beta = 1.0 - a
    power = torch.where(beta > 0, torch.exp(m * torch.log1p(-a.clamp(max=1.0))), beta ** steps)
    small = a.abs() * m < 1e-4
    safe = torch.where(small, torch.ones_like(a), a)
    s1 = torch.where(small, m - a * m * (m - 1) / 2, (1.0 - power) / safe)
    s2 = torch.where(small, m * (m - 1) / 2 - a * m * (m - 1) * (m - 2) / 6, (m - s1) / safe)
    return power, s1, s2


class LocalLeastSquares:
    """One client's f(W) = (1/2n)‖Z W − Y‖² with exact closed-form local gradient descent."""

    def __init__(self, features: FeatureMatrix, targets: torch.Tensor,
                 spectrum: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.z, self.n = features, features.shape[0]
        self.y = targets.to(features.device, torch.float32)
        self.dual = features.shape[0] <= features.shape[1]
        self.eigenvalues, self.eigenvectors = spectrum if spectrum is not None else self.spectrum(features)

    @staticmethod
    def spectrum(features: FeatureMatrix) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenvalues (clamped at 0) and eigenvectors of the smaller Gram matrix, float64."""
        values, vectors = torch.linalg.eigh(features.gram())
        return values.clamp_min(0.0), vectors

    def max_stable_lr(self) -> float:
        """2/λ_max of (1/n)ZᵀZ: gradient descent diverges above this step size."""
        top = float(self.eigenvalues.max()) / max(self.n, 1) if self.eigenvalues.numel() else 0.0
        return math.inf if top == 0 else 2.0 / top

    def gradient(self, w: torch.Tensor) -> torch.Tensor:
        """(1/n) Zᵀ(Z W − Y)."""
        return self.z.rmatmul(self.z.matmul(w) - self.y) / max(self.n, 1)

    def loss_and_accuracy(self, w: torch.Tensor) -> tuple[float, float]:
        """Mean ‖Wᵀz − y‖² (the paper's L_k) and argmax accuracy on this client's data."""
        out = self.z.matmul(w)
        loss = float(((out - self.y) ** 2).sum(1).mean()) if self.n else 0.0
        accuracy = float((out.argmax(1) == self.y.argmax(1)).float().mean()) if self.n else 0.0
        return loss, accuracy

    def gradient_descent(self, w0: torch.Tensor, steps: int, lr: float, correction: torch.Tensor | None = None) -> torch.Tensor:
        """W after ``steps`` steps W ← W − lr·(∇f(W) + correction) from ``w0``, exactly."""
        device = self.z.device
        w0 = w0.to(device, torch.float64)
        d = torch.zeros_like(w0) if correction is None else correction.to(device, torch.float64)
        if steps == 0 or self.n == 0:
            return (w0 - steps * lr * d).float()
        a = (lr * self.eigenvalues / self.n).to(device)
        power, s1, s2 = _series(a, steps)
        vecs = self.eigenvectors.to(device)
        if self.dual:
            residual = self.z.matmul(w0.float()).double() - self.y.double()
            drift = self.z.matmul(d.float()).double()
            summed = s1[:, None] * (vecs.T @ residual) - lr * s2[:, None] * (vecs.T @ drift)
            dual = -(lr / self.n) * (vecs @ summed)
            return (w0 - steps * lr * d + self.z.rmatmul(dual.float()).double()).float()
        b = self.z.rmatmul(self.y).double() / self.n - d
        return (vecs @ (power[:, None] * (vecs.T @ w0) + lr * s1[:, None] * (vecs.T @ b))).float()
