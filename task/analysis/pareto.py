"""Convergence/accuracy Pareto frontiers of local update methods (Charles & Konečný 2021, §5).

Every point is a pair (ρ, Δ) ∈ [0, 1]²: ρ is the ServerOpt rate of Table 2 at the surrogate
condition number κ(α, γ, Θ), and Δ is the suboptimality (17) with κ₀ = L/μ. κ comes from the
bound (11) for Θ_{1:K} (FedAvg-style) or (13) for Θ_K (MAML-style), as in Figures 1–4.

Figure 5 instead simulates Θ_K on one random A with μ ⪯ A ⪯ L: κ is (9) on the eigenvalues of A,
and Δ is Lemma 5's (√b − √a)/(√b + √a) with b/a = cond(Q(α, γ, Θ_K)). When
γ < 1/(KL + α), cond(Q) = κ₀/κ (Lemma 6, with equality as μ and L are eigenvalues of A), so
this Δ is (17); beyond that (17) no longer bounds the distance (κ grows past κ₀ and (17) turns
negative), which is where the MAML frontier leaves FedAvg's. There κ is computed in log space,
since (1 − γλ)^{K−1} underflows long before K = 10⁶, and capped at ``KAPPA_CAP``, beyond which
ρ and Δ are 1 in double precision.

``write_outputs`` writes every point to ``pareto.csv`` and draws one PNG per figure.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from task.analysis.surrogate import MOMENTUM_TYPES, kappa_last, kappa_prefix, random_spd, rate, suboptimality

COLUMNS = ("figure", "curve", "mu", "L", "alpha", "gamma", "K", "theta", "momentum", "d", "kappa", "rho",
           "delta", "valid")
TITLES = {
    "fig1_vary_K": "Fig. 1: μ=1, α=0, Θ_{1:K}, GD, γ=0.01, K ∈ [1, 10⁶]",
    "fig1_vary_gamma": "Fig. 1: μ=1, α=0, Θ_{1:K}, GD, K=100, γ ∈ (0, 1/L)",
    "fig2_momentum": "Fig. 2: μ=1, α=0, Θ_{1:K}, γ=1/(2L), K ∈ [1, 10⁶]",
    "fig3_alpha": "Fig. 3: μ=1, L=10, Θ_{1:K}, GD, γ=1/(2(L+α)), K ∈ [1, 10⁶]",
    "fig4_fedavg_vs_maml": "Fig. 4: μ=1, L=10, α=0; Θ_{1:K} γ=0.001, Θ_K γ=1/(2LK)",
    "fig5_simulated_maml": "Fig. 5: μ=1, L=10, α=0, γ=0.001, GD; simulated Θ_K vs Θ_{1:K}",
}
KAPPA_CAP = 1e300
LINESTYLES = {"none": "-", "nesterov": "--", "heavy_ball": ":"}


def k_grid(max_k: int = 10**6, num: int = 200) -> np.ndarray:
    """Distinct integers K ∈ [1, max_k], log-spaced."""
    return np.unique(np.round(np.logspace(0, math.log10(max_k), num)).astype(int))


def gamma_grid(L: float, num: int = 200) -> np.ndarray:
    """Client learning rates in (0, 1/L): geometric from 10⁻⁶/L, then geometrically closer to 1/L."""
    half = num // 2
    small = np.geomspace(1e-6, 0.5, half, endpoint=False)
    near_one = 1.0 - np.geomspace(0.5, 1e-6, num - half)
    return np.concatenate([small, near_one]) / L


def bound_holds(theta: str, L: float, alpha: float, gamma: float, K: int) -> bool:
    """The step-size condition of the κ bound: γ < 1/(L + α) for Θ_{1:K} (Lemma 3),
    γ < 1/(KL + α) for Θ_K (Lemma 4)."""
    return gamma < 1.0 / ((L if theta == "prefix" else K * L) + alpha)


def point(figure: str, curve: str, *, mu: float, L: float, alpha: float, gamma: float, K: int, theta: str,
          momentum: str, kappa: float, delta: float | None = None, d: int | None = None) -> dict:
    """One CSV row: ρ from Table 2 and, unless given, Δ from (17) with κ₀ = L/μ.

    κ is a ratio of largest to smallest eigenvalue, so rounding below 1 is clipped; so is rounding
    above κ₀ when Δ comes from (17), whose bound (Lemma 6) keeps κ ≤ κ₀.
    """
    kappa = max(kappa, 1.0)
    if delta is None:
        delta = suboptimality(L / mu, min(kappa, L / mu))
    return {"figure": figure, "curve": curve, "mu": mu, "L": L, "alpha": alpha, "gamma": float(gamma),
            "K": int(K), "theta": theta, "momentum": momentum, "d": d, "kappa": kappa,
            "rho": rate(kappa, momentum), "delta": delta, "valid": bound_holds(theta, L, alpha, gamma, K)}


def fig1_vary_k(ks: np.ndarray) -> list[dict]:
    """Figure 1 (left): γ = 0.01 fixed, K varies, L ∈ {5, 50}."""
    return [point("fig1_vary_K", f"L={L:g}", mu=1.0, L=L, alpha=0.0, gamma=0.01, K=K, theta="prefix",
                  momentum="none", kappa=kappa_prefix(1.0, L, 0.0, 0.01, K))
            for L in (5.0, 50.0) for K in ks]


def fig1_vary_gamma(num: int = 200) -> list[dict]:
    """Figure 1 (right): K = 100 fixed, γ varies over (0, 1/L), L ∈ {5, 50}."""
    return [point("fig1_vary_gamma", f"L={L:g}", mu=1.0, L=L, alpha=0.0, gamma=g, K=100, theta="prefix",
                  momentum="none", kappa=kappa_prefix(1.0, L, 0.0, g, 100))
            for L in (5.0, 50.0) for g in gamma_grid(L, num)]


def fig2_momentum(ks: np.ndarray) -> list[dict]:
    """Figure 2: γ = 1/(2L), K varies, L ∈ {5, 50}, each server momentum type."""
    rows = []
    for L in (5.0, 50.0):
        kappas = [kappa_prefix(1.0, L, 0.0, 0.5 / L, K) for K in ks]
        rows += [point("fig2_momentum", f"L={L:g}, {m}", mu=1.0, L=L, alpha=0.0, gamma=0.5 / L, K=K,
                       theta="prefix", momentum=m, kappa=k)
                 for m in MOMENTUM_TYPES for K, k in zip(ks, kappas)]
    return rows


def fig3_alpha(ks: np.ndarray) -> list[dict]:
    """Figure 3: L = 10, γ = 1/(2(L + α)), K varies, α ∈ {0, 0.5, 1, 5} (proximal client updates)."""
    return [point("fig3_alpha", f"α={a:g}", mu=1.0, L=10.0, alpha=a, gamma=0.5 / (10.0 + a), K=K, theta="prefix",
                  momentum="none", kappa=kappa_prefix(1.0, 10.0, a, 0.5 / (10.0 + a), K))
            for a in (0.0, 0.5, 1.0, 5.0) for K in ks]


def fig4_fedavg_vs_maml(ks: np.ndarray) -> list[dict]:
    """Figure 4: L = 10, FedAvg (Θ_{1:K}, γ = 0.001, bound (11)) vs MAML (Θ_K, γ = 1/(2LK), bound (13))."""
    L, rows = 10.0, []
    for m in MOMENTUM_TYPES:
        rows += [point("fig4_fedavg_vs_maml", f"FedAvg, {m}", mu=1.0, L=L, alpha=0.0, gamma=0.001, K=K,
                       theta="prefix", momentum=m, kappa=kappa_prefix(1.0, L, 0.0, 0.001, K)) for K in ks]
        rows += [point("fig4_fedavg_vs_maml", f"MAML, {m}", mu=1.0, L=L, alpha=0.0, gamma=0.5 / (L * K), K=K,
                       theta="last", momentum=m, kappa=kappa_last(1.0, L, 0.0, 0.5 / (L * K), K)) for K in ks]
    return rows


def log_kappa_and_cond_last(lam: np.ndarray, alpha: float, gamma: float, K: int) -> tuple[float, float]:
    """log κ (9) and log cond(Q) for Θ_K on one client with Hessian eigenvalues ``lam`` (needs γ < 1/(L + α)).

    Q's eigenvalues are (1 − γ(λ + α))^{K−1}; working with their logs avoids underflow at large K.
    """
    log_q = (K - 1) * np.log1p(-gamma * (lam + alpha))
    return float(np.ptp(log_q + np.log(lam))), float(np.ptp(log_q))


def fig5_simulated_maml(ks: np.ndarray, seed: int = 0) -> list[dict]:
    """Figure 5: Θ_K simulated on one random A per d ∈ {5, 100}, γ = 0.001, against the Θ_{1:K} bound (11)."""
    mu, L, gamma = 1.0, 10.0, 0.001
    rng = np.random.default_rng(seed)
    rows = []
    for d in (5, 100):
        lam = np.linalg.eigvalsh(random_spd(d, mu, L, rng))
        for K in ks:
            log_kappa, log_cond_q = log_kappa_and_cond_last(lam, 0.0, gamma, K)
            rows.append(point("fig5_simulated_maml", f"MAML d={d}", mu=mu, L=L, alpha=0.0, gamma=gamma, K=K,
                              theta="last", momentum="none", kappa=math.exp(min(log_kappa, math.log(KAPPA_CAP))),
                              delta=math.tanh(log_cond_q / 4.0), d=d))  # (√c − 1)/(√c + 1), c = cond(Q)
    rows += [point("fig5_simulated_maml", "FedAvg", mu=mu, L=L, alpha=0.0, gamma=gamma, K=K, theta="prefix",
                   momentum="none", kappa=kappa_prefix(mu, L, 0.0, gamma, K)) for K in ks]
    return rows


def frontier_rows(ks: np.ndarray | None = None, seed: int = 0) -> list[dict]:
    """Every point of Figures 1–5, K over ``ks`` (default ``k_grid()``); ``seed`` draws Figure 5's matrices."""
    ks = k_grid() if ks is None else ks
    return (fig1_vary_k(ks) + fig1_vary_gamma() + fig2_momentum(ks) + fig3_alpha(ks) + fig4_fedavg_vs_maml(ks)
            + fig5_simulated_maml(ks, seed))


def plot_figure(rows: list[dict], figure: str, path: Path) -> None:
    """Draw one figure's curves in the (ρ, Δ) square: colour per setting, line style per momentum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    colors: dict[tuple, str] = {}
    for curve in dict.fromkeys(r["curve"] for r in rows if r["figure"] == figure):
        pts = [r for r in rows if r["figure"] == figure and r["curve"] == curve]
        setting = (pts[0]["L"], pts[0]["alpha"], pts[0]["theta"], pts[0]["d"])
        colors.setdefault(setting, f"C{len(colors)}")
        ax.plot([r["rho"] for r in pts], [r["delta"] for r in pts], LINESTYLES[pts[0]["momentum"]],
                color=colors[setting], label=curve)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="convergence rate ρ", ylabel="suboptimality Δ", title=TITLES[figure])
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Write ``pareto.csv`` (all points) and one PNG per figure into ``out_dir``; return name → path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = frontier_rows(seed=seed)
    paths = {"pareto.csv": out_dir / "pareto.csv"}
    with paths["pareto.csv"].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    for figure in TITLES:
        paths[f"{figure}.png"] = out_dir / f"{figure}.png"
        plot_figure(rows, figure, paths[f"{figure}.png"])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flrep pareto", description="Pareto frontiers (ρ, Δ) of Figures 1–5.")
    parser.add_argument("--out", required=True, type=Path, help="directory for pareto.csv and the figures")
    parser.add_argument("--seed", type=int, default=0, help="seed of Figure 5's random matrices")
    args = parser.parse_args(argv)
    for path in write_outputs(args.out, args.seed).values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
