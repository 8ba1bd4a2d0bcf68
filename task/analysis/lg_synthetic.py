"""LG-FedAvg's synthetic analysis (Liang et al., 2020, Section 4 and 5.1, Appendix C.1, Figures 2 and 4).

Device m draws x ~ U[-1, 1]^d and y = u_mᵀx + ε with u_m = v + r_m, v ~ U[0, 1]^d,
r_m ~ N(0, ρ² I), ε ~ N(0, σ²). Local models are each device's least-squares fit, the
global model the least-squares fit on all devices' data: the points that gradient descent
(locally) and full-participation FedAvg with one full-batch step per round converge to
(the paper's Appendix B notes GD reaches the ridgeless solution). The α-interpolation is
f_α = α f_local + (1 − α) f_global (eq. 12), scored by the mean squared test error over
devices.

The theory curve is the paper's Theorem 2 with this generator's second moments:
E[xxᵀ] = I/3 and E‖r_m‖² = dρ², so its ρ² becomes dρ²/3; the test error adds the noise σ².
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SyntheticSetting:
    """The generator's sizes and variances (paper: d=20, M=100, 2,000 / 1,000 samples, σ=1.5)."""

    rho: float
    sigma: float = 1.5
    d: int = 20
    devices: int = 100
    n_train: int = 2000
    n_test: int = 1000


def generate(s: SyntheticSetting, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Train/test inputs and targets per device, shapes (M, n, d) and (M, n)."""
    v = rng.uniform(0.0, 1.0, s.d)
    u = v + rng.normal(0.0, s.rho, (s.devices, s.d))
    out = {"u": u, "v": v}
    for split, n in (("train", s.n_train), ("test", s.n_test)):
        x = rng.uniform(-1.0, 1.0, (s.devices, n, s.d))
        out[f"x_{split}"] = x
        out[f"y_{split}"] = np.einsum("mnd,md->mn", x, u) + rng.normal(0.0, s.sigma, (s.devices, n))
    return out


def fit_models(data: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Local least-squares weights (M, d) and the global least-squares weights (d,)."""
    x, y = data["x_train"], data["y_train"]
    local = np.stack([np.linalg.lstsq(xm, ym, rcond=None)[0] for xm, ym in zip(x, y)])
    global_w = np.linalg.lstsq(x.reshape(-1, x.shape[-1]), y.reshape(-1), rcond=None)[0]
    return local, global_w


def interpolation_errors(data: dict[str, np.ndarray], local: np.ndarray, global_w: np.ndarray,
                         alphas: np.ndarray) -> np.ndarray:
    """Mean squared test error over devices of f_α for each α (α=1: local, α=0: global)."""
    x, y = data["x_test"], data["y_test"]
    pred_local = np.einsum("mnd,md->mn", x, local)
    pred_global = x @ global_w
    return np.array([np.mean((a * pred_local + (1 - a) * pred_global - y) ** 2) for a in alphas])


def theory_errors(s: SyntheticSetting, alphas: np.ndarray) -> np.ndarray:
    """Theorem 2 (with ρ² → dρ²/3 for this generator) plus the noise σ²: expected test error of f_α."""
    n, m, sig2 = s.n_train, s.devices, s.sigma ** 2
    device_var = s.d * s.rho ** 2 / 3.0
    return (alphas ** 2 * s.d / n * sig2 + (1 - alphas) ** 2 * (m - 1) / m * device_var
            + (1 - alphas ** 2) * s.d / (m * n) * sig2 + sig2)


def optimal_alpha(s: SyntheticSetting) -> float:
    """Corollary 2's α* = ρ²/(ρ² + dσ²/N), with ρ² → dρ²/3 as in :func:`theory_errors`."""
    device_var = s.d * s.rho ** 2 / 3.0
    return device_var / (device_var + s.d * s.sigma ** 2 / s.n_train)


def run(rhos: list[float], out: Path, seed: int = 0, sigma: float = 1.5, steps: int = 21) -> dict:
    """Every ρ: fit, score the α grid, write ``lg_synthetic.csv``, ``summary.json`` and the figure."""
    out.mkdir(parents=True, exist_ok=True)
    alphas = np.linspace(0.0, 1.0, steps)
    rows, results = [], []
    for i, rho in enumerate(rhos):
        s = SyntheticSetting(rho=rho, sigma=sigma)
        data = generate(s, np.random.default_rng([seed, i]))
        local, global_w = fit_models(data)
        errs = interpolation_errors(data, local, global_w, alphas)
        theory = theory_errors(s, alphas)
        rows += [{"rho": rho, "sigma": sigma, "alpha": round(float(a), 6), "test_mse": float(e),
                  "theory_mse": float(t)} for a, e, t in zip(alphas, errs, theory)]
        best = int(np.argmin(errs))
        results.append({"rho": rho, "sigma": sigma, "local_mse": float(errs[-1]), "global_mse": float(errs[0]),
                        "best_alpha": float(alphas[best]), "best_mse": float(errs[best]),
                        "theory_alpha_star": optimal_alpha(s)})
    with (out / "lg_synthetic.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {"seed": seed, "settings": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(rows, results, out / "lg_synthetic.png")
    return summary


def _plot(rows: list[dict], results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        pts = [r for r in rows if r["rho"] == res["rho"]]
        a = [r["alpha"] for r in pts]
        noise = res["sigma"] ** 2
        ax.plot(a, [r["test_mse"] - noise for r in pts], "o-", ms=3, label="measured")
        ax.plot(a, [r["theory_mse"] - noise for r in pts], "--", label="Theorem 2")
        ax.axvline(res["theory_alpha_star"], color="grey", lw=0.8, label="α*")
        ax.set(title=f"σ={res['sigma']}, ρ={res['rho']}", xlabel="α (0: global, 1: local)", ylabel="test MSE − σ²")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
