"""LG-FedAvg's synthetic analysis (Section 4, Figures 2 and 4)."""

import json

import numpy as np
import pytest

from flower_app.cli import main
from task.analysis.lg_synthetic import SyntheticSetting, fit_models, generate, interpolation_errors, run, theory_errors


def test_generator_shapes_and_local_fit_recovers_teacher():
    s = SyntheticSetting(rho=0.1, devices=5, n_train=4000, n_test=10, sigma=0.1)
    data = generate(s, np.random.default_rng(0))
    assert data["x_train"].shape == (5, 4000, 20) and data["y_test"].shape == (5, 10)
    assert np.abs(data["x_train"]).max() <= 1.0
    local, global_w = fit_models(data)
    np.testing.assert_allclose(local, data["u"], atol=0.02)
    np.testing.assert_allclose(global_w, data["u"].mean(axis=0), atol=0.02)


@pytest.mark.parametrize("rho", [0.1, 0.06])
def test_interpolation_beats_both_extremes(rho):
    s = SyntheticSetting(rho=rho)
    data = generate(s, np.random.default_rng(1))
    alphas = np.linspace(0, 1, 21)
    errs = interpolation_errors(data, *fit_models(data), alphas)
    best = int(np.argmin(errs))
    assert 0 < best < len(alphas) - 1
    assert errs[best] < min(errs[0], errs[-1]) - 1e-3


def test_theory_matches_measurement_when_device_variance_dominates():
    s = SyntheticSetting(rho=0.5)
    data = generate(s, np.random.default_rng(2))
    alphas = np.array([0.0, 0.5, 1.0])
    measured = interpolation_errors(data, *fit_models(data), alphas) - s.sigma ** 2
    theory = theory_errors(s, alphas) - s.sigma ** 2
    np.testing.assert_allclose(measured[:2], theory[:2], rtol=0.1)


def test_command_writes_csv_summary_and_plot(tmp_path):
    assert main(["lg-synthetic", "--out", str(tmp_path), "--rho", "0.1"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["settings"][0]["rho"] == 0.1
    assert (tmp_path / "lg_synthetic.png").stat().st_size > 0
    assert len((tmp_path / "lg_synthetic.csv").read_text().splitlines()) == 22
    assert run([0.1], tmp_path / "again")["settings"] == summary["settings"]
