"""Representation measurements of FedAvg-FT §5.2: class cosine similarity, CKA, fine-tuning transfer."""

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from task.analysis.representation import (
    CKAAccumulator,
    cka_by_layer,
    class_cosine_matrix,
    cosine_summary,
    fine_tune_transfer,
    layer_activations,
    linear_cka,
    plot_cka_by_layer,
    plot_transfer,
    write_cosine,
)

# ---------------------------------------------------------------- cosine similarity


def test_orthogonal_classes_give_identity():
    feats = np.array([[1.0, 0], [2, 0], [0.5, 0], [0, 3], [0, 1]])
    matrix = class_cosine_matrix(feats, np.array([0, 0, 0, 1, 1]), 2)
    np.testing.assert_allclose(matrix, np.eye(2), atol=1e-12)
    assert cosine_summary(matrix) == pytest.approx({"mean_diagonal": 1.0, "mean_off_diagonal": 0.0})


def test_mixed_angles_by_hand_and_the_nan_rule():
    """Class 0 = {(1,0), (1,1)}, class 1 = {(0,1), (0,2), (-1,0)}, class 2 one sample, class 3 none."""
    feats = np.array([[1.0, 0], [1, 1], [0, 1], [0, 2], [-1, 0], [3, 4]])
    matrix = class_cosine_matrix(feats, np.array([0, 0, 1, 1, 1, 2]), 4)
    r = 1 / math.sqrt(2)
    assert matrix[0, 0] == pytest.approx(r)
    assert matrix[1, 1] == pytest.approx((1 + 0 + 0) / 3)
    assert matrix[0, 1] == pytest.approx(matrix[1, 0]) == pytest.approx((0 + 0 - 1 + r + r - r) / 6)
    assert matrix[0, 2] == pytest.approx((0.6 + r * 1.4) / 2)  # (3,4)/5 against (1,0) and (1,1)/√2
    assert np.isnan(matrix[2, 2])  # one sample: no pair of distinct samples
    assert np.isnan(matrix[3]).all() and np.isnan(matrix[:, 3]).all()
    summary = cosine_summary(matrix)
    assert summary["mean_diagonal"] == pytest.approx((r + 1 / 3) / 2)
    assert summary["mean_off_diagonal"] == pytest.approx(np.mean([matrix[i, j] for i, j in
                                                                  [(0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)]]))


def test_zero_rows_count_as_zero_vectors():
    feats = np.array([[1.0, 0], [2, 0], [0, 0], [0, 1]])
    matrix = class_cosine_matrix(feats, np.array([0, 0, 0, 1]), 2)
    assert matrix[0, 0] == pytest.approx(1 / 3)  # pairs: (a, b) = 1, (a, 0) = 0, (b, 0) = 0
    assert matrix[0, 1] == pytest.approx(0.0)


def test_cosine_matrix_matches_brute_force():
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((60, 5)) + 0.5
    labels = rng.integers(0, 4, 60)
    unit = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    cos = unit @ unit.T
    expected = np.empty((4, 4))
    for i, j in itertools.product(range(4), repeat=2):
        block = cos[np.ix_(labels == i, labels == j)]
        expected[i, j] = (block.sum() - np.trace(block)) / (block.size - len(block)) if i == j else block.mean()
    np.testing.assert_allclose(class_cosine_matrix(torch.tensor(feats), torch.tensor(labels), 4), expected,
                               rtol=1e-10, atol=1e-12)


def test_write_cosine(tmp_path):
    matrix = np.array([[1.0, 0.25], [0.25, np.nan]])
    write_cosine(matrix, ["cat", "dog"], tmp_path / "cos.png", tmp_path / "cos.csv", "test")
    assert (tmp_path / "cos.png").stat().st_size > 0
    rows = (tmp_path / "cos.csv").read_text().splitlines()
    assert rows == ["class,cat,dog", "cat,1,0.25", "dog,0.25,nan"]


# ---------------------------------------------------------------- CKA


def cka_from_definition(x: np.ndarray, y: np.ndarray) -> float:
    """HSIC(K, L) = tr(KHLH)/(n−1)² with linear kernels and H = I − 11ᵀ/n."""
    n = len(x)
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = x @ x.T, y @ y.T

    def hsic(a, b):
        return np.trace(a @ h @ b @ h) / (n - 1) ** 2

    return hsic(k, l_) / math.sqrt(hsic(k, k) * hsic(l_, l_))


def unbiased_hsic_u_statistic(x: np.ndarray, y: np.ndarray) -> float:
    """Song et al. (2012) as a U-statistic: the mean over distinct (i, j, q, r) of
    K_ij L_ij + K_ij L_qr − 2 K_ij L_iq (linear kernels)."""
    k, l_ = x @ x.T, y @ y.T
    terms = [k[i, j] * l_[i, j] + k[i, j] * l_[q, r] - 2 * k[i, j] * l_[i, q]
             for i, j, q, r in itertools.permutations(range(len(x)), 4)]
    return float(np.mean(terms))


@pytest.mark.parametrize("n, d1, d2", [(30, 5, 4), (8, 12, 20)])  # feature form and Gram form
def test_linear_cka_matches_the_definition(n, d1, d2):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, d1))
    y = np.tanh(x @ rng.standard_normal((d1, d2))) + 0.3 * rng.standard_normal((n, d2))
    assert linear_cka(x, y) == pytest.approx(cka_from_definition(x, y), rel=1e-10)


def test_linear_cka_invariances():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((100, 6)) @ rng.standard_normal((6, 6))
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    assert linear_cka(x, x) == pytest.approx(1.0)
    assert linear_cka(x, 3.7 * x @ q + 2.0) == pytest.approx(1.0)  # orthogonal, isotropic scaling, shift
    y = rng.standard_normal((100, 8))
    assert linear_cka(x, y) == pytest.approx(linear_cka(x @ q, -0.1 * y))
    skew = np.diag([10.0, 1, 1, 1, 1, 0.1]) @ rng.standard_normal((6, 6))  # invertible, not orthogonal
    assert linear_cka(x, x @ skew) < 0.95


def test_accumulator_is_the_unbiased_hsic_per_pair():
    rng = np.random.default_rng(2)
    a = [rng.standard_normal((7, 3)), rng.standard_normal((7, 2, 2))]
    b = [a[0] @ rng.standard_normal((3, 4)) + 0.5 * rng.standard_normal((7, 4)), rng.standard_normal((7, 5)),
         a[1].reshape(7, 4) + 1.0]
    acc = CKAAccumulator()
    acc.update([torch.tensor(v) for v in a], [torch.tensor(v) for v in b])
    result = acc.result()
    assert result.shape == (2, 3)
    for (k, xa), (j, yb) in itertools.product(enumerate(a), enumerate(b)):
        xa, yb = xa.reshape(7, -1), yb.reshape(7, -1)
        expected = unbiased_hsic_u_statistic(xa, yb) / math.sqrt(
            unbiased_hsic_u_statistic(xa, xa) * unbiased_hsic_u_statistic(yb, yb))
        assert result[k, j] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="n >= 4"):
        acc.update([torch.zeros(3, 2)], [torch.zeros(3, 2)])


def test_minibatch_cka_is_close_to_full_cka_on_a_large_sample():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4000, 20, generator=gen)
    y = torch.tanh(x[:, :12] @ torch.randn(12, 15, generator=gen)) + 0.5 * torch.randn(4000, 15, generator=gen)
    acc = CKAAccumulator()
    for start in range(0, 4000, 500):
        acc.update([x[start : start + 500]], [y[start : start + 500]])
    full = linear_cka(x, y)
    assert 0.2 < full < 0.9
    assert acc.result()[0, 0] == pytest.approx(full, abs=0.02)


def tiny_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3), nn.Dropout(0.5))


def test_layer_activations_shapes_and_modes():
    model = tiny_net(0)
    model[0].eval()  # mixed flags must survive
    x = torch.randn(10, 1, 6, 6)
    acts = layer_activations(model, x, ["0", "3", "4"], batch_size=4)
    assert {k: tuple(v.shape) for k, v in acts.items()} == {"0": (10, 32), "3": (10, 3), "4": (10, 3)}
    assert acts["0"].dtype == torch.float32
    torch.testing.assert_close(acts["4"], acts["3"])  # dropout off in eval mode
    with torch.no_grad():
        torch.testing.assert_close(acts["3"], model[:4](x))
    assert model.training and model[4].training and not model[0].training
    assert not any(m._forward_hooks for m in model.modules())


def test_cka_by_layer(tmp_path):
    model, other = tiny_net(0), tiny_net(1)
    x = torch.randn(64, 1, 6, 6)
    layers = ["0", "3"]
    assert cka_by_layer(model, model, x, layers, batch_size=16, minibatch=False) == pytest.approx([1.0, 1.0])
    assert cka_by_layer(model, model, x, layers, batch_size=16, minibatch=True) == pytest.approx([1.0, 1.0])
    assert model.training and model[0].training and torch.is_grad_enabled()  # same model on both sides
    full = cka_by_layer(model, other, x, layers, batch_size=16, minibatch=False)
    acts_a, acts_b = layer_activations(model, x, layers, 64), layer_activations(other, x, layers, 64)
    assert full == pytest.approx([linear_cka(acts_a[n], acts_b[n]) for n in layers])
    assert all(v < 0.999 for v in full)
    plot_cka_by_layer({"same": [1.0, 1.0], "other": full}, layers, tmp_path / "cka.png", "test")
    assert (tmp_path / "cka.png").stat().st_size > 0


# ---------------------------------------------------------------- fine-tuning transfer


def blobs(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes at 3·e_y in R³ plus small noise."""
    y = torch.randint(0, 3, (n,), generator=gen)
    return 3.0 * torch.eye(3)[y] + 0.3 * torch.randn(n, 3, generator=gen), y


def blob_clients(count: int) -> list:
    gen = torch.Generator().manual_seed(7)
    return [(*blobs(80, gen), *blobs(100, gen)) for _ in range(count)]


def blob_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))


def solved_state() -> dict:
    model = blob_model()
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(torch.eye(3))
            layer.bias.zero_()
    return model.state_dict()


def test_fine_tune_transfer(tmp_path):
    clients = blob_clients(2)
    kw = {"epochs": 5, "samples_per_epoch": [0, 60], "trials": 2, "lr": 0.3, "batch_size": 10, "seed": 0}
    solved = fine_tune_transfer(blob_model, solved_state(), clients, **kw)
    assert min(solved["mean"]) > 0.95
    torch.manual_seed(5)
    random_state = blob_model().state_dict()
    random = fine_tune_transfer(blob_model, random_state, clients, **kw)
    assert random["mean"][1] > random["mean"][0] + 0.2 and random["mean"][1] > 0.8
    assert len(random["accuracies"][0]) == 4 and random["samples_per_epoch"] == [0, 60]
    assert random == fine_tune_transfer(blob_model, random_state, clients, **kw)
    plot_transfer({"solved": solved, "random": random}, tmp_path / "ft.png", "test")
    assert (tmp_path / "ft.png").stat().st_size > 0


def test_new_head_on_solved_features_is_deterministic():
    """A re-initialised head on the solved body learns from samples (head only); same seed, same numbers."""
    def new_head(model):
        model[2].reset_parameters()

    kw = {"epochs": 5, "samples_per_epoch": [0, 60], "trials": 2, "lr": 0.5, "batch_size": 10, "seed": 1,
          "train_head_only": True, "new_head": new_head}
    first = fine_tune_transfer(blob_model, solved_state(), blob_clients(2), **kw)
    assert first["mean"][1] > 0.9 and first["mean"][1] > first["mean"][0]
    assert first == fine_tune_transfer(blob_model, solved_state(), blob_clients(2), **kw)
    assert first != fine_tune_transfer(blob_model, solved_state(), blob_clients(2), **{**kw, "seed": 2})
