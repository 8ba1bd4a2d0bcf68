"""Pareto frontiers of Charles & Konečný (2021), Figures 1–5: end points, orderings, the α and MAML
subset claims, the simulated Θ_K against the bound (13), and the written files."""

import csv
import math

import numpy as np
import pytest

from task.analysis.pareto import (COLUMNS, TITLES, fig1_vary_gamma, fig1_vary_k, fig2_momentum, fig3_alpha,
                         fig4_fedavg_vs_maml, fig5_simulated_maml, k_grid, log_kappa_and_cond_last, main,
                         write_outputs)
from task.analysis.surrogate import QuadraticFederation, Theta, kappa, kappa_last, random_spd, suboptimality

KS = k_grid(num=60)


def _curve(rows: list[dict], curve: str) -> list[dict]:
    return [r for r in rows if r["curve"] == curve]


def _column(rows: list[dict], name: str) -> np.ndarray:
    return np.array([r[name] for r in rows], dtype=float)


def _oneshot(kappa0: float) -> float:
    return (math.sqrt(kappa0) - 1) / (math.sqrt(kappa0) + 1)


def test_k_grid_is_log_spaced_integers_from_1_to_10_6():
    ks = k_grid()
    assert ks[0] == 1 and ks[-1] == 10**6 and np.all(np.diff(ks) > 0)


@pytest.mark.parametrize("L", [5.0, 50.0])
def test_fig1_vary_k_runs_from_minibatch_sgd_to_one_shot_averaging(L):
    rows = _curve(fig1_vary_k(KS), f"L={L:g}")
    rho, delta = _column(rows, "rho"), _column(rows, "delta")
    assert np.all(np.diff(rho) <= 1e-15) and np.all(np.diff(delta) >= -1e-15)
    assert rows[0]["K"] == 1 and rho[0] == pytest.approx((L - 1) / (L + 1), abs=1e-15) and delta[0] == 0.0
    assert rows[-1]["K"] == 10**6 and rho[-1] < 1e-6
    assert delta[-1] == pytest.approx(_oneshot(L), abs=1e-3)
    assert all(r["valid"] for r in rows)


def test_fig1_vary_gamma_reaches_rho_zero_only_for_the_small_condition_number():
    rows = fig1_vary_gamma(num=100)
    assert all(r["valid"] and r["K"] == 100 and 0 < r["gamma"] < 1 / r["L"] for r in rows)
    for L, reaches_zero in ((5.0, True), (50.0, False)):
        curve = _curve(rows, f"L={L:g}")
        rho = _column(curve, "rho")
        assert np.all(np.diff(rho) <= 1e-15)
        assert rho[0] == pytest.approx((L - 1) / (L + 1), abs=1e-4)
        assert curve[-1]["gamma"] > 0.999 / L
        assert (rho[-1] < 0.01) == reaches_zero


def test_fig2_momentum_orders_rates_at_equal_suboptimality():
    rows = fig2_momentum(KS)
    for L in (5.0, 50.0):
        none, nesterov, heavy = (_curve(rows, f"L={L:g}, {m}") for m in ("none", "nesterov", "heavy_ball"))
        assert _column(none, "delta") == pytest.approx(_column(heavy, "delta"))
        assert _column(none, "delta") == pytest.approx(_column(nesterov, "delta"))
        assert np.all(_column(heavy, "rho") <= _column(nesterov, "rho") + 1e-15)
        assert np.all(_column(nesterov, "rho") <= _column(none, "rho") + 1e-15)
        away_from_one_shot = _column(none, "kappa") > 1 + 1e-6
        assert away_from_one_shot.sum() > 10
        assert np.all(_column(heavy, "rho")[away_from_one_shot] < _column(none, "rho")[away_from_one_shot])


def test_fig2_heavy_ball_frontier_is_symmetric_about_the_diagonal():
    heavy = _curve(fig2_momentum(k_grid(num=400)), "L=50, heavy_ball")
    rho, delta = _column(heavy, "rho"), _column(heavy, "delta")
    order = np.argsort(rho)
    mirrored = np.interp(delta, rho[order], delta[order])  # Δ(ρ) at ρ = Δ_i should be ρ_i
    assert mirrored == pytest.approx(rho, abs=5e-3)


def test_fig3_proximal_frontiers_are_subsets_of_the_alpha_zero_frontier():
    rows = fig3_alpha(KS)
    base = _curve(rows, "α=0")
    rho0, delta0 = _column(base, "rho"), _column(base, "delta")
    order = np.argsort(rho0)
    min_rho = {}
    for a in ("0.5", "1", "5"):
        curve = _curve(rows, f"α={a}")
        rho, delta = _column(curve, "rho"), _column(curve, "delta")
        assert np.interp(rho, rho0[order], delta0[order]) == pytest.approx(delta, abs=2e-3)
        min_rho[a] = rho.min()
    assert min_rho["5"] > min_rho["1"] > min_rho["0.5"] > rho0.min() + 0.1


def test_fig4_maml_bound_is_a_subset_of_fedavg():
    rows = fig4_fedavg_vs_maml(KS)
    assert all(r["valid"] for r in rows)
    for m in ("none", "nesterov", "heavy_ball"):
        fedavg, maml = _curve(rows, f"FedAvg, {m}"), _curve(rows, f"MAML, {m}")
        rho_f, delta_f = _column(fedavg, "rho"), _column(fedavg, "delta")
        order = np.argsort(rho_f)
        rho_m, delta_m = _column(maml, "rho"), _column(maml, "delta")
        assert np.interp(rho_m, rho_f[order], delta_f[order]) == pytest.approx(delta_m, abs=2e-3)
        assert rho_m.min() > 0.4 > rho_f.min()
    limit = 10.0 * math.exp(-0.5 + 0.05)  # κ of (13) with γ = 1/(2LK) as K → ∞
    assert _curve(rows, "MAML, none")[-1]["kappa"] == pytest.approx(limit, rel=1e-5)


def test_fig5_simulated_maml_matches_the_bound_while_gamma_is_small():
    rows = fig5_simulated_maml(KS, seed=3)
    for d in (5, 100):
        curve = _curve(rows, f"MAML d={d}")
        small = [r for r in curve if r["valid"]]
        assert small and all(r["K"] * r["L"] * r["gamma"] < 1 for r in small)
        for r in small:
            assert r["kappa"] == pytest.approx(kappa_last(1.0, 10.0, 0.0, 0.001, r["K"]), rel=1e-9)
            assert r["delta"] == pytest.approx(suboptimality(10.0, r["kappa"]), abs=1e-9)
        beyond = [r for r in curve if not r["valid"]]
        assert max(r["delta"] for r in beyond) > 0.99 and max(r["rho"] for r in beyond) > 0.99
        cusp = min(curve, key=lambda r: r["rho"])
        assert cusp["rho"] > 0.1 and not cusp["valid"]
    fedavg = _curve(rows, "FedAvg")
    assert fedavg[-1]["rho"] < 1e-6 and fedavg[-1]["delta"] == pytest.approx(_oneshot(10.0), abs=1e-6)


def test_fig5_log_space_kappa_agrees_with_the_surrogate_kappa():
    rng = np.random.default_rng(1)
    A = random_spd(20, 1.0, 10.0, rng)
    fed = QuadraticFederation(A[None], np.zeros((1, 20)))
    lam = np.linalg.eigvalsh(A)
    for K in (1, 7, 150, 3000):
        log_kappa, _ = log_kappa_and_cond_last(lam, 0.0, 0.001, K)
        assert math.exp(log_kappa) == pytest.approx(kappa(fed, 0.0, 0.001, Theta.last(K)), rel=1e-9)


def test_write_outputs_and_main(tmp_path, capsys):
    paths = write_outputs(tmp_path / "a")
    assert set(paths) == {"pareto.csv"} | {f"{name}.png" for name in TITLES}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    with paths["pareto.csv"].open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    assert {r["figure"] for r in rows} == set(TITLES)
    for r in rows:
        values = [float(r[c]) for c in ("mu", "L", "alpha", "gamma", "K", "kappa", "rho", "delta")]
        assert all(math.isfinite(v) for v in values)
        assert 0.0 <= float(r["rho"]) <= 1.0 and 0.0 <= float(r["delta"]) <= 1.0
        assert (r["d"] != "") == r["curve"].startswith("MAML d=")
    assert main(["--out", str(tmp_path / "b"), "--seed", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(paths)
